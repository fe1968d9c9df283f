"""SPEC §6: the per-step metrics stored at release, checked by hand."""

from __future__ import annotations

import math

import pytest

from tests.support.driver import FLAT, SPREAD, Driver


def test_step_metrics_at_release(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # budget 3, N = 4, max_num_steps = 3
    assert d.admit() == [0, 1]
    d.relay()
    d.tick(1)
    d.commit_slot(0, 0, [0.0, 1.0, 0.0, 1.0])  # mean 0.5
    d.tick(1)
    d.filter_slot(0, 1, FLAT)  # mean 1.0, filtered; spare prompt 8 replaces it
    d.tick(1)
    d.commit_slot(0, 1, [0.0, 0.0, 0.0, 1.0])  # the replacement: mean 0.25
    d.tick(1)
    d.fail(d.live_of(0, 2).id)  # infra: retried on the same prompt
    d.tick(1)
    d.commit_slot(0, 2, [1.0, 1.0, 0.0, 1.0])  # the retry: mean 0.75
    d.tick(1)
    nan = d.live_of(0, 3)
    d.start(nan.id)
    d.record(d.result(nan.id, [math.nan, 1.0, 1.0, 1.0]))  # data failure: dropped, replaced by 9
    d.tick(1)
    d.commit_slot(0, 3, [0.0, 1.0, 1.0, 1.0])  # mean 0.75
    step = d.step(0)
    assert step.status == "released"
    m = d.metrics(0)
    # trained: 0.5, 0.25, 0.75, 0.75
    assert m.reward == pytest.approx(2.25 / 4)
    # every finished generation of the step, the filtered one included: + 1.0
    assert m.unfiltered_reward == pytest.approx(3.25 / 5)
    # each slot's first finished attempt on its own prompt: 0.5, 1.0, 0.75 (the retry); slot 3's
    # own prompt never finished
    assert m.first_attempt_reward == pytest.approx(2.25 / 3)
    assert (m.zero_variance_groups, m.zero_variance_fraction) == (1, pytest.approx(0.2))
    assert (m.filtered_groups, m.failed_attempts) == (1, 2)
    assert (m.replaced_prompt_groups, m.promoted_prompt_groups, m.dropped_prompt_groups) == (2, 0, 1)
    assert m.trained_groups == 4
    # pool: 8..11, took 8 (refill 12..15), took 9
    assert m.spare_pool_size == 6 == len(d.spare_pool())
    assert (m.staleness_mean, m.staleness_max) == (0.0, 0)
    assert m.step_fill_seconds == 7.0
    assert m.generated_tokens == 5 * 4 * 2  # five finished groups of 4 completions of 2 tokens
    # p over the run so far: 1 of 5; per slot 0.2**4 = 0.0016 over 3 steps x 4 slots
    assert m.budget_exhaustion_risk == pytest.approx(1 - (1 - 0.0016) ** 12)
    assert m.loss is None and m.trainer_idle_seconds is None
    d.tick(3)
    assert d.claim(0) is not None
    assert d.finish_training(0, metrics={"loss": 0.125, "kl": 0.01, "entropy": 2.0, "clip_fraction": 0.1})
    m = d.metrics(0)
    assert (m.loss, m.kl, m.entropy, m.clip_fraction, m.grad_norm) == (0.125, 0.01, 2.0, 0.1, None)
    # the trainer waited from the run's start until the release
    assert m.trainer_idle_seconds == 7.0


def test_staleness_metrics_of_a_mixed_step(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    d.commit_slot(1, 0, version=0)
    d.commit_slot(1, 1, version=0)
    d.tick(5)
    assert d.train(0)
    d.tick(5)
    d.commit_slot(1, 2, version=1)
    d.commit_slot(1, 3, version=1)
    m = d.metrics(1)
    assert (m.staleness_mean, m.staleness_max, m.trained_groups) == (0.5, 1, 4)
    assert (m.zero_variance_groups, m.zero_variance_fraction) == (0, 0.0)
    assert m.budget_exhaustion_risk == 0.0  # no zero-variance group seen: p = 0
    assert m.step_fill_seconds == 10.0
    d.tick(2)
    assert d.claim(1) is not None
    assert d.metrics(1).trainer_idle_seconds == 5.0  # released 5 s after step 0 trained


def test_budget_risk_is_reported_while_healthy_and_not_without_dynamic_sampling(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"dynamic_sampling_max_replacements_per_slot": 32, "max_num_steps": 1000}})
    d.admit()
    d.filter_slot(0, 0)
    d.fill_step(0)
    risk = d.metrics(0).budget_exhaustion_risk
    # p = 1/5 per slot 0.2**33 = 8.6e-24 over 4000 slots: tiny, but not rounded to zero
    assert risk is not None and risk > 0
    assert risk == pytest.approx(4000 * 0.2**33, rel=1e-6)
    off = Driver(ledger, {"grpo": {"use_dynamic_sampling": False}})
    off.admit()
    off.commit_slot(0, 0, FLAT)
    off.fill_step(0)
    m = off.metrics(0)
    assert m.budget_exhaustion_risk is None
    assert (m.zero_variance_groups, m.filtered_groups, m.zero_variance_fraction) == (1, 0, 0.25)


def test_first_attempt_reward_counts_a_slots_own_attempt_that_an_extra_displaced(ledger) -> None:  # type: ignore[no-untyped-def]
    """An extra's group takes the earliest open slot, and that slot's own attempt serves the
    step as an extra from then on: its generation is still the first of the slot's own prompt,
    and counts in `first_attempt_reward` (by reason it did not: a step whose every own attempt
    was displaced had none)."""
    d = Driver(ledger, {"async_rl": {"max_lookahead_versions": 1, "over_dispatch": {"enabled": True, "safety_sigmas": 0.0}}})
    assert d.admit() == [0, 1]
    d.start_all([a.id for a in d.live()])
    own = {idx: d.live_of(0, idx).id for idx in range(4)}
    extras = [a for a in d.live(1) if a.slot_idx is None][:2]
    assert len(extras) == 2
    d.record(*(d.result(a.id, SPREAD) for a in extras))
    # Step 1's extras filled step 0's first two slots; their own attempts are step 0's extras now.
    assert {a.id for a in d.live(0) if a.slot_idx is None} == {own[0], own[1]}
    d.record(d.result(own[0], [0.0, 1.0, 0.0, 1.0]), d.result(own[1], [1.0, 1.0, 0.0, 1.0]))
    # Each took one of step 0's last two slots (displacing theirs): the step is full.
    assert d.step(0).status == "released"
    assert d.metrics(0).first_attempt_reward == pytest.approx((0.5 + 0.75) / 2)
