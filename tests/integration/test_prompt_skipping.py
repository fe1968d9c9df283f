"""Issue 15: pre-rollout skipping in the ledger's data loader (`data.prompt_skipping`).

A run is played to its end by hand: every live attempt is finished, in id order, with the
rewards its prompt's data-set position gives, and each released step is trained. Even positions
are always all solved (zero-variance), odd ones have spread. Every test ends with `refill
check` (the integration conftest), whose `prompt_draws` check proves the epoch accounting:
each place of each epoch drawn once in order, each decision replayed from its seeded uniform,
no taken prompt lost.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from refill.models import admission, decisions, skipping
from refill.models.results import Outcome
from refill.models.tables import Attempt, Prompt, PromptDraw
from tests.support.driver import Driver
from tests.support.play import play, solved_if_even

SKIP = {"data": {"prompt_skipping": {"enabled": True, "exploration_rate": 0.05}}}
EPOCHS = {"grpo": {"max_num_steps": 50, "max_num_epochs": 3, "dynamic_sampling_max_replacements_per_slot": 16}}


def draws(d: Driver) -> list[dict[str, Any]]:
    """The run's loader draws with each prompt's data-set position, in (epoch, place) order."""
    with d.ledger.session() as s:
        rows = s.execute(
            select(PromptDraw, Prompt.position)
            .join(Prompt, Prompt.id == PromptDraw.prompt_id)
            .where(PromptDraw.run_id == d.run_id)
            .order_by(PromptDraw.epoch, PromptDraw.position)
        ).all()
        return [
            {
                "epoch": r.epoch,
                "place": r.position,
                "prompt": position,
                "step": r.step,
                "skipped": r.skipped,
                "kind": r.streak_kind,
                "streak": r.streak,
                "exploration": r.exploration,
                "probability": r.probability,
                "uniform": r.uniform,
            }
            for r, position in rows
        ]


def attempts_by_position(d: Driver) -> dict[int, int]:
    with d.ledger.session() as s:
        counts: dict[int, int] = {}
        for (position,) in s.execute(
            select(Prompt.position).join(Attempt, Attempt.prompt_id == Prompt.id).where(Attempt.run_id == d.run_id)
        ):
            counts[position] = counts.get(position, 0) + 1
        return counts


def test_without_skipping_nothing_is_skipped_and_the_cost_per_group_is_measured(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, EPOCHS, num_prompts=16)
    run = play(d, solved_if_even)
    assert (run.status, run.end_reason, run.loader_epoch) == ("completed", "end_of_data", 3)
    assert draws(d) == []
    for step in d.steps():
        m = d.metrics(step.step)
        assert m.skipped_prompts == 0 and m.skip_exploration_solved is None
        with d.ledger.session() as s:
            finished = len(
                s.scalars(
                    select(Attempt.id).where(
                        Attempt.run_id == d.run_id, Attempt.step == step.step, Attempt.zero_variance.is_not(None)
                    )
                ).all()
            )
        assert m.rollouts_per_trained_group == pytest.approx(finished / m.trained_groups)
        assert m.generated_tokens_per_trained_group == pytest.approx(m.generated_tokens / m.trained_groups)
    # Half the prompts are zero-variance: a trained group costs about two generations.
    assert sum(d.metrics(s.step).rollouts_per_trained_group for s in d.steps()) / len(d.steps()) > 1.5


def test_zero_variance_prompts_are_skipped_with_greso_s_probability(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {**EPOCHS, **SKIP}, num_prompts=16)
    reserve = d.config["rollout_failure"]["replacement_reserve_prompts"]

    def pool_above_its_mark(d: Driver) -> None:
        run = d.run()
        assert run.spare_prompts_available >= reserve or run.loader_exhausted

    run = play(d, solved_if_even, after=pool_above_its_mark)
    assert (run.status, run.end_reason) == ("completed", "end_of_data")
    rows = draws(d)
    # Every place of the three epochs, in order, and nothing past the end of the data.
    assert [(r["epoch"], r["place"]) for r in rows] == [(e, p) for e in range(3) for p in range(16)]
    assert not any(r["skipped"] for r in rows if r["epoch"] == 0)  # no history yet
    skipped = [r for r in rows if r["skipped"]]
    assert skipped, "an always-solved prompt seen before was never skipped"
    for r in skipped:
        assert r["prompt"] % 2 == 0 and (r["kind"], r["streak"] >= 1) == ("solved", True)
        assert r["probability"] == pytest.approx(1 - max(r["exploration"] ** r["streak"], 0.01))
        assert r["uniform"] < r["probability"] <= 0.99
    assert all(r["kind"] is None for r in rows if r["prompt"] % 2 == 1)  # spread: never a streak
    # A skipped prompt costs no generation: the always-solved prompts were generated less.
    tries = attempts_by_position(d)
    assert sum(tries.get(p, 0) for p in range(0, 16, 2)) < sum(tries.get(p, 0) for p in range(1, 16, 2))
    # Each step counts what was skipped for it (the prompt_draws check compares every step).
    trained = {s.step for s in d.steps()}
    assert sum(d.metrics(s).skipped_prompts for s in trained) == sum(1 for r in skipped if r["step"] in trained)


def test_exploration_rates_adapt_from_the_second_epoch(ledger) -> None:  # type: ignore[no-untyped-def]
    """GRESO's rule at each release: a kind at or above its target share of the step's groups
    is explored 0.01 less, one below it 0.01 more (all-solved aim at 1/12, all-failed at 1/6)."""
    d = Driver(ledger, {**EPOCHS, "data": {"prompt_skipping": {"enabled": True}}}, num_prompts=16)
    play(d, solved_if_even)
    steps = sorted(d.steps(), key=lambda s: s.released_at)
    rates = [(0.5, 0.5)] + [
        (d.metrics(s.step).skip_exploration_solved, d.metrics(s.step).skip_exploration_failed) for s in steps
    ]
    adapted = 0
    for step, (solved, failed), (next_solved, next_failed) in zip(steps, rates, rates[1:], strict=False):
        with d.ledger.session() as s:
            groups = s.execute(
                select(Attempt.zero_variance, Attempt.reward_mean).where(
                    Attempt.run_id == d.run_id, Attempt.step == step.step, Attempt.zero_variance.is_not(None)
                )
            ).all()
        share = sum(1 for zero, mean in groups if zero and mean > 0) / len(groups)
        assert not any(zero and mean <= 0 for zero, mean in groups)  # no prompt always fails
        if (next_solved, next_failed) == (solved, failed):
            continue  # released while the loader was in its first epoch
        adapted += 1
        assert next_solved == pytest.approx(solved - 0.01 if share >= 0.25 / 3 else solved + 0.01)
        assert next_failed == pytest.approx(failed + 0.01)
    assert adapted >= 2
    run = d.run()
    assert (run.skip_exploration_solved, run.skip_exploration_failed) == rates[-1]


def test_every_prompt_keeps_a_chance(ledger) -> None:  # type: ignore[no-untyped-def]
    """min_exploration bounds the skip probability: prompts skipped once are tried again."""
    d = Driver(
        ledger,
        {"grpo": {"max_num_steps": 200, "max_num_epochs": 8},
         "data": {"prompt_skipping": {"enabled": True, "exploration_rate": 0.05, "min_exploration": 0.3}}},
        num_prompts=16,
    )
    play(d, solved_if_even)
    rows = draws(d)
    assert max(r["probability"] for r in rows) == pytest.approx(0.7)
    retried = {
        r["prompt"]
        for r in rows
        if not r["skipped"] and any(o["skipped"] and o["prompt"] == r["prompt"] and o["epoch"] < r["epoch"] for o in rows)
    }
    assert len(retried) >= 4, rows


def test_a_streak_is_counted_as_far_back_as_its_skip_probability_moves(ledger) -> None:  # type: ignore[no-untyped-def]
    """A prompt's history is read back only to the streak whose skip probability has reached
    its ceiling (0.7 ** 3 is under min_exploration 0.4: three), since a longer one skips the
    same. On both ledgers (PostgreSQL reads each prompt's newest three groups, SQLite all of
    them), each prompt's streak read so is its whole streak cut at three; the loader records
    no streak above three, and the ceiling's probability, 0.6, for the always-solved prompts
    seen that often."""
    rates = {"exploration_rate": 0.7, "min_exploration": 0.4, "exploration_rate_step": 0.0}
    d = Driver(
        ledger,
        {"grpo": {**EPOCHS["grpo"], "max_num_steps": 200, "max_num_epochs": 10}, "data": {"prompt_skipping": {"enabled": True, **rates}}},
        num_prompts=16,
    )
    play(d, solved_if_even)
    assert decisions.saturating_streak([0.7, 0.7], 0.4) == 3
    with d.ledger.session() as s:
        prompt_ids = list(s.scalars(select(Prompt.id).where(Prompt.run_id == d.run_id)))
        whole = skipping.streaks(s, d.run_id, prompt_ids)
        read_back = skipping.streaks(s, d.run_id, prompt_ids, 3)
    assert read_back == {prompt: (kind, min(k, 3)) for prompt, (kind, k) in whole.items()}
    assert sum(k > 3 for _, k in whole.values()) >= 4, whole  # the cut was exercised
    rows = draws(d)
    assert max(r["streak"] for r in rows) == 3
    assert all(r["probability"] == pytest.approx(1 - max(0.7 ** r["streak"], 0.4)) for r in rows if r["streak"])
    assert sum(r["probability"] == pytest.approx(0.6) for r in rows) >= 4


def test_skipping_survives_a_controller_crash_and_resume(ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The process admitting a step dies in the middle of an admission that drew (and
    skipped) prompts: its transaction is lost, a new controller takes the run over and admits
    again. The seeded
    draws make the same decisions: the same prompts are skipped as in a run without the crash,
    and every place of every epoch is drawn once (refill check's prompt_draws)."""
    reference = Driver(ledger, {**EPOCHS, **SKIP}, num_prompts=16)
    play(reference, solved_if_even)

    d = Driver(ledger, {**EPOCHS, **SKIP}, num_prompts=16)
    real_open_step = admission.open_step
    crashed: list[int] = []

    def dies_once_in_epoch_one(ctx, step, prompt_ids):  # type: ignore[no-untyped-def]
        if not crashed and ctx.run.loader_epoch >= 1:
            crashed.append(step)
            raise KeyboardInterrupt("the controller dies mid-admission")
        return real_open_step(ctx, step, prompt_ids)

    monkeypatch.setattr(admission, "open_step", dies_once_in_epoch_one)
    with pytest.raises(KeyboardInterrupt):
        play(d, solved_if_even)
    assert crashed
    monkeypatch.setattr(admission, "open_step", real_open_step)
    # The admission was the one that follows a training step: the dead process held that
    # step's lease. Past it, a new controller takes the run over and a new trainer the step
    # (which admits again, first, as the dead one was about to).
    d.now += timedelta(seconds=d.config["infra"]["trainer_lease_seconds"] + 1)
    assert d.resume("controller-2").status == "running"
    for step in d.steps():
        if step.status == "training":
            assert d.train(step.step, trainer="trainer-2")
    run = play(d, solved_if_even)
    assert (run.status, run.end_reason) == ("completed", "end_of_data")
    assert draws(d) == draws(reference)
    assert [r["prompt"] for r in draws(d) if r["skipped"]]  # there were skips to agree on


def test_zero_variance_judges_floating_point_noise_as_no_spread(ledger) -> None:  # type: ignore[no-untyped-def]
    """Item 7: with the default grpo.zero_variance_tolerance a group whose rewards differ by
    rounding alone is filtered; a tolerance of 0.0 keeps exact equality."""
    noisy = [0.1 + 0.2, 0.3, 0.3, 0.3]
    assert decisions.reward_spread(noisy) > 0
    d = Driver(ledger)
    d.admit()
    assert d.filter_slot(0, 0, noisy).outcome is Outcome.FILTERED
    exact = Driver(ledger, {"grpo": {"zero_variance_tolerance": 0.0}})
    exact.admit()
    assert exact.commit_slot(0, 0, noisy).outcome is Outcome.COMMITTED
