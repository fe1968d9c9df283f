"""SPEC §3.1 and §3.2: results that change nothing, and payloads that cannot be used."""

from __future__ import annotations

import math

import pytest

from refill.models.payload import Completion
from refill.models.results import Outcome
from tests.support.driver import FLAT, SPREAD, Driver


@pytest.fixture
def d(ledger) -> Driver:  # type: ignore[no-untyped-def]
    driver = Driver(ledger)
    assert driver.admit() == [0, 1]
    driver.relay()
    return driver


# --- 3.1: unknown, duplicate, late, not ours ----------------------------------------------


def test_unknown_attempt_changes_nothing(d: Driver) -> None:
    before = d.snapshot()
    (outcome,) = d.record(d.result(9999, SPREAD)).outcomes
    assert outcome.outcome is Outcome.UNKNOWN
    assert outcome.detail == "the ledger never dispatched this attempt"
    assert d.snapshot() == before
    (row,) = d.rejected()
    assert (row.run_id, row.attempt_id, row.reason, row.worker) == (d.run_id, 9999, "unknown", "w1")


def test_unknown_run_changes_nothing(d: Driver) -> None:
    before = d.snapshot()
    message = d.result(d.live_of(0, 0).id, SPREAD)
    message.run_id = 4242
    (outcome,) = d.record(message).outcomes
    assert outcome.outcome is Outcome.UNKNOWN and outcome.detail == "there is no run 4242"
    assert d.snapshot() == before
    assert [(r.run_id, r.reason) for r in d.rejected(4242)] == [(4242, "unknown")]
    assert d.rejected() == []


def test_duplicate_result_has_one_effect(d: Driver) -> None:
    attempt = d.live_of(0, 0)
    assert d.start(attempt.id) is not None
    message = d.result(attempt.id, SPREAD)
    assert d.record(message).outcomes[0].outcome is Outcome.COMMITTED
    after_first = d.snapshot()
    (second,) = d.record(message).outcomes
    assert second.outcome is Outcome.DUPLICATE
    assert second.detail == "attempt is already committed"
    assert d.snapshot() == after_first
    assert [g.attempt_id for g in d.groups()] == [attempt.id]
    assert d.step(0).committed == 1
    assert d.slot(0, 0).group_attempt_id == attempt.id
    (row,) = d.rejected()
    assert (row.attempt_id, row.reason, row.detail) == (attempt.id, "duplicate", "attempt is already committed")


def test_duplicate_within_one_batch(d: Driver) -> None:
    attempt = d.live_of(0, 1)
    d.start(attempt.id)
    message = d.result(attempt.id, SPREAD)
    outcomes = d.record(message, message).outcomes
    assert [o.outcome for o in outcomes] == [Outcome.COMMITTED, Outcome.DUPLICATE]
    assert d.step(0).committed == 1 and len(d.groups()) == 1
    assert [r.reason for r in d.rejected()] == ["duplicate"]


def test_duplicate_of_a_filtered_result(d: Driver) -> None:
    attempt = d.live_of(0, 0)
    assert d.finish_one(attempt.id, FLAT).outcome is Outcome.FILTERED
    before = d.snapshot()
    (again,) = d.record(d.result(attempt.id, FLAT)).outcomes
    assert again.outcome is Outcome.DUPLICATE and again.detail == "attempt is already filtered"
    assert d.snapshot() == before
    assert d.slot(0, 0).filtered == 1


def test_late_result_after_lease_expiry_and_redispatch(d: Driver) -> None:
    first = d.live_of(0, 0)
    assert d.start(first.id) is not None
    d.tick(61)  # lease_seconds is 60
    reaped = d.reap()
    # only the running attempt: the seven queued ones wait up to queue_timeout_seconds (600)
    assert reaped.attempts == 1
    failed = d.attempt(first.id)
    assert (failed.state, failed.failure_kind) == ("failed", "infra")
    assert "worker w1 stopped heartbeating" in failed.error
    retry = d.live_of(0, 0)
    assert (retry.reason, retry.try_no, retry.prompt_id) == ("retry", 2, first.prompt_id)
    before = d.snapshot()
    (late,) = d.record(d.result(first.id, SPREAD)).outcomes
    assert late.outcome is Outcome.LATE and late.detail == "attempt is already failed"
    assert d.snapshot() == before
    assert d.slot(0, 0).status == "open" and d.groups() == []
    assert [r.reason for r in d.rejected()] == ["late"]
    # the re-dispatched attempt still counts
    assert d.finish_one(retry.id, SPREAD).outcome is Outcome.COMMITTED
    assert d.slot(0, 0).group_attempt_id == retry.id


def test_result_from_a_worker_without_the_lease(d: Driver) -> None:
    attempt = d.live_of(0, 0)
    assert d.start(attempt.id, worker="w1") is not None
    before = d.snapshot()
    (outcome,) = d.record(d.result(attempt.id, SPREAD, worker="w2")).outcomes
    assert outcome.outcome is Outcome.UNKNOWN
    assert outcome.detail == "attempt is leased to w1, not w2"
    assert d.snapshot() == before
    assert d.attempt(attempt.id).state == "running"
    (row,) = d.rejected()
    assert (row.reason, row.worker) == ("unknown", "w2")
    # the holder's result still counts
    assert d.record(d.result(attempt.id, SPREAD, worker="w1")).outcomes[0].outcome is Outcome.COMMITTED


@pytest.mark.parametrize("relayed", [False, True])
def test_result_for_an_attempt_never_started(ledger, relayed: bool) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    if relayed:
        d.relay()
    attempt = d.live_of(0, 0)
    state = "queued" if relayed else "pending"
    assert attempt.state == state
    before = d.snapshot()
    (outcome,) = d.record(d.result(attempt.id, SPREAD)).outcomes
    assert outcome.outcome is Outcome.UNKNOWN
    assert outcome.detail == f"attempt is {state}, not leased"
    assert d.snapshot() == before
    assert [r.reason for r in d.rejected()] == ["unknown"]


def test_result_for_a_cancelled_attempt_is_late(d: Driver) -> None:
    attempt = d.live_of(0, 0)
    d.start(attempt.id)
    assert d.stop() == 8
    (outcome,) = d.record(d.result(attempt.id, SPREAD)).outcomes
    assert outcome.outcome is Outcome.LATE and outcome.detail == "attempt is already cancelled"
    assert d.groups() == [] and d.step(0).committed == 0


# --- 3.2: invalid payloads ------------------------------------------------------------------


def _bad(d: Driver, attempt_id: int, variant: str):  # type: ignore[no-untyped-def]
    good = [Completion(token_ids=[8, 9], logprobs=[-0.5, -0.25], text="ok") for _ in range(4)]
    if variant == "too_few_completions":
        return d.result(attempt_id, SPREAD, completions=good[:3]), "group has 3 completions, the run expects 4"
    if variant == "too_few_rewards":
        return d.result(attempt_id, [0.0, 1.0, 0.0], completions=good), "group has 3 rewards for 4 completions"
    if variant == "nan_reward":
        return d.result(attempt_id, [0.0, math.nan, 1.0, 1.0]), "reward of completion 1 is nan, not a finite number"
    if variant == "inf_reward":
        return d.result(attempt_id, [math.inf, 0.0, 1.0, 1.0]), "reward of completion 0 is inf, not a finite number"
    if variant == "token_out_of_vocabulary":
        bad = good[:3] + [Completion(token_ids=[8, 100], logprobs=[-0.5, -0.25], text="x")]
        return d.result(attempt_id, SPREAD, completions=bad), "completion 3 has token id 100, outside the vocabulary of 100"
    if variant == "negative_token":
        return d.result(attempt_id, SPREAD, prompt_token_ids=[5, -1]), "prompt has token id -1; token ids are non-negative integers"
    if variant == "empty_prompt":
        return d.result(attempt_id, SPREAD, prompt_token_ids=[]), "prompt_token_ids is empty"
    if variant == "positive_logprob":
        bad = [Completion(token_ids=[8], logprobs=[0.5], text="x")] + good[1:]
        return d.result(attempt_id, SPREAD, completions=bad), "completion 0 has log-prob 0.5; log-probs are finite and <= 0"
    if variant == "no_weight_version":
        return d.result(attempt_id, SPREAD, version=None), "result does not say which weight version generated it"
    if variant == "reward_function_raised":
        return (
            d.result(attempt_id, [], completions=[], error_kind="data", error="ZeroDivisionError in reward"),
            "ZeroDivisionError in reward",
        )
    raise AssertionError(variant)


VARIANTS = [
    "too_few_completions",
    "too_few_rewards",
    "nan_reward",
    "inf_reward",
    "token_out_of_vocabulary",
    "negative_token",
    "empty_prompt",
    "positive_logprob",
    "no_weight_version",
    "reward_function_raised",
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_invalid_payload_fails_with_data_and_replaces_under_replace(ledger, variant: str) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    attempt = d.live_of(0, 2)
    d.start(attempt.id)
    message, why = _bad(d, attempt.id, variant)
    (outcome,) = d.record(message).outcomes
    assert outcome.outcome is Outcome.FAILED
    failed = d.attempt(attempt.id)
    assert (failed.state, failed.failure_kind, failed.error) == ("failed", "data", why)
    assert failed.zero_variance is None and failed.reward_mean is None
    slot = d.slot(0, 2)
    # dropped at once (a data failure is not retried), replaced from the spare pool
    assert (slot.status, slot.data_failures, slot.infra_failures, slot.drops) == ("open", 1, 0, 1)
    assert (slot.drop_replacements, slot.filter_replacements, slot.filtered) == (1, 0, 0)
    replacement = d.live_of(0, 2)
    assert (replacement.reason, replacement.try_no) == ("drop_replacement", 1)
    assert d.position(replacement.prompt_id) == 8  # the first spare prompt
    assert d.run().consecutive_dropped == 0  # only infra drops count
    assert d.groups() == []


@pytest.mark.parametrize("variant", ["nan_reward", "token_out_of_vocabulary", "reward_function_raised"])
def test_invalid_payload_shrinks_under_shrink(ledger, variant: str) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"on_dropped_prompt": "shrink"}})
    d.admit()
    attempt = d.live_of(0, 2)
    d.start(attempt.id)
    message, why = _bad(d, attempt.id, variant)
    assert d.record(message).outcomes[0].outcome is Outcome.FAILED
    assert d.attempt(attempt.id).failure_kind == "data"
    slot = d.slot(0, 2)
    assert (slot.status, slot.shrink_reason, slot.drops, slot.drop_replacements, slot.drop_budget) == (
        "shrunk", "dropped", 1, 0, 0,
    )
    step = d.step(0)
    assert (step.shrunk, step.dropped_shrunk, step.committed, step.status) == (1, 1, 0, "open")
    assert d.live(0) and all(a.slot_idx != 2 for a in d.live(0))
    # the other three slots fill and the step releases with three groups
    for idx in (0, 1, 3):
        d.commit_slot(0, idx)
    step = d.step(0)
    assert (step.status, step.committed) == ("released", 3)


def test_data_failure_of_a_replacement_past_the_drop_budget_shrinks(d: Driver) -> None:
    d.fail(d.live_of(0, 0).id, kind="data", error="bad row")
    d.fail(d.live_of(0, 0).id, kind="data", error="bad again")
    slot = d.slot(0, 0)
    assert (slot.status, slot.shrink_reason, slot.drops, slot.drop_replacements) == ("shrunk", "dropped", 2, 1)
    assert d.step(0).dropped_shrunk == 1
