"""SPEC §4: the admission gate and the staleness bound."""

from __future__ import annotations

import pytest

from refill.models.results import Outcome
from refill.models.tables import Group
from tests.support.driver import Driver


@pytest.mark.parametrize(("lookahead", "first"), [(0, [0]), (1, [0, 1]), (2, [0, 1, 2])])
def test_admission_gate(ledger, lookahead: int, first: list[int]) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_steps": 6}, "async_rl": {"max_lookahead_versions": lookahead}})
    assert d.admit() == first
    assert d.admit() == []  # nothing more until a version is published
    for step in first:
        assert all(a.min_weight_version == max(0, step - lookahead) for a in d.live(step))
    d.fill_step(0)
    assert d.train(0)
    d.admit()
    # v1 admits exactly one more step: s is admitted once v >= s - lookahead
    assert [s.step for s in d.steps()] == first + [lookahead + 1]
    assert all(a.min_weight_version == 1 for a in d.live(lookahead + 1))


def test_admission_gate_holds_over_a_whole_run(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_steps": 5}, "async_rl": {"max_lookahead_versions": 1}})
    for step in range(5):
        d.admit()
        admitted = [s.step for s in d.steps()]
        assert max(admitted) <= d.run().weight_version + 1
        d.tick(1)
        d.fill_step(step)
        assert d.train(step)
    assert d.run().status == "completed"
    # check_admission_gate (run after the test) checks each step against the version's time


def test_a_result_too_stale_for_its_slot_is_discarded_and_regenerated(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # lookahead 1
    d.admit()
    d.fill_step(0)
    assert d.train(0)
    d.admit()
    attempt = d.live_of(2, 0)
    assert attempt.min_weight_version == 1
    # a worker that ignored its floor reports v0: staleness 2 > 1
    outcome = d.finish_one(attempt.id, [0.0, 1.0, 0.0, 1.0], version=0)
    assert (outcome.outcome, outcome.detail) == (Outcome.FAILED, "weights v0 too stale for step 2")
    failed = d.attempt(attempt.id)
    assert (failed.state, failed.failure_kind, failed.weight_version) == ("failed", "stale", 0)
    assert d.group(attempt.id) is None  # nothing of it is stored to be trained
    again = d.live_of(2, 0)
    assert (again.reason, again.prompt_id, again.min_weight_version) == ("retry", attempt.prompt_id, 1)
    slot = d.slot(2, 0)
    assert (slot.status, slot.infra_failures, slot.drops) == ("open", 0, 0)
    assert d.finish_one(again.id, [0.0, 1.0, 0.0, 1.0], version=1).outcome is Outcome.COMMITTED


def test_no_group_is_trained_staler_than_the_bound(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"async_rl": {"max_lookahead_versions": 1}})
    d.admit()
    d.fill_step(0)
    # staleness 1 is allowed
    for idx in range(4):
        d.commit_slot(1, idx, version=0)
    assert d.train(0)
    batch = d.claim(1)
    assert batch is not None and {g.weight_version for g in batch.groups} == {0}
    assert d.metrics(1).staleness_max == 1


def test_trainer_refuses_a_stale_group_it_finds_in_the_ledger(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, check=False)  # the ledger is tampered with below
    d.admit()
    d.fill_step(0)
    assert d.train(0)
    d.fill_step(1)
    victim = d.slot(1, 2).group_attempt_id

    def tamper(session):  # type: ignore[no-untyped-def]
        session.get(Group, victim).weight_version = -1

    ledger.transaction(tamper)
    # It raised in the claim's transaction, which rolled back: the trainer got the step sent
    # again and met the same group, forever. The run fails, naming the group.
    assert d.claim(1) is None
    run = d.run()
    assert (run.status, run.end_reason) == ("failed", "staleness_violated")
    assert f"group {victim} was generated with weights v-1" in run.error
    assert d.step(1).status == "released"  # the refused claim changed nothing
