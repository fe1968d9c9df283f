"""Scenario 2 of issue 20: a zombie generation worker. It freezes mid-bundle (SIGSTOP: a long
GC pause, a stuck CUDA call, a VM migration) for longer than its lease; the reaper takes its
attempts back and dispatches their prompts again; then it wakes up (SIGCONT) and sends the
results it was generating.

Those late results are refused (it lost the lease), the worker learns that it lost the
leases, it goes back to work, and nothing is recorded twice.
"""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import func, select

from refill.models.tables import Attempt, Group, RejectedResult, Run
from tests.support.chaos_fleet import (
    FAULT_RUN,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
    wait_for,
)
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

LATENCY = 0.6
LEASE_SECONDS = 3


def test_a_frozen_worker_wakes_up_after_losing_its_leases(fleet, fault_ledger) -> None:
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, {
            "grpo": {"max_num_steps": 10},
            "generation": {
                "lease_seconds": LEASE_SECONDS,
                "sim": {"latency": {"distribution": "constant", "mean_seconds": LATENCY}},
            },
        }),
    )
    victim = fleet.names("generate")[0]
    process = fleet.workers[victim]
    log_before = len(fleet.log(victim))

    def fresh_on_victim(session) -> list[int]:  # type: ignore[no-untyped-def]
        # Taken less than a third of a generation ago: their results cannot have left yet.
        now = session.scalar(select(func.now()))
        rows = session.execute(
            select(Attempt.id, Attempt.started_at).where(
                Attempt.run_id == run_id, Attempt.state == "running", Attempt.worker == victim
            )
        ).all()
        return [a for a, started in rows if (now - started).total_seconds() < LATENCY / 3]

    def mid_bundle(session) -> bool:  # type: ignore[no-untyped-def]
        if session.scalar(select(Run.weight_version).where(Run.id == run_id)) < 1:
            return False
        return len(fresh_on_victim(session)) >= 2

    def freeze() -> tuple[list[int], float, object]:
        process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with fault_ledger.session() as session:
                frozen = list(
                    session.scalars(
                        select(Attempt.id).where(
                            Attempt.run_id == run_id, Attempt.state == "running", Attempt.worker == victim
                        )
                    )
                )

            def taken_back() -> bool:
                with fault_ledger.session() as session:
                    return not session.scalar(
                        select(func.count()).where(Attempt.id.in_(frozen), Attempt.state == "running")
                    )

            wait_for(taken_back, 30, "the reaper taking the frozen worker's attempts back")
        finally:
            process.send_signal(signal.SIGCONT)
        with fault_ledger.session() as session:
            woke_at = session.scalar(select(func.now()))
        return frozen, time.monotonic() - stopped, woke_at

    result = drive_with_fault(fleet, fault_ledger, run_id, when=mid_bundle, fault=freeze)
    frozen, frozen_seconds, woke_at = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        ends = {a.id: a for a in session.scalars(select(Attempt).where(Attempt.id.in_(frozen)))}
        refused = dict(
            session.execute(
                select(RejectedResult.attempt_id, RejectedResult.reason).where(
                    RejectedResult.run_id == run_id, RejectedResult.worker == victim, RejectedResult.attempt_id.in_(frozen)
                )
            ).all()
        )
        groups = list(session.scalars(select(Group.attempt_id).where(Group.attempt_id.in_(frozen))))
        after_waking = list(
            session.scalars(
                select(Attempt.state).where(
                    Attempt.run_id == run_id, Attempt.worker == victim, Attempt.started_at > woke_at
                )
            )
        )
    reaped = [a for a in frozen if ends[a].failure_kind == "infra" and "stopped heartbeating" in (ends[a].error or "")]
    woke_log = fleet.log(victim)[log_before:]
    print(facts.line(
        "zombie-generation-worker", result.seconds, frozen_seconds=round(frozen_seconds, 1),
        attempts_held=len(frozen), reaped=len(reaped), late_results_refused=sum(r == "late" for r in refused.values()),
        attempts_after_waking=len(after_waking),
    ))
    assert_nothing_lost(facts, steps=10)
    assert frozen_seconds > LEASE_SECONDS
    # The reaper took back what the frozen worker was generating...
    assert len(reaped) >= 2, {a: (ends[a].state, ends[a].error) for a in frozen}
    # ...and when it woke up its results for those came in late and were refused, leaving no
    # group behind: nothing recorded twice (the prompts were generated again, by the retries).
    assert all(refused.get(a) == "late" for a in reaped), refused
    assert not set(groups) & set(reaped)
    # It learnt that it had lost the leases, and went back to work.
    assert "refused as late" in woke_log and "re-dispatched" in woke_log, woke_log[-3000:]
    assert fleet.alive(victim)
    assert any(state in ("committed", "filtered") for state in after_waking), after_waking
