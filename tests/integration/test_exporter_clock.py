"""`refill exporter` exports the runs running and those that ended in the last
`--recent-minutes`, judged on the database's clock (which wrote `finished_at`), not on the
exporter host's: a host an hour fast would otherwise drop a run that ended minutes ago."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from refill.admin import exporter
from refill.models.clock import set_clock_offset
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
