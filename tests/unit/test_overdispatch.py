"""Over-dispatch's pure helpers (the ledger side is tests/integration/test_overdispatch.py)."""

from __future__ import annotations

from refill.models.overdispatch import steps_between


def test_steps_between_open_steps_are_the_settled_ones() -> None:
    assert steps_between([0]) == [(0, None)]
    assert steps_between([2, 3, 6]) == [(-1, 2), (3, 6), (6, None)]
    settled = {s for s in range(10) if any(low < s and (high is None or s < high) for low, high in steps_between([2, 3, 6]))}
    assert settled == {0, 1, 4, 5, 7, 8, 9}
