"""Scenario 3 of issue 20: the fleet's clocks disagree. Leases and time-outs are decided on the
database's clock (refill.models.clock), so a worker whose own clock is minutes off is neither
reaped early (a clock behind) nor kept alive past its lease once it dies (a clock ahead).

The skew is injected with REFILL_CHAOS_CLOCK_OFFSET_SECONDS (refill.tasks.chaos), which
shifts what a process believes the time is (`utcnow`); the controller in this process is
shifted the same way, through the hook the knob sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from refill.models import clock
from refill.models.clock import ledger_now, set_clock_offset, utcnow
from refill.models.db import Ledger
from refill.models.tables import Attempt, Base, Run
from refill.tasks.chaos import CLOCK_OFFSET_SECONDS
from tests.support.chaos_fleet import (
    FAULT_RUN,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
)
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

SKEW = 300.0  # five minutes, both ways
LEASE_SECONDS = 3
LATENCY = 0.4


@pytest.fixture
def skewed_here() -> Iterator[None]:
    """This process's clock two minutes behind (the controller's, here)."""
    set_clock_offset(-120)
    try:
        yield
    finally:
        set_clock_offset(0)


def test_ledger_now_is_the_databases_clock(fault_ledger, tmp_path, skewed_here) -> None:
    """PostgreSQL's clock whatever this process believes; on SQLite (one process) the
    process's own, shifted or not."""
    with fault_ledger.session() as session:
        now = ledger_now(session)
        assert ledger_now(session) is now  # read once per transaction
        assert abs((now - session.scalar(select(func.now()))).total_seconds()) < 1
    assert (now - utcnow()).total_seconds() == pytest.approx(120, abs=5)
    lite = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    try:
        Base.metadata.create_all(lite.engine)
        with lite.session() as session:
            assert abs((ledger_now(session) - utcnow()).total_seconds()) < 1
    finally:
        lite.dispose()
    assert clock.utcnow is utcnow


def test_workers_with_skewed_clocks(fleet, fault_ledger, skewed_here) -> None:
    for name in fleet.names("generate") + fleet.names("consume"):
        fleet.stop(name)
    behind, ahead = fleet.fresh_name("generate-behind"), fleet.fresh_name("generate-ahead")
    consumer = fleet.fresh_name("consume-ahead")
    for name, role, offset in ((behind, "generate", -SKEW), (ahead, "generate", SKEW), (consumer, "consume", SKEW)):
        fleet.start(role, name=name, env={CLOCK_OFFSET_SECONDS: str(offset)}, wait=False)
    for name in (behind, ahead, consumer):
        fleet.wait_ready(name, 90)
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, {
            "grpo": {"max_num_steps": 6},
            "generation": {
                "lease_seconds": LEASE_SECONDS,
                "sim": {"latency": {"distribution": "constant", "mean_seconds": LATENCY}},
            },
        }),
    )

    def fresh_on_ahead(session) -> list[int]:  # type: ignore[no-untyped-def]
        now = session.scalar(select(func.now()))
        rows = session.execute(
            select(Attempt.id, Attempt.started_at).where(
                Attempt.run_id == run_id, Attempt.state == "running", Attempt.worker == ahead
            )
        ).all()
        return [a for a, started in rows if (now - started).total_seconds() < LATENCY / 3]

    def mid_task(session) -> bool:  # type: ignore[no-untyped-def]
        if session.scalar(select(Run.weight_version).where(Run.id == run_id)) < 2:
            return False
        return len(fresh_on_ahead(session)) >= 2

    def kill():  # type: ignore[no-untyped-def]
        fleet.kill(ahead)
        with fault_ledger.session() as session:
            return session.scalar(select(func.now()))

    result = drive_with_fault(fleet, fault_ledger, run_id, when=mid_task, fault=kill)
    killed_at = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        attempts = list(session.scalars(select(Attempt).where(Attempt.run_id == run_id)))
        ended = session.scalar(select(func.now()))
    reaped = [a for a in attempts if a.failure_kind == "infra" and "stopped heartbeating" in (a.error or "")]
    late = max(((a.finished_at - killed_at).total_seconds() for a in reaped), default=0.0)
    print(facts.line(
        "skewed-clocks", result.seconds, skew_seconds=SKEW, reaped=len(reaped),
        reaped_after_kill_seconds=round(late, 1),
    ))
    assert_nothing_lost(facts, steps=6)
    for name in (behind, ahead, consumer):
        assert f"{CLOCK_OFFSET_SECONDS}=" in fleet.log(name)  # each read its knob (when its runtime was built)
    # Nothing was reaped early: the only leases that expired were the killed worker's, though
    # one live worker's clock was five minutes behind and the controller's two.
    assert reaped and {a.worker for a in reaped} == {ahead}
    # Nor kept alive past its lease: the worker five minutes ahead died holding attempts, and
    # each was reaped within its lease and a couple of reaper intervals of the kill.
    assert late < LEASE_SECONDS + 4, [(a.id, a.finished_at, a.leased_until) for a in reaped]
    # What the ledger wrote is on its own clock, not the workers' nor the consumer's.
    window = timedelta(seconds=SKEW / 2)
    assert all(a.started_at < ended + window and a.leased_until < ended + window for a in attempts if a.started_at)
    assert all(a.finished_at < ended + window for a in attempts if a.finished_at)
