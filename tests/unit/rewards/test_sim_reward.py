from __future__ import annotations

from refill.rewards.sim import SOLVED_MARKER, UNSOLVED_MARKER, solved


def test_solved_reads_the_marker_only():
    assert solved(SOLVED_MARKER, {}) == 1.0
    assert solved(f"  {SOLVED_MARKER}\n", {"answer": "x"}) == 1.0
    assert solved(UNSOLVED_MARKER, {}) == 0.0
    assert solved(SOLVED_MARKER + " but more", {}) == 0.0
    assert solved("", {}) == 0.0
