"""SPEC §3.5 and the trainer's side: commit, release exactly once, train in order, publish
unique weight versions, re-queue a step whose trainer went silent."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy.exc import IntegrityError

from refill.models import rollout_codec
from refill.models.context import RunContext
from refill.models.payload import Completion
from refill.models.results import Outcome
from refill.models.tables import WeightVersion
from refill.models.training import publish_weight_version
from tests.support.driver import SPREAD, Driver


def test_commit_and_release_exactly_once(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.relay()
    last = None
    for idx in range(4):
        d.tick(1)
        attempt = d.live_of(0, idx)
        d.start(attempt.id)
        last = d.result(attempt.id, [0.0, 0.25 * idx, 1.0, 0.5])
        assert d.record(last).outcomes[0].outcome is Outcome.COMMITTED
        step = d.step(0)
        assert step.committed == idx + 1
        assert step.status == ("released" if idx == 3 else "open")
        assert len(d.outbox("train_step")) == (1 if idx == 3 else 0)
    step = d.step(0)
    assert (step.status, step.released_at, step.committed, step.shrunk) == ("released", d.now, 4, 0)
    (message,) = d.outbox("train_step")
    assert (message.step, message.payload, message.sent_at) == (0, {"run_id": d.run_id, "step": 0}, None)
    for idx in range(4):
        slot = d.slot(0, idx)
        assert slot.status == "committed" and slot.settled_at is not None
        group = d.group(slot.group_attempt_id)
        assert group is not None and group.rewards == [0.0, 0.25 * idx, 1.0, 0.5]
        prompt_token_ids, completions = rollout_codec.decode(group.rollout, group.completion_texts)
        assert completions[0] == Completion(token_ids=[8, 9], logprobs=[-0.5, -0.25], text="ok", finish_reason="stop")
        assert group.completion_texts[0] == {"text": "ok", "finish_reason": "stop"} and prompt_token_ids
    # the last result again: no second release, no second message
    assert last is not None
    assert d.record(last).outcomes[0].outcome is Outcome.DUPLICATE
    assert len(d.outbox("train_step")) == 1 and d.step(0).released_at == d.now
    # the relay sends it once
    sent = d.relay()
    assert [(m.kind, m.queue, m.body) for m in sent if m.kind == "train_step"] == [
        ("train_step", "train", {"run_id": d.run_id, "step": 0})
    ]
    assert [m for m in d.relay() if m.kind == "train_step"] == []


def test_a_later_step_released_first_waits_for_its_turn(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(1)
    assert d.step(1).status == "released"
    assert d.outbox("train_step") == []  # v0 trains step 0 first
    assert d.claim(1) is None  # and the trainer refuses to jump the queue
    d.fill_step(0)
    assert [m.step for m in d.outbox("train_step")] == [0]
    assert d.train(0)
    # finishing step 0 queues the already-released step 1
    assert [m.step for m in d.outbox("train_step")] == [0, 1]
    assert d.train(1)


def test_trainer_claims_and_finishes_exactly_once(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    batch = d.claim(0, "trainer-1")
    assert batch is not None
    assert (batch.step, batch.weight_version, len(batch.groups)) == (0, 0, 4)
    assert [g.attempt_id for g in batch.groups] == [d.slot(0, i).group_attempt_id for i in range(4)]
    assert all(g.weight_version == 0 and g.rewards == SPREAD for g in batch.groups)
    step = d.step(0)
    assert (step.status, step.trainer_id, step.train_claims) == ("training", "trainer-1", 1)
    assert step.trainer_lease_until == d.now + timedelta(seconds=300)
    # another trainer cannot take a step whose trainer is alive
    assert d.claim(0, "trainer-2") is None
    assert not d.finish_training(0, "trainer-2")
    assert d.finish_training(0, "trainer-1", {"loss": 0.25, "grad_norm": 1.5, "tokens_per_s": 10.0})
    step = d.step(0)
    assert (step.status, step.trained_at, step.trainer_lease_until) == ("trained", d.now, None)
    metrics = d.metrics(0)
    assert (metrics.loss, metrics.grad_norm, metrics.extra) == (0.25, 1.5, {"tokens_per_s": 10.0})
    assert {g.trained_step for g in d.groups()} == {0}
    # a second claim or finish of a trained step is a no-op
    assert d.claim(0, "trainer-1") is None
    assert d.claim(0, "trainer-2") is None
    assert not d.finish_training(0, "trainer-1")
    versions = d.weight_versions()
    assert [(v.version, v.trained_step) for v in versions] == [(0, None), (1, 0)]
    assert d.run().weight_version == 1


def test_weight_versions_are_unique_and_in_order(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_steps": 3}})
    for step in range(3):
        d.admit()
        d.fill_step(step)
        assert d.train(step)
    assert [(v.version, v.trained_step) for v in d.weight_versions()] == [(0, None), (1, 0), (2, 1), (3, 2)]
    run = d.run()
    assert (run.status, run.end_reason, run.weight_version) == ("completed", "max_num_steps", 3)

    def publish(version: int):  # type: ignore[no-untyped-def]
        def go(session):  # type: ignore[no-untyped-def]
            ctx = RunContext.open(session, d.run_id, d.now)
            publish_weight_version(ctx, version, None, trained_step=version - 1)

        return go

    with pytest.raises(ValueError, match="is at v3, cannot publish v3"):
        ledger.transaction(publish(3))
    with pytest.raises(ValueError, match="is at v3, cannot publish v5"):
        ledger.transaction(publish(5))

    # the primary key refuses a second row for a version, whatever the code does
    def duplicate(session):  # type: ignore[no-untyped-def]
        session.add(WeightVersion(run_id=d.run_id, version=2, path=None, trained_step=1, created_at=d.now))
        session.flush()

    with pytest.raises(IntegrityError):
        ledger.transaction(duplicate)
    assert len(d.weight_versions()) == 4


def test_expired_trainer_lease_requeues_the_step(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # trainer_lease_seconds 300
    d.admit()
    d.fill_step(0)
    assert d.claim(0, "trainer-1") is not None
    d.tick(299)
    reaped = d.reap()
    assert reaped.train_steps == 0 and d.step(0).status == "training"
    d.tick(2)
    reaped = d.reap()
    assert reaped.train_steps == 1
    step = d.step(0)
    assert (step.status, step.trainer_id) == ("released", None)
    assert [m.step for m in d.outbox("train_step")] == [0, 0]
    # the silent trainer's late finish is refused; another trainer does the step
    assert not d.finish_training(0, "trainer-1")
    assert d.claim(0, "trainer-2") is not None
    assert d.step(0).train_claims == 2
    assert d.finish_training(0, "trainer-2")
    assert [v.version for v in d.weight_versions()] == [0, 1]
    assert d.step(0).trainer_id == "trainer-2"


def test_expired_trainer_lease_can_be_taken_over_before_the_reaper(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    assert d.claim(0, "trainer-1") is not None
    d.tick(301)
    assert d.claim(0, "trainer-2") is not None
    assert not d.finish_training(0, "trainer-1")
    assert d.finish_training(0, "trainer-2")
    assert [v.version for v in d.weight_versions()] == [0, 1]


def test_trainer_extends_its_lease(ledger) -> None:  # type: ignore[no-untyped-def]
    from refill.models.training import extend_training_lease

    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    d.claim(0, "trainer-1")
    d.tick(200)
    assert ledger.transaction(lambda s: extend_training_lease(s, d.run_id, 0, "trainer-1", 300, d.now))
    assert not ledger.transaction(lambda s: extend_training_lease(s, d.run_id, 0, "trainer-2", 300, d.now))
    d.tick(200)
    assert d.reap().train_steps == 0
    assert d.finish_training(0, "trainer-1")
    assert not ledger.transaction(lambda s: extend_training_lease(s, d.run_id, 0, "trainer-1", 300, d.now))


def test_reaper_resends_a_train_step_lost_on_the_broker(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # queue_timeout_seconds 600
    d.admit()
    d.fill_step(0)
    assert [m.body["step"] for m in d.relay() if m.kind == "train_step"] == [0]
    d.tick(599)
    assert d.reap().train_steps == 0  # not yet: the trainer may just be slow to take it
    d.tick(1)
    assert d.reap().train_steps == 1  # queue_timeout_seconds after it was sent
    assert [(m.step, m.sent_at) for m in d.outbox("train_step")][1] == (0, None)
    assert d.reap().train_steps == 0  # one waits in the outbox already
    assert [m.body["step"] for m in d.relay() if m.kind == "train_step"] == [0]
    # a claimed step is not re-sent, however long its message is gone
    assert d.claim(0) is not None
    d.tick(299)
    assert d.reap().train_steps == 0
    d.tick(2)
    assert d.reap().train_steps == 1  # its trainer lease (300 s) expired: re-queued once
    assert d.step(0).status == "released"


def test_a_damaged_payload_is_named_when_the_trainer_claims_its_step(ledger) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import update

    from refill.models.tables import Group
    from refill.models.training import claim_training

    d = Driver(ledger, check=False)  # the ledger is damaged by hand
    d.admit()
    d.fill_step(0)
    damaged = d.slot(0, 2).group_attempt_id
    with ledger.session() as session:
        session.execute(update(Group).where(Group.attempt_id == damaged).values(rollout=b"RFR\x01junk"))
        session.commit()
    with pytest.raises(rollout_codec.RolloutFormatError, match=f"step 0: the stored payload of group {damaged} does not decode"):
        ledger.transaction(lambda s: claim_training(s, d.run_id, 0, "trainer"))
    assert d.step(0).status == "released"  # the claim rolled back: nothing half-done
