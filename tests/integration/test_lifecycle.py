"""Run stop and resume (repair_open_slots), controller takeover, and the relay's at-least-once
contract."""

from __future__ import annotations

from datetime import timedelta

import pytest

from refill.models.outbox import ToSend, claim_outbox, mark_sent
from refill.models.results import Outcome
from refill.models.runs import RunStateError
from tests.support.driver import SPREAD, Driver


def test_stop_cancels_live_work_and_resume_repairs_open_slots(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.relay()
    kept = d.commit_slot(0, 0)
    d.filter_slot(0, 1)  # its replacement (prompt 8) is pending, its message unsent
    replacement = d.live_of(0, 1)
    running = d.live_of(0, 2)
    d.start(running.id)
    assert d.stop() == 7
    run = d.run()
    assert (run.status, run.end_reason, run.controller_id, run.stop_requested) == ("stopped", "stopped", None, True)
    assert d.live() == []
    assert {a.error for a in d.attempts(state="cancelled")} == {"run stopped"}
    # nothing moves while stopped
    assert d.admit() == []
    assert d.relay() == []
    assert d.reap().attempts == 0
    unsent = d.attempt(replacement.id)
    assert unsent.state == "cancelled" and unsent.dispatched_at is None  # never sent
    assert d.record(d.result(running.id, SPREAD)).outcomes[0].outcome is Outcome.LATE
    # resume: every open slot of an open step gets a live attempt on its most recent prompt
    d.tick(10)
    run = d.resume()
    assert (run.status, run.end_reason, run.stop_requested, run.controller_id) == ("running", None, False, "controller-1")
    assert d.slot(0, 0).group_attempt_id == kept.attempt_id
    prompts = {(a.step, a.slot_idx): d.position(a.prompt_id) for a in d.live()}
    assert prompts == {(0, 1): 8, (0, 2): 2, (0, 3): 3, (1, 0): 4, (1, 1): 5, (1, 2): 6, (1, 3): 7}
    assert {a.reason for a in d.live()} == {"retry"}
    sent = d.relay()
    assert sorted(m.body["attempt_id"] for m in sent) == sorted(a.id for a in d.live())
    d.fill_step(0)
    d.fill_step(1)
    assert d.train(0) and d.train(1)


def test_resume_requeues_a_released_step_whose_message_was_dropped(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    assert [m.step for m in d.outbox("train_step")] == [0]
    d.stop()
    d.relay()  # the relay drains the train_step row of a stopped run without sending it
    assert all(m.sent_at is not None for m in d.outbox("train_step"))
    d.resume()
    sent = [m for m in d.relay() if m.kind == "train_step"]
    assert [m.body["step"] for m in sent] == [0]
    assert d.train(0)


def test_resume_requeues_a_released_step_whose_trainer_gave_up(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    assert [m.body for m in d.relay() if m.kind == "train_step"] == [{"run_id": d.run_id, "step": 0}]
    d.stop()
    assert d.claim(0) is None  # the trainer got the message while the run was stopped
    d.resume()
    assert [m.body["step"] for m in d.relay() if m.kind == "train_step"] == [0]
    assert d.train(0)


def test_resume_of_a_completed_or_budget_failed_run_is_refused(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_steps": 1}})
    d.admit()
    d.fill_step(0)
    assert d.train(0)
    assert d.run().status == "completed"
    with pytest.raises(RunStateError, match="is completed \\(max_num_steps\\); start a new run instead"):
        d.resume()


def test_a_live_controller_keeps_its_run(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    with pytest.raises(RunStateError, match="is driven by controller controller-1"):
        d.resume("controller-2")
    d.tick(31)  # it died: 30 s without a heartbeat
    before = [a.id for a in d.live()]
    run = d.resume("controller-2")
    assert run.controller_id == "controller-2"
    assert [a.id for a in d.live()] == before  # nothing to repair: every slot had its attempt


def test_outbox_claim_that_expires_is_claimable_again(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    first = d.relay(claim_seconds=30, send=False)  # the relay died after publishing
    assert len(first) == 8 and {m.kind for m in first} == {"generate"}
    # Claimed: not due again until the claim expires.
    assert all(a.state == "pending" and a.available_at == d.now + timedelta(seconds=30) for a in d.live())
    d.tick(29)
    assert d.relay() == []  # still claimed
    d.tick(2)
    second = d.relay()  # claimable again: sent a second time, at least once
    assert sorted(m.attempt_id for m in second) == sorted(m.attempt_id for m in first)
    assert [m.body for m in sorted(second, key=lambda m: m.attempt_id)] == [
        m.body for m in sorted(first, key=lambda m: m.attempt_id)
    ]
    assert all(a.state == "queued" and a.dispatched_at == d.now and a.leased_until is not None for a in d.live())
    assert d.relay() == []


def test_outbox_message_body(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    attempt = d.live_of(1, 2)
    (message,) = [m for m in d.relay() if m.body["attempt_id"] == attempt.id]
    assert (message.kind, message.queue, message.run_id) == ("generate", "generate", d.run_id)
    assert message.body == {
        "run_id": d.run_id,
        "attempt_id": attempt.id,
        "prompt": "p6",
        "row": {"prompt": "p6", "i": 6},
        "n": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_new_tokens": 16,
        "seed": (7 * 1_000_003 + attempt.id) % 2**31,
        "min_weight_version": 0,
    }


def test_a_prompt_row_goes_out_exactly_as_the_user_gave_it(ledger) -> None:  # type: ignore[no-untyped-def]
    """A prompt's row reaches the worker as the user gave it: integers past 64 bits and at
    either end of them stay integers (the relay reads the row with the standard library; orjson,
    which `column_types.read_json` uses for the ledger's own JSON, would read them as floats),
    floats and any text as they were."""
    from sqlalchemy import update

    from refill.models.tables import Prompt

    row = {"big": 2**70, "below": -(2**63) - 1, "max": 2**63 - 1, "min": -(2**63), "f": 0.1, "small": 1.5e-7, "text": "é ✓ 文", "nested": [{"n": 10**25}]}
    d = Driver(ledger)
    d.admit()
    attempt = d.live_of(1, 2)
    prompts = Prompt.__table__
    ledger.transaction(lambda s: s.execute(update(prompts).where(prompts.c.id == attempt.prompt_id).values(row=row)))
    (message,) = [m for m in d.relay() if m.body["attempt_id"] == attempt.id]
    sent = message.body["row"]
    assert sent == row
    assert all(type(sent[key]) is int for key in ("big", "below", "max", "min")) and type(sent["nested"][0]["n"]) is int


def test_obsolete_messages_are_not_returned(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    started = d.live_of(0, 0)
    d.start(started.id)  # a fast worker took it before the relay sent it
    d.filter_slot(0, 1)  # the first attempt of (0, 1) is finished: its message is obsolete
    sent = d.relay()
    ids = {m.body["attempt_id"] for m in sent}
    assert started.id not in ids
    assert d.attempts(0, 1)[0].id not in ids
    assert len(sent) == 7  # six first attempts and the replacement of (0, 1)
    assert d.attempts(0, 1)[0].state == "filtered"
    # mark_sent leaves a running attempt running
    assert d.attempt(started.id).state == "running"


def test_messages_wait_for_their_time(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"retry_backoff_seconds": 10.0}})
    d.admit()
    d.relay()
    d.fail(d.live_of(0, 0).id)
    assert d.relay() == []
    d.tick(10)
    assert len(d.relay()) == 1


def test_claim_by_ids_and_run(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    other = Driver(ledger)
    d.admit()
    other.admit()
    mine = sorted(a.id for a in d.live())[:3]

    def claim(**kw):  # type: ignore[no-untyped-def]
        def go(session):  # type: ignore[no-untyped-def]
            out = claim_outbox(session, claimer="r", now=d.now, **kw)
            mark_sent(session, out, d.now)
            return out

        return ledger.transaction(go)

    assert sorted(m.attempt_id for m in claim(only=ToSend(tuple(mine)))) == mine
    assert {m.run_id for m in claim(run_id=other.run_id)} == {other.run_id}
    assert len(claim(limit=2)) == 2
    assert len(claim()) == 3


def test_a_controller_hands_over_to_its_next_slice(ledger) -> None:  # type: ignore[no-untyped-def]
    from refill.models.runs import start_run

    d = Driver(ledger)
    d.admit()
    before = [(a.id, a.state) for a in d.live()]
    run = ledger.transaction(
        lambda s: start_run(s, d.run_id, "controller-2", previous_controller="controller-1", now=d.now)
    )
    assert (run.status, run.controller_id) == ("running", "controller-2")
    assert [(a.id, a.state) for a in d.live()] == before  # a hand-over repairs nothing
    # a stale hand-over (controller-1 no longer drives it) is an ordinary start: refused
    # while controller-2 is alive
    with pytest.raises(RunStateError, match="is driven by controller controller-2"):
        ledger.transaction(
            lambda s: start_run(s, d.run_id, "controller-3", previous_controller="controller-1", now=d.now)
        )


def test_a_failing_training_step_is_retried_then_fails_the_run(ledger) -> None:  # type: ignore[no-untyped-def]
    from refill.models.training import claim_training, training_failed

    d = Driver(ledger, {"infra": {"max_train_attempts": 2}})
    d.admit()
    d.fill_step(0)
    batch = d.ledger.transaction(lambda s: claim_training(s, d.run_id, 0, "t1", d.now))
    assert batch is not None
    queued = d.ledger.transaction(lambda s: training_failed(s, d.run_id, 0, "t1", "OOM", d.now))
    assert queued and d.step(0).status == "released" and d.run().status == "running"
    # The second failure is the last allowed: the run fails with the error, naming the knob.
    assert d.ledger.transaction(lambda s: claim_training(s, d.run_id, 0, "t1", d.now)) is not None
    assert d.ledger.transaction(lambda s: training_failed(s, d.run_id, 0, "t1", "OOM again", d.now)) == ToSend()
    run = d.run()
    assert (run.status, run.end_reason) == ("failed", "trainer_failed")
    assert "training step 0 failed 2 times" in run.error and "OOM again" in run.error
    assert "infra.max_train_attempts=2" in run.error
