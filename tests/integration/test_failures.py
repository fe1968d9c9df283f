"""SPEC §3.6: infra failures retried with back-off, then the prompt dropped and replaced or
shrunk; the step floor and the consecutive-drop bound fail the run with their messages."""

from __future__ import annotations

from datetime import timedelta

import pytest

from refill.models import decisions
from refill.models.results import Outcome
from tests.support.driver import Driver

BACKOFF = {
    "rollout_failure": {
        "max_attempts_per_prompt": 4,
        "retry_backoff_seconds": 2.0,
        "retry_backoff_max_seconds": 5.0,
    }
}


def test_infra_failure_is_retried_with_backoff_then_replaced(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, BACKOFF)
    d.admit()
    d.relay()
    first = d.live_of(0, 0)
    delays = []
    attempt = first
    for try_no in (1, 2, 3):
        assert d.fail(attempt.id, error=f"engine error {try_no}").outcome is Outcome.FAILED
        failed = d.attempt(attempt.id)
        assert (failed.state, failed.failure_kind, failed.error) == ("failed", "infra", f"engine error {try_no}")
        retry = d.live_of(0, 0)
        assert (retry.reason, retry.try_no, retry.prompt_id) == ("retry", try_no + 1, first.prompt_id)
        assert (retry.origin_step, retry.origin_slot) == (0, 0)
        delays.append((retry.available_at - d.now).total_seconds())
        # the relay does not send it before its back-off is over
        assert d.relay() == []
        d.tick(delays[-1])
        assert [m.body["attempt_id"] for m in d.relay()] == [retry.id]
        attempt = retry
    assert delays == [2.0, 4.0, 5.0]  # 2, 4, then 8 capped at 5
    d.fail(attempt.id, error="engine error 4")
    slot = d.slot(0, 0)
    assert (slot.status, slot.infra_failures, slot.drops, slot.drop_replacements) == ("open", 4, 1, 1)
    assert (slot.filter_replacements, slot.needs_replacement) == (0, True)
    replacement = d.live_of(0, 0)
    assert (replacement.reason, replacement.try_no, d.position(replacement.prompt_id)) == ("drop_replacement", 1, 8)
    assert replacement.available_at == d.now
    assert d.run().consecutive_dropped == 1


def test_replace_then_shrink_when_the_drop_budget_is_spent(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # 2 tries per prompt, 1 replacement per slot
    d.admit()
    for _ in range(2):
        d.fail(d.live_of(0, 1).id)
    assert d.live_of(0, 1).reason == "drop_replacement"
    for _ in range(2):
        d.fail(d.live_of(0, 1).id)
    slot = d.slot(0, 1)
    assert (slot.status, slot.shrink_reason, slot.drops, slot.drop_replacements, slot.infra_failures) == (
        "shrunk", "dropped", 2, 1, 4,
    )
    step = d.step(0)
    assert (step.shrunk, step.dropped_shrunk) == (1, 1)
    assert d.run().consecutive_dropped == 2
    assert [a.state for a in d.attempts(0, 1)] == ["failed"] * 4


def test_shrink_policy_shrinks_after_the_retries(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"on_dropped_prompt": "shrink"}})
    d.admit()
    d.fail(d.live_of(0, 3).id)
    assert d.live_of(0, 3).reason == "retry"
    d.fail(d.live_of(0, 3).id)
    slot = d.slot(0, 3)
    assert (slot.status, slot.shrink_reason, slot.drops, slot.drop_replacements) == ("shrunk", "dropped", 1, 0)
    assert d.spare_pool() == [8, 9, 10, 11]  # a shrink takes nothing from the pool
    for idx in range(3):
        d.commit_slot(0, idx)
    step = d.step(0)
    assert (step.status, step.committed, step.shrunk) == ("released", 3, 1)
    assert len(d.outbox("train_step")) == 1
    # the shrunk slot trains nothing, and its drop counts
    m = d.metrics(0)
    assert (m.trained_groups, m.dropped_prompt_groups, m.failed_attempts) == (3, 1, 2)


def test_expired_lease_is_an_infra_failure(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.relay()
    attempt = d.live_of(0, 2)
    lease = d.start(attempt.id)
    assert lease is not None and lease.lease_seconds == 60
    d.tick(30)
    assert d.heartbeat(attempt.id)  # pushes the lease to now + 60
    d.tick(59)
    assert d.reap().attempts == 0
    d.tick(2)
    reaped = d.reap()
    assert (reaped.attempts, reaped.failed) == (1, None)
    failed = d.attempt(attempt.id)
    assert (failed.state, failed.failure_kind) == ("failed", "infra")
    assert failed.error.startswith("lease expired at 00:01:30: worker w1 stopped heartbeating")
    assert d.live_of(0, 2).reason == "retry"
    assert not d.heartbeat(attempt.id)  # the worker learns it lost the attempt


def test_message_lost_on_the_queue_expires_after_the_queue_timeout(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.relay()
    d.tick(600)
    assert d.reap().attempts == 0  # leased until exactly now: not yet expired
    d.tick(1)
    reaped = d.reap()
    assert reaped.attempts == 8
    errors = {a.error for a in d.attempts(state="failed")}
    assert len(errors) == 1
    assert "waited on the generate queue past generation.queue_timeout_seconds" in errors.pop()
    assert [a.reason for a in d.live()] == ["retry"] * 8
    # A lost message says nothing about its prompt: the retry does not spend one of its tries.
    assert [a.try_no for a in d.live()] == [1] * 8
    assert all(s.infra_failures == 0 for s in d.slots(0))
    # a pending attempt (never relayed) has no lease and is not reaped
    d.tick(10_000)
    assert d.reap().attempts == 0


def test_step_floor_fails_the_run_with_the_three_causes(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(
        ledger,
        {"rollout_failure": {"on_dropped_prompt": "shrink", "max_attempts_per_prompt": 1, "min_step_batch_fraction": 0.75}},
    )
    d.admit()
    d.fail(d.live_of(0, 0).id, error="OOM on worker 3")
    assert d.run().status == "running"  # 3 of 4 left: at the floor of ceil(4 * 0.75) = 3
    first_failed = d.attempts(0, 0, state="failed")[0].id
    second = d.live_of(0, 1).id
    outcome = d.fail(second, error="NCCL timeout\nstack trace...")
    assert outcome.outcome is Outcome.FAILED
    run = d.run()
    expected = decisions.short_step_message(
        step=0,
        num_prompts_per_step=4,
        dropped_shrunk=2,
        dropped_prompts=2,
        min_step_batch_fraction=0.75,
        recent_errors=[f"attempt {second}: NCCL timeout", f"attempt {first_failed}: OOM on worker 3"],
    )
    assert (run.status, run.end_reason, run.error) == ("failed", "short_step", expected)
    assert "step 0 can train at most 2 of 4 groups" in run.error
    for cause in ("1. a failing fleet", "2. drop budgets too large", "3. a spare pool too small"):
        assert cause in run.error
    assert outcome.detail == expected.splitlines()[0]
    assert d.live() == []
    step = d.step(0)
    assert (step.status, step.shrunk, step.dropped_shrunk) == ("open", 2, 2)


def test_step_floor_counts_a_slot_apart_from_the_prompts_it_dropped(ledger) -> None:  # type: ignore[no-untyped-def]
    # One slot drops its own prompt, then its one replacement, and is shrunk: 1 slot, 2 prompts.
    d = Driver(ledger, {"rollout_failure": {"max_attempts_per_prompt": 1, "min_step_batch_fraction": 1.0}})
    d.admit()
    d.fail(d.live_of(0, 2).id, error="OOM on worker 3")
    assert (d.live_of(0, 2).reason, d.run().status) == ("drop_replacement", "running")
    outcome = d.fail(d.live_of(0, 2).id, error="OOM on worker 4")
    run = d.run()
    assert (run.status, run.end_reason) == ("failed", "short_step")
    assert outcome.detail == (
        "step 0 can train at most 3 of 4 groups, below rollout_failure.min_step_batch_fraction=1.0 "
        "(4 groups): 1 slot was shrunk after 2 prompts were dropped. Likely causes:"
    )
    assert run.error.splitlines()[0] == outcome.detail
    slot = d.slot(0, 2)
    assert (slot.status, slot.shrink_reason, slot.drops) == ("shrunk", "dropped", 2)
    assert (d.step(0).shrunk, d.step(0).dropped_shrunk) == (1, 1)


def test_step_floor_of_nine_in_ten(ledger) -> None:  # type: ignore[no-untyped-def]
    # ceil(10 * 0.9) is 9: one drop leaves 9 and is fine, a second fails the run.
    d = Driver(
        ledger,
        {
            "grpo": {"num_prompts_per_step": 10},
            "rollout_failure": {"on_dropped_prompt": "shrink", "max_attempts_per_prompt": 1, "min_step_batch_fraction": 0.9},
        },
    )
    assert d.admit() == [0, 1]
    d.fail(d.live_of(0, 0).id)
    assert d.run().status == "running"
    d.fail(d.live_of(0, 1).id)
    run = d.run()
    assert (run.status, run.end_reason) == ("failed", "short_step")
    assert run.error.startswith(
        "step 0 can train at most 8 of 10 groups, below rollout_failure.min_step_batch_fraction=0.9 (9 groups)"
    )


def test_reaper_drop_can_fail_the_run(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(
        ledger,
        {"rollout_failure": {"on_dropped_prompt": "shrink", "max_attempts_per_prompt": 1, "min_step_batch_fraction": 1.0}},
    )
    d.admit()
    d.relay()
    d.start(d.live_of(0, 0).id)
    d.tick(61)
    reaped = d.reap()
    assert reaped.failed is not None and reaped.failed.startswith("step 0 can train at most 3 of 4 groups")
    run = d.run()
    assert (run.status, run.end_reason) == ("failed", "short_step")
    assert d.live() == []


def test_end_of_data_shrinks_do_not_count_against_the_floor(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_steps": 10}, "rollout_failure": {"min_step_batch_fraction": 1.0}}, num_prompts=8)
    d.admit()
    for idx in range(4):
        d.filter_slot(1, idx)  # no spare, nothing later to borrow: the data has ended
    step = d.step(1)
    assert (step.shrunk, step.dropped_shrunk, step.status) == (4, 0, "released")
    assert d.run().status == "running"


def test_consecutive_drops_fail_the_run(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"max_attempts_per_prompt": 1, "max_consecutive_dropped_prompts": 3}})
    d.admit()
    for idx in range(3):
        d.fail(d.live_of(0, idx).id, error=f"worker lost {idx}")
    run = d.run()
    assert (run.status, run.consecutive_dropped) == ("running", 3)
    d.fail(d.live_of(1, 0).id, error="worker lost 4")
    run = d.run()
    assert (run.status, run.end_reason, run.consecutive_dropped) == ("failed", "fleet_failed", 4)
    assert run.error == decisions.consecutive_drops_message(4, 3, "worker lost 4")
    assert d.live() == []


def test_retries_that_succeed_do_not_count_as_drops(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"max_consecutive_dropped_prompts": 1}})
    d.admit()
    for idx in range(4):
        d.fail(d.live_of(0, idx).id)  # first try fails, the retry is dispatched: no drop yet
    assert d.run().consecutive_dropped == 0
    d.fill_step(0)
    assert d.step(0).status == "released"


def test_fleet_failure_is_resumable_and_repairs_open_slots(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"max_attempts_per_prompt": 1, "max_consecutive_dropped_prompts": 1}})
    d.admit()
    committed = d.commit_slot(0, 3)
    d.fail(d.live_of(0, 0).id)
    d.fail(d.live_of(0, 1).id)
    assert d.run().end_reason == "fleet_failed" and d.live() == []
    d.tick(5)
    run = d.resume()
    assert (run.status, run.consecutive_dropped, run.error, run.end_reason) == ("running", 0, None, None)
    # every open slot of an open step has a live attempt again, on its most recent prompt
    for step, idx in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3)]:
        assert d.live_of(step, idx).reason == "retry"
    assert d.slot(0, 3).group_attempt_id == committed.attempt_id
    assert d.position(d.live_of(0, 0).prompt_id) == 8  # (0, 0)'s replacement prompt
    assert d.position(d.live_of(0, 1).prompt_id) == 1  # its own prompt failed to drop the run
    assert d.position(d.live_of(0, 2).prompt_id) == 2


@pytest.mark.parametrize("kind", ["infra", "data"])
def test_failure_of_an_attempt_whose_retry_is_in_backoff_waits(ledger, kind: str) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, BACKOFF)
    d.admit()
    d.fail(d.live_of(0, 0).id, kind=kind)
    live = d.live_of(0, 0)
    if kind == "infra":
        assert live.available_at == d.now + timedelta(seconds=2)
    else:
        assert live.available_at == d.now and live.reason == "drop_replacement"


def test_a_failure_report_delivered_twice_is_a_duplicate_and_one_after_the_reaper_is_late(ledger) -> None:  # type: ignore[no-untyped-def]
    """Every result for an attempt failed as infra was recorded as late, so the broker's
    second delivery of a worker's own failure report showed as lease trouble that never
    happened (`rejected_results`, `refill workers`)."""
    from refill.models.payload import ResultMessage

    d = Driver(ledger)
    d.admit()
    d.relay()
    reported = d.live_of(0, 1)
    assert d.fail(reported.id, error="CUDA error: an illegal memory access").outcome is Outcome.FAILED

    def report(attempt_id: int, error: str) -> Outcome:
        message = ResultMessage(run_id=d.run_id, attempt_id=attempt_id, worker=d.worker, weight_version=0,
                                error_kind="infra", error=error)
        return d.record(message).outcomes[0].outcome

    assert report(reported.id, "CUDA error: an illegal memory access") is Outcome.DUPLICATE
    # The reaper failed this one: the worker's report comes after it, late.
    reaped = d.live_of(0, 2)
    d.start(reaped.id)
    d.tick(61)
    assert d.reap().attempts == 1
    assert report(reaped.id, "CUDA error: an illegal memory access") is Outcome.LATE
    assert d.record(d.result(reaped.id, [0.0, 1.0, 0.0, 1.0])).outcomes[0].outcome is Outcome.LATE
