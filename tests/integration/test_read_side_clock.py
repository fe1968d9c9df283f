"""The read side judges the ledger's times on the ledger's clock, which wrote them, not on the
clock of the machine it runs on (here an hour fast): `refill exporter`'s runs that ended in the
last `--recent-minutes`, and `refill workers`' leases and recent work."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from refill.admin import exporter
from refill.admin.fleet_queries import worker_rows
from refill.models.clock import set_clock_offset
from refill.models.leases import start_attempt
from refill.models.results import record_results
from tests.support.driver import Driver


@pytest.fixture
def an_hour_fast() -> Iterator[None]:
    set_clock_offset(3600.0)
    yield
    set_clock_offset(0.0)


def test_recently_ended_runs_are_judged_on_the_ledgers_clock(pg_ledger, an_hour_fast) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger)
    pg_ledger.transaction(
        lambda s: s.execute(
            text(
                "UPDATE runs SET status = 'completed', end_reason = 'max_num_steps', "
                "finished_at = now() - interval '30 minutes' WHERE id = :r"
            ),
            {"r": d.run_id},
        )
    )
    runs, _ = exporter.read_ledger(pg_ledger, recent_minutes=60)
    assert [(r.run_id, r.status) for r in runs] == [(d.run_id, "completed")]
    runs, _ = exporter.read_ledger(pg_ledger, recent_minutes=20)
    assert runs == []


def test_leases_and_recent_work_are_judged_on_the_ledgers_clock(pg_ledger, an_hour_fast) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger)
    d.admit()
    ids = sorted(a.id for a in d.live())[:3]
    for attempt_id in ids:
        # No `now`: the lease runs from the database's clock, as a worker's does.
        assert pg_ledger.transaction(lambda s, a=attempt_id: start_attempt(s, a, "gpu-1")) is not None
    # One finishes, recorded at the database's time, as the consumer records it.
    done = d.result(ids[0], [1.0, 0.0, 1.0, 0.0], worker="gpu-1")
    pg_ledger.transaction(lambda s: record_results(s, [done]))
    rows = pg_ledger.transaction(lambda s: worker_rows(s, run_id=d.run_id, since_seconds=600))
    (row,) = [r for r in rows if r["worker"] == "gpu-1"]
    assert row["in_flight"] == 2 and row["expired_leases"] == 0
    assert row["finished_recently"] == 1
