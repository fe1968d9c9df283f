"""Per-step metrics (SPEC §6), computed from ledger rows when a step is released.

They are aggregates of what the ledger already holds, so any of them can be recomputed with
SQL; storing them at release time keeps `refill metrics` and plots cheap and pins the value
the run saw (the spare pool size, the measured p) at that moment.
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import Integer, bindparam, func, select, true
from sqlalchemy.sql import Select

from refill.models import decisions, driver, skipping
from refill.models.context import RunContext
from refill.models.decisions import GroupKind
from refill.models.rows import StepRow
from refill.models.sql import literal_in
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    Group,
    PromptDraw,
    Slot,
    StepMetrics,
)

# The tables, not the ORM classes: a statement that names an ORM attribute is compiled by the
# ORM's machinery (see `models/sql.py`).
_attempts, _groups, _slots = Attempt.__table__, Group.__table__, Slot.__table__
_metrics = StepMetrics.__table__

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
    found = driver.rows(session, _release_read(), {"run_id": run_id, "step": s})[0]
    # int(): counts and sums of integer columns, which a wider column would bring as Decimal
    n_finished, n_zero, n_solved = int(found.finished), int(found.zero), int(found.solved)
    trained = int(found.trained)
    zero_run, total_run = zero_variance_from_counters(ctx)
    p = zero_run / total_run if total_run else None
    settings = ctx.settings
    metrics = (session.get(StepMetrics, (run_id, s)) if found.stored else None) or StepMetrics(run_id=run_id, step=s)
    metrics.reward = found.reward_sum / trained if trained else None
    metrics.unfiltered_reward = float(found.unfiltered) if found.unfiltered is not None else None
    metrics.first_attempt_reward = float(found.first_reward) if found.first_reward is not None else None
    metrics.zero_variance_groups = n_zero
    metrics.zero_variance_fraction = (n_zero / n_finished) if n_finished else None
    metrics.filtered_groups = int(found.filtered)
    metrics.failed_attempts = int(found.failed)
    metrics.replaced_prompt_groups = int(found.replaced)
    # Groups generated for a later step that this step trains (borrowed, or an extra of a later
    # step placed here), by where each was generated: the slots' `borrowed_in` also counted
    # parked groups of this or an earlier step, and a group borrowed in and lent on again.
    metrics.promoted_prompt_groups = int(found.promoted)
    metrics.dropped_prompt_groups = int(found.drops)
    metrics.trained_groups = trained
    metrics.spare_pool_size = ctx.spare_count
    metrics.staleness_mean = int(found.staleness_sum) / trained if trained else None
    metrics.staleness_max = int(found.staleness_max) if trained else None
    metrics.step_fill_seconds = seconds_between(step.admitted_at, step.released_at)
    metrics.generated_tokens = int(found.tokens)
    # What dynamic sampling pays per group it trains: about 1 / (1 - p) generations.
    metrics.rollouts_per_trained_group = n_finished / trained if trained else None
    metrics.generated_tokens_per_trained_group = metrics.generated_tokens / trained if trained else None
    record_skipping(ctx, metrics, n_finished, n_solved, n_zero - n_solved)
    metrics.budget_exhaustion_risk = (
        decisions.exhaustion_probability(
            p, settings.filter_budget, settings.num_prompts_per_step, settings.max_num_steps
        )
        if p is not None and settings.use_dynamic_sampling
        else None
    )
    session.add(metrics)
    return metrics


@cache
def _release_read() -> Select[Any]:
    """What a step's metrics aggregate, in one statement (one round trip under the run's lock,
    and a second only where its metrics row is stored already; built and compiled once per
    process): its attempts in one pass (a 4096-slot step has about 8,000), the scored ones'
    aggregates, then the filtered, failed and replacement ones counted; its slots (each once: a
    group fills one slot) and the groups they train; the first attempts' reward; whether its
    metrics row is stored already. Sums, not means, of what Python divides, as it did over the
    rows."""
    step = bindparam("step", type_=Integer)
    run_id = bindparam("run_id", type_=Integer)
    scored = _attempts.c.zero_variance.is_not(None)
    zero = _attempts.c.zero_variance.is_(True)
    attempts = (
        select(
            func.count().filter(scored).label("finished"),
            func.count().filter(zero).label("zero"),
            # all solved: `decisions.group_kind`
            func.count().filter(zero & (_attempts.c.reward_mean > 0)).label("solved"),
            func.avg(_attempts.c.reward_mean).filter(scored).label("unfiltered"),
            func.coalesce(func.sum(_attempts.c.num_tokens).filter(scored), 0).label("tokens"),
            func.count().filter(_attempts.c.state == AttemptState.FILTERED.value).label("filtered"),
            func.count().filter(_attempts.c.state == AttemptState.FAILED.value).label("failed"),
            func.count().filter(literal_in(_attempts.c.reason, REPLACEMENT_REASONS)).label("replaced"),
        )
        .where(_attempts.c.run_id == run_id, _attempts.c.step == step)
        .subquery("a")
    )
    staleness = step - _groups.c.weight_version
    slots = (
        select(
            func.count(_groups.c.attempt_id).label("trained"),
            func.coalesce(func.sum(_groups.c.reward_mean), 0.0).label("reward_sum"),
            func.coalesce(func.sum(staleness), 0).label("staleness_sum"),
            func.max(staleness).label("staleness_max"),
            func.count().filter(_groups.c.origin_step > step).label("promoted"),
            func.coalesce(func.sum(_slots.c.drops), 0).label("drops"),
        )
        .select_from(_slots.outerjoin(_groups, _groups.c.attempt_id == _slots.c.group_attempt_id))
        .where(_slots.c.run_id == run_id, _slots.c.step == step)
        .subquery("s")
    )
    stored = (
        select(_metrics.c.step)
        .where(_metrics.c.run_id == run_id, _metrics.c.step == step)
        .exists()
        .label("stored")
    )
    return select(
        *attempts.c,
        *slots.c,
        _first_attempt_reward(run_id, step).scalar_subquery().label("first_reward"),
        stored,
    ).select_from(attempts.join(slots, true()))


def _first_attempt_reward(run_id: Any, step: Any) -> Select[Any]:
    """The mean reward of the first finished generation of each slot's own prompt (what a run
    without dynamic sampling would have trained on): of the attempts dispatched for the slot
    (`origin_slot`) on the prompt of its first one (admission's, the lowest id), not
    replacements, the lowest id that has a reward. By prompt, not by `reason`: a slot's own
    attempt that an extra's group displaced serves the step as an extra from then on
    (`slots.release_to_extra`), its prompt unchanged; by reason it was left out, and a step
    whose every own attempt was displaced had none (seen in CI). One pass over the step's
    attempts in slot and id order (two window functions), through the index of origins."""
    slot_order = {"partition_by": _attempts.c.origin_slot, "order_by": _attempts.c.id}
    dispatched = (
        select(
            _attempts.c.id,
            _attempts.c.origin_slot,
            _attempts.c.reason,
            _attempts.c.reward_mean,
            (_attempts.c.prompt_id == func.first_value(_attempts.c.prompt_id).over(**slot_order)).label("own_prompt"),
        )
        .where(_attempts.c.run_id == run_id, _attempts.c.origin_step == step, _attempts.c.origin_slot.is_not(None))
        .subquery()
    )
    finished = (
        select(dispatched.c.reward_mean, func.row_number().over(partition_by=dispatched.c.origin_slot, order_by=dispatched.c.id).label("n"))
        .where(dispatched.c.own_prompt.is_(True), ~literal_in(dispatched.c.reason, REPLACEMENT_REASONS), dispatched.c.reward_mean.is_not(None))
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
