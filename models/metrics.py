"""Per-step metrics (SPEC §6), computed from ledger rows when a step is released.

They are aggregates of what the ledger already holds, so any of them can be recomputed with
SQL; storing them at release time keeps `refill metrics` and plots cheap and pins the value
the run saw (the spare pool size, the measured p) at that moment.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from refill.models import decisions, skipping
from refill.models.context import RunContext
from refill.models.decisions import GroupKind
from refill.models.rows import StepRow
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    Group,
    PromptDraw,
    Slot,
    StepMetrics,
)

REPLACEMENT_REASONS = (
    AttemptReason.FILTER_REPLACEMENT.value,
    AttemptReason.DROP_REPLACEMENT.value,
    AttemptReason.RESPAWN.value,
)


def zero_variance_from_counters(ctx: RunContext) -> tuple[int, int]:
    """(zero-variance groups, scored groups) over the whole run so far, this transaction's
    included, read from the run's counters (`results._apply` keeps them) rather than counted
    over its attempts: the over-dispatch and the budget decisions read it on every batch."""
    return int(ctx.run.zero_variance_groups or 0), int(ctx.run.scored_groups or 0)


def record_release_metrics(ctx: RunContext, step: StepRow) -> StepMetrics:
    session, run_id, s = ctx.session, ctx.run.id, step.step
    ctx.flush()
    # The step's attempts in one pass (a 4096-slot step has about 8,000): the scored ones'
    # aggregates, then the filtered, failed and replacement ones counted.
    scored = Attempt.zero_variance.is_not(None)
    n_finished, n_zero, n_solved, unfiltered, tokens, filtered, failed, replaced = session.execute(
        select(
            func.count().filter(scored),
            func.count().filter(Attempt.zero_variance.is_(True)),
            # all solved: `decisions.group_kind`
            func.count().filter(Attempt.zero_variance.is_(True) & (Attempt.reward_mean > 0)),
            func.avg(Attempt.reward_mean).filter(scored),
            func.coalesce(func.sum(Attempt.num_tokens).filter(scored), 0),
            func.count().filter(Attempt.state == AttemptState.FILTERED.value),
            func.count().filter(Attempt.state == AttemptState.FAILED.value),
            func.count().filter(Attempt.reason.in_(REPLACEMENT_REASONS)),
        ).where(Attempt.run_id == run_id, Attempt.step == s)
    ).one()
    first_reward = session.scalar(_first_attempt_reward(run_id, s))
    trained = session.execute(
        select(Group.reward_mean, Group.weight_version, Group.origin_step)
        .join(Slot, Slot.group_attempt_id == Group.attempt_id)
        .where(Slot.run_id == run_id, Slot.step == s)
    ).all()
    drops = session.scalar(select(func.coalesce(func.sum(Slot.drops), 0)).where(Slot.run_id == run_id, Slot.step == s))
    staleness = [s - v for _, v, _ in trained]
    zero_run, total_run = zero_variance_from_counters(ctx)
    p = zero_run / total_run if total_run else None
    settings = ctx.settings
    metrics = session.get(StepMetrics, (run_id, s)) or StepMetrics(run_id=run_id, step=s)
    metrics.reward = sum(r for r, _, _ in trained) / len(trained) if trained else None
    metrics.unfiltered_reward = float(unfiltered) if unfiltered is not None else None
    metrics.first_attempt_reward = float(first_reward) if first_reward is not None else None
    metrics.zero_variance_groups = int(n_zero or 0)
    metrics.zero_variance_fraction = (n_zero / n_finished) if n_finished else None
    metrics.filtered_groups = int(filtered or 0)
    metrics.failed_attempts = int(failed or 0)
    metrics.replaced_prompt_groups = int(replaced or 0)
    # Groups generated for a later step that this step trains (borrowed, or an extra of a later
    # step placed here), by where each was generated: the slots' `borrowed_in` also counted
    # parked groups of this or an earlier step, and a group borrowed in and lent on again.
    metrics.promoted_prompt_groups = sum(1 for _, _, origin in trained if origin > s)
    metrics.dropped_prompt_groups = int(drops or 0)
    metrics.trained_groups = len(trained)
    metrics.spare_pool_size = ctx.spare_count
    metrics.staleness_mean = sum(staleness) / len(staleness) if staleness else None
    metrics.staleness_max = max(staleness) if staleness else None
    metrics.step_fill_seconds = seconds_between(step.admitted_at, step.released_at)
    metrics.generated_tokens = int(tokens or 0)
    # What dynamic sampling pays per group it trains: about 1 / (1 - p) generations.
    metrics.rollouts_per_trained_group = n_finished / len(trained) if trained else None
    metrics.generated_tokens_per_trained_group = metrics.generated_tokens / len(trained) if trained else None
    record_skipping(ctx, metrics, int(n_finished or 0), int(n_solved or 0), int(n_zero or 0) - int(n_solved or 0))
    metrics.budget_exhaustion_risk = (
        decisions.exhaustion_probability(
            p, settings.filter_budget, settings.num_prompts_per_step, settings.max_num_steps
        )
        if p is not None and settings.use_dynamic_sampling
        else None
    )
    session.add(metrics)
    return metrics


def _first_attempt_reward(run_id: int, step: int) -> Any:
    """The mean reward of the first finished generation of each slot's own prompt (what a run
    without dynamic sampling would have trained on): of the attempts dispatched for the slot
    (`origin_slot`) on the prompt of its first one (admission's, the lowest id), not
    replacements, the lowest id that has a reward. By prompt, not by `reason`: a slot's own
    attempt that an extra's group displaced serves the step as an extra from then on
    (`slots.release_to_extra`), its prompt unchanged; by reason it was left out, and a step
    whose every own attempt was displaced had none (seen in CI). One pass over the step's
    attempts in slot and id order (two window functions), through the index of origins."""
    slot_order = {"partition_by": Attempt.origin_slot, "order_by": Attempt.id}
    dispatched = (
        select(
            Attempt.id,
            Attempt.origin_slot,
            Attempt.reason,
            Attempt.reward_mean,
            (Attempt.prompt_id == func.first_value(Attempt.prompt_id).over(**slot_order)).label("own_prompt"),
        )
        .where(Attempt.run_id == run_id, Attempt.origin_step == step, Attempt.origin_slot.is_not(None))
        .subquery()
    )
    finished = (
        select(dispatched.c.reward_mean, func.row_number().over(partition_by=dispatched.c.origin_slot, order_by=dispatched.c.id).label("n"))
        .where(dispatched.c.own_prompt.is_(True), dispatched.c.reason.not_in(REPLACEMENT_REASONS), dispatched.c.reward_mean.is_not(None))
        .subquery()
    )
    return select(func.avg(finished.c.reward_mean)).where(finished.c.n == 1)


def record_skipping(ctx: RunContext, metrics: StepMetrics, finished: int, solved: int, failed: int) -> None:
    """The prompts the loader skipped for the step, and skipping's exploration rates adapted
    to the step's groups (`refill.models.skipping`); nothing when the run does not skip."""
    rates = skipping.adapt_exploration(ctx, finished, solved, failed)
    if rates is None:
        return
    metrics.skip_exploration_solved = rates[GroupKind.SOLVED]
    metrics.skip_exploration_failed = rates[GroupKind.FAILED]
    metrics.skipped_prompts = int(
        ctx.session.scalar(
            select(func.count()).where(
                PromptDraw.run_id == ctx.run.id, PromptDraw.step == metrics.step, PromptDraw.skipped.is_(True)
            )
        )
        or 0
    )


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()
