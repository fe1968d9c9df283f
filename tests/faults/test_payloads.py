"""The claim check's crash points (issue 17): a generation worker that dies between storing a
payload and sending its result, a consumer that dies mid-batch, a trainer that dies while it
reads a step's payloads. Each run completes with no committed group lost and none trained
twice (`assert_nothing_lost`, which includes `refill check` and its payloads check), and
nothing is left behind: once the run ends, the payloads in its store are exactly the committed
groups'."""

from __future__ import annotations

import re
import time

import pytest
from sqlalchemy import select

from refill.models.db import Ledger
from refill.models.payload_store import FileStore, stored_attempt
from refill.models.tables import Attempt, Group, Run, Step, StepStatus
from refill.tasks.chaos import CONSUMER_HANG_AFTER_RESULTS, WORKER_HOLD_AFTER_STORING
from tests.support.chaos_fleet import FAULT_RUN, assert_nothing_lost, drive_with_fault, fault_facts
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

#: The controller sweeps every second here, so a crash's leftovers go within the run.
SWEPT = {"infra": {"payloads": {"sweep_interval_seconds": 1.0}}}
HOLDING_RESULT = re.compile(r"chaos: holding the result of attempt (\d+) after storing its payload")


def stored_and_committed(ledger: Ledger, run_id: int) -> tuple[set[str], set[str]]:
    """The names in the run's payload store, and the committed groups' payload references."""
    with ledger.session() as session:
        run_dir = session.scalar(select(Run.run_dir).where(Run.id == run_id))
        committed = set(
            session.scalars(select(Group.payload_ref).where(Group.run_id == run_id, Group.payload_ref.is_not(None)))
        )
    return {name for _, name in FileStore.of_run(run_dir).listing()}, committed


def assert_nothing_left_behind(ledger: Ledger, run_id: int) -> set[str]:
    """Every committed group's payload is stored, and nothing else is (results that were still on
    their way when the run ended are removed by the consumer that refuses them: waited for)."""
    deadline = time.monotonic() + 20
    while True:
        stored, committed = stored_and_committed(ledger, run_id)
        if stored == committed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    left = {stored_attempt(name): name for name in stored - committed}
    with ledger.session() as session:
        states = dict(session.execute(select(Attempt.id, Attempt.state).where(Attempt.id.in_([a for a in left if a]))).all())
    assert not left, f"payloads left behind: {[(name, states.get(attempt)) for attempt, name in left.items()]}"
    assert committed and committed <= stored, f"committed payloads missing: {sorted(committed - stored)}"
    return stored


def test_sigkill_a_worker_between_storing_a_payload_and_sending_its_result(fleet, fault_ledger) -> None:
    """Its held attempts' leases expire and they are generated again elsewhere; the payloads
    it stored and never announced are swept by the controller."""
    victim = fleet.fresh_name("generate-hold")
    fleet.start("generate", name=victim, env={WORKER_HOLD_AFTER_STORING: "10"})
    run_id = fleet.create_run(fault_ledger, merged(FAULT_RUN, merged(SWEPT, {"grpo": {"max_num_steps": 5}})))
    held: list[int] = []

    def holding(session) -> bool:  # type: ignore[no-untyped-def]
        return HOLDING_RESULT.search(fleet.log(victim)) is not None

    def kill() -> list[int]:
        time.sleep(0.3)  # let the worker's other threads reach the hold too
        fleet.kill(victim)
        held.extend(int(a) for a in HOLDING_RESULT.findall(fleet.log(victim)))
        return held

    result = drive_with_fault(fleet, fault_ledger, run_id, when=holding, fault=kill)
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        ended = {
            attempt: (state, error)
            for attempt, state, error in session.execute(
                select(Attempt.id, Attempt.state, Attempt.error).where(Attempt.id.in_(held))
            ).all()
        }
    stored = assert_nothing_left_behind(fault_ledger, run_id)
    print(facts.line("sigkill-worker-after-storing", result.seconds, held=len(held)))
    assert_nothing_lost(facts, steps=5)
    assert held and {state for state, _ in ended.values()} <= {"failed", "cancelled"}, ended
    # Reaped when its lease expired, or, when the run completed first (the held attempts were
    # spare ones the run did not need), cancelled with the run's other live attempts.
    why = {"failed": "stopped heartbeating", "cancelled": "run completed"}
    assert all(why[state] in (error or "") for state, error in ended.values()), ended
    assert not {stored_attempt(name) for name in stored} & set(held)


def test_sigkill_the_consumer_mid_batch_leaves_no_payload_behind(fleet, fault_ledger) -> None:
    """The batch rolls back: its filtered results' payloads are not removed (the removal follows
    the commit), the redelivered batch commits or discards each one, and nothing is lost."""
    for name in fleet.names("consume"):
        fleet.stop(name)
    hung = fleet.fresh_name("consume-hang")
    fleet.start("consume", name=hung, env={CONSUMER_HANG_AFTER_RESULTS: "40"})
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, merged(SWEPT, {
            "grpo": {"max_num_steps": 4},
            "generation": {"lease_seconds": 15},
            "async_rl": {"over_dispatch": {"enabled": False}},
        })),
    )

    def holding(session) -> bool:  # type: ignore[no-untyped-def]
        return "chaos: holding a batch" in fleet.log(hung)

    def kill() -> None:
        time.sleep(0.5)
        fleet.kill(hung)
        fleet.start("consume", name=fleet.fresh_name("consume"))

    result = drive_with_fault(fleet, fault_ledger, run_id, when=holding, fault=kill)
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
    assert_nothing_left_behind(fault_ledger, run_id)
    print(facts.line("sigkill-consumer-payloads", result.seconds))
    assert_nothing_lost(facts, steps=4)


def test_sigkill_the_trainer_while_it_reads_a_step_loses_no_payload(fleet, fault_ledger) -> None:
    """A trainer that dies after its claim leaves the step's payloads where they were: the next
    trainer claims the step again, reads and verifies the same payloads, and trains it once."""
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, merged(SWEPT, {
            "grpo": {"max_num_steps": 3},
            "infra": {"null_trainer_delay_seconds": 3.0, "trainer_lease_seconds": 3},
        })),
    )
    victim = fleet.names("train")[0]
    claimed: list[int] = []

    def training(session) -> bool:  # type: ignore[no-untyped-def]
        step = session.scalar(
            select(Step.step).where(
                Step.run_id == run_id, Step.step >= 1, Step.status == StepStatus.TRAINING.value, Step.trainer_id == victim
            )
        )
        if step is not None:
            claimed.append(int(step))
        return step is not None

    def kill() -> int:
        fleet.kill(victim)  # a step takes it 3 s: the kill lands while it holds the step
        fleet.start("train", name=fleet.fresh_name("train"))
        return claimed[-1]

    result = drive_with_fault(fleet, fault_ledger, run_id, when=training, fault=kill)
    step = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        trained = set(session.scalars(select(Group.payload_ref).where(Group.run_id == run_id, Group.trained_step == step)))
    stored = assert_nothing_left_behind(fault_ledger, run_id)
    print(facts.line("sigkill-trainer-payloads", result.seconds, step=step))
    assert_nothing_lost(facts, steps=3)
    assert facts.train_claims[step] == 2
    assert trained and trained <= stored
