"""Scenarios 1, 4, 5 and 6 of issue 6: a process of each role dies by SIGKILL mid-work, and
the run completes with nothing lost and nothing trained twice."""

from __future__ import annotations

import re
import time
from datetime import datetime

import pytest
from sqlalchemy import select

from refill.models.clock import utcnow
from refill.models.tables import (
    Attempt,
    AttemptReason,
    Group,
    Run,
    Slot,
    Step,
    StepStatus,
    WeightVersion,
)
from refill.tasks.chaos import CONSUMER_HANG_AFTER_RESULTS
from tests.support.chaos_fleet import (
    FAULT_RUN,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
    wait_for,
)
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

SETTLED = ("committed", "filtered", "failed", "cancelled")


def test_sigkill_a_generation_worker_mid_task(fleet, fault_ledger) -> None:
    """1. Its attempts are re-dispatched when their leases expire; the run completes."""
    latency = 0.4
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, {
            "grpo": {"max_num_steps": 6},
            "generation": {
                "lease_seconds": 3,
                "sim": {"latency": {"distribution": "constant", "mean_seconds": latency}},
            },
        }),
    )
    victim = fleet.names("generate")[0]
    fresh: list[int] = []

    def running_on_victim(session) -> list[tuple[int, datetime]]:
        rows = session.execute(
            select(Attempt.id, Attempt.started_at).where(
                Attempt.run_id == run_id, Attempt.state == "running", Attempt.worker == victim
            )
        ).all()
        return [(attempt_id, started) for attempt_id, started in rows]

    def mid_task(session) -> bool:
        # Attempts the victim took less than a third of a generation ago cannot have sent
        # their result yet: the kill lands in the middle of their generation.
        if session.scalar(select(Run.weight_version).where(Run.id == run_id)) < 2:
            return False
        now = utcnow()
        fresh[:] = [a for a, started in running_on_victim(session) if (now - started).total_seconds() < latency / 3]
        return len(fresh) >= 2

    def kill() -> list[int]:
        fleet.kill(victim)
        with fault_ledger.session() as session:
            return [a for a, _ in running_on_victim(session)]

    result = drive_with_fault(fleet, fault_ledger, run_id, when=mid_task, fault=kill)
    held: list[int] = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        attempts = {a.id: a for a in session.scalars(select(Attempt).where(Attempt.run_id == run_id))}
    reaped = [attempts[a] for a in held if attempts[a].failure_kind == "infra"]
    print(facts.line("sigkill-generation-worker", result.seconds, held=len(held), reaped=len(reaped)))
    assert_nothing_lost(facts, steps=6)
    # Every attempt the dead worker held ended: reaped when its lease expired, or recorded
    # from a result that had left the worker just before the kill. Those it was generating
    # were reaped, and each was generated again on its prompt.
    assert set(fresh) <= set(held)
    assert all(attempts[a].state in SETTLED for a in held)
    assert {a.id for a in reaped} >= set(fresh)
    assert all("stopped heartbeating" in (a.error or "") for a in reaped)
    for attempt in reaped:
        if attempt.slot_idx is None:
            continue  # an over-dispatched extra serves no slot: nothing to retry
        # The retry may have become an extra of its step since (an extra's group filled the
        # slot before the retry came back): it is still this prompt, generated again.
        retried = [
            a for a in attempts.values()
            if a.prompt_id == attempt.prompt_id
            and a.reason in (AttemptReason.RETRY.value, AttemptReason.EXTRA.value)
            and a.try_no == attempt.try_no + 1
        ]
        assert retried, f"reaped attempt {attempt.id} was not re-dispatched on its prompt"


HOLDING = re.compile(r"chaos: holding a batch of (\d+) results uncommitted \(attempts ([\d,]+)\)")


def test_sigkill_the_consumer_mid_batch(fleet, fault_ledger) -> None:
    """4. The batch's transaction rolls back, Redis delivers its messages again (visibility
    timeout), the next consumer records them, and nothing is committed twice."""
    for name in fleet.names("consume"):
        fleet.stop(name)
    hung = fleet.fresh_name("consume-hang")
    fleet.start("consume", name=hung, env={CONSUMER_HANG_AFTER_RESULTS: "60"})
    # Leases long enough that the held attempts are still in flight when their results come
    # back (visibility timeout + restart, ~8 s): the redelivered results are then recorded,
    # not refused as late.
    run_id = fleet.create_run(
        fault_ledger,
        merged(
            FAULT_RUN,
            {
                "grpo": {"max_num_steps": 6},
                "generation": {"lease_seconds": 15},
                # With extras in flight the run can fill the held attempts' slots and finish
                # before Redis redelivers (it did, in 7 s): the held results would then be
                # refused as the run's, proving nothing about redelivery.
                "async_rl": {"over_dispatch": {"enabled": False}},
            },
        ),
    )

    def holding(session) -> bool:
        return HOLDING.search(fleet.log(hung)) is not None

    def kill() -> tuple[list[int], list[str], float]:
        match = HOLDING.search(fleet.log(hung))
        assert match is not None
        held = [int(a) for a in match.group(2).split(",")]
        # Let the results still on their way reach the hung consumer first. A message Redis
        # hands to a BRPOP whose process dies before kombu records it as unacknowledged is
        # lost for good (its attempt comes back only when its lease expires); with nothing
        # new arriving (replacements wait on this consumer) the kill lands between messages.
        time.sleep(1.0)
        fleet.kill(hung)
        # PostgreSQL rolled the open transaction back when the connection died: the held
        # results left no trace, their attempts are still running.
        with fault_ledger.session() as session:
            states = list(session.scalars(select(Attempt.state).where(Attempt.id.in_(held))))
            groups = list(session.scalars(select(Group.attempt_id).where(Group.attempt_id.in_(held))))
        assert not groups
        killed_at = time.monotonic()
        fleet.start("consume", name=fleet.fresh_name("consume"))
        return held, states, killed_at

    result = drive_with_fault(fleet, fault_ledger, run_id, when=holding, fault=kill)
    held, states_after_kill, _ = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        attempts = {a.id: a for a in session.scalars(select(Attempt).where(Attempt.id.in_(held)))}
        groups = list(session.scalars(select(Group.attempt_id).where(Group.attempt_id.in_(held))))
    print(facts.line("sigkill-consumer-mid-batch", result.seconds, batch=len(held)))
    assert_nothing_lost(facts, steps=6)
    assert held and set(states_after_kill) <= {"running"}, states_after_kill
    # Redelivered and recorded once by the new consumer: each held attempt has its outcome
    # (none was reaped as lost), each committed one exactly one group.
    assert all(attempts[a].state in ("committed", "filtered") or attempts[a].failure_kind == "data" for a in held), {
        a: (attempts[a].state, attempts[a].error) for a in held
    }
    assert len(groups) == len(set(groups)) == sum(attempts[a].state == "committed" for a in held)


def test_sigkill_the_controller_then_resume(fleet, fault_ledger) -> None:
    """5. `refill run start` dies by SIGKILL; `refill run resume RUN --force` finishes the run
    and no step is trained twice."""
    config = fleet.write_config(
        # A fleet that fails one generation in ten: each failure is retried after a back-off,
        # and only a controller's relay sends a message that was not due when it was written.
        # Without over-dispatched extras to fill such a slot meanwhile, the run cannot finish
        # on its own once its controller is dead: it waits for the resume (and the resumed
        # controller sends what the dead one left).
        merged(FAULT_RUN, {
            "grpo": {"max_num_steps": 8},
            "generation": {"sim": {"failure_rate": 0.1}},
            "async_rl": {"over_dispatch": {"enabled": False}},
        }),
        name="controller-kill",
    )
    started = time.monotonic()
    controller = fleet.spawn_cli("controller", "run", "start", str(config), "--quiet")
    try:
        found = wait_for(lambda: re.search(r"run (\d+) created", fleet.log("controller")), 90, "run created")
        run_id = int(found.group(1))
        wait_for(
            lambda: fault_ledger.transaction(lambda s: s.get(Run, run_id).weight_version) >= 2, 90, "two trained steps"
        )
    finally:
        controller.kill()
        controller.wait(30)
    time.sleep(2.0)  # the run goes on without a controller until a retry needs its relay
    with fault_ledger.session() as session:
        run = session.get(Run, run_id)
        status_after_kill, version_after_kill = run.status, run.weight_version
    resumed = fleet.cli("run", "resume", str(run_id), "--force", "--quiet", timeout=180)
    seconds = time.monotonic() - started
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
    print(facts.line("sigkill-controller", seconds, version_2s_after_kill=version_after_kill))
    assert status_after_kill == "running"
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"run {run_id} completed" in resumed.stdout
    assert_nothing_lost(facts, steps=8)
    assert set(facts.train_claims.values()) == {1}, facts.train_claims
    assert facts.failed.get("infra", 0) >= 1  # the fleet did fail, and its retries went out


def test_sigkill_the_trainer_mid_step(fleet, fault_ledger) -> None:
    """6. The step's trainer lease expires, a new trainer worker trains it once, from the same
    batch; weight versions stay monotonic."""
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, {
            "grpo": {"max_num_steps": 6},
            "infra": {"null_trainer_delay_seconds": 1.5, "trainer_lease_seconds": 3},
        }),
    )
    victim = fleet.names("train")[0]

    def training(session) -> bool:
        return (
            session.scalar(
                select(Step.step).where(
                    Step.run_id == run_id, Step.step >= 2, Step.status == StepStatus.TRAINING.value,
                    Step.trainer_id == victim,
                )
            )
            is not None
        )

    def kill() -> tuple[int, dict[int, int]]:
        fleet.kill(victim)
        with fault_ledger.session() as session:
            step = session.scalar(
                select(Step.step).where(Step.run_id == run_id, Step.status == StepStatus.TRAINING.value)
            )
            batch = dict(session.execute(select(Slot.idx, Slot.group_attempt_id).where(Slot.run_id == run_id, Slot.step == step)).all())
        fleet.start("train", name=fleet.fresh_name("train"))
        return step, batch

    result = drive_with_fault(fleet, fault_ledger, run_id, when=training, fault=kill)
    step, batch = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        trained = dict(session.execute(select(Slot.idx, Slot.group_attempt_id).where(Slot.run_id == run_id, Slot.step == step)).all())
        marked = set(session.scalars(select(Group.attempt_id).where(Group.run_id == run_id, Group.trained_step == step)))
        versions = session.execute(
            select(WeightVersion.version, WeightVersion.trained_step, WeightVersion.created_at)
            .where(WeightVersion.run_id == run_id)
            .order_by(WeightVersion.version)
        ).all()
    print(facts.line("sigkill-trainer-mid-step", result.seconds, step=step, claims=facts.train_claims[step]))
    assert_nothing_lost(facts, steps=6)
    # Trained once, from the batch released before the crash.
    assert trained == batch and marked == set(batch.values())
    assert facts.train_claims[step] == 2  # the dead trainer's claim, then the new one's
    assert all(claims == 1 for s, claims in facts.train_claims.items() if s != step)
    # Monotonic: version v+1 came from step v, published after version v.
    assert [v for v, _, _ in versions] == list(range(7))
    assert all(trained_step == v - 1 for v, trained_step, _ in versions[1:])
    assert all(a[2] < b[2] for a, b in zip(versions, versions[1:], strict=False))
