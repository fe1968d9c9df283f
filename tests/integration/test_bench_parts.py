"""`bench overhead --parts` (bench/parts.py): a batch's parts are timed where `record_results`
finds them, each call counted once, its outcome unchanged, and the functions put back after."""

from __future__ import annotations

from bench.parts import PARTS, Parts
from refill.models import results
from refill.models.context import RunContext
from tests.support.driver import FLAT, SPREAD, Driver


def test_a_batch_is_timed_part_by_part_and_the_functions_put_back(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, check=False)
    d.admit()
    ids = [a.id for a in d.live()[:3]]
    d.start_all(ids)
    before = (RunContext.__dict__["open"], RunContext.__dict__["__exit__"], results._read_batch, results._record_one, results.top_up)
    parts = Parts()
    with parts.installed():
        recorded = d.record(d.result(ids[0], SPREAD), d.result(ids[1], FLAT), d.result(ids[2], SPREAD))
    after = (RunContext.__dict__["open"], RunContext.__dict__["__exit__"], results._read_batch, results._record_one, results.top_up)
    assert after == before
    assert [r.outcome.value for r in recorded.outcomes] == ["COMMITTED", "FILTERED", "COMMITTED"]
    # one lock, one read and one write for the batch; a decision per result, and the top-up
    assert dict(parts.calls) == {"lock": 1, "read": 1, "decide": 4, "write": 1}
    assert set(parts.wall) == set(PARTS) and all(parts.wall[p] > 0 for p in PARTS)
