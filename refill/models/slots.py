"""The life of a slot: dispatch, commit, borrow, replace, drop, shrink, release.

Invariant kept by every function here: an open slot has exactly one live attempt (pending,
queued or running) aimed at it, and a settled (committed or shrunk) slot has none. Over-
dispatched EXTRA attempts serve a step without a slot. All functions run inside a
`RunContext`, i.e. with the run's row locked.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import case, exists, func, select, update

from refill.models import decisions
from refill.models.context import RunContext
from refill.models.dataloader import take_spare
from refill.models.samplers import GroupView, SlotView
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    FailureKind,
    Group,
    Outbox,
    OutboxKind,
    RunStatus,
    ShrinkReason,
    Slot,
    SlotStatus,
    Step,
    StepStatus,
)

LIVE = tuple(s.value for s in AttemptState.live())


class RunFailed(Exception):
    """Raised inside a ledger operation after the run was marked failed, to stop its work.

    The transaction still commits: the failure and the error message are part of the ledger.
    """


# --- dispatch ----------------------------------------------------------------------------


def dispatch(
    ctx: RunContext,
    *,
    step: int,
    slot: Slot | None,
    prompt_id: int,
    reason: AttemptReason,
    try_no: int = 1,
    delay_seconds: float = 0.0,
    origin: tuple[int, int | None] | None = None,
) -> Attempt:
    """A new attempt for `slot` (or an EXTRA for `step`), with its outbox row."""
    available = ctx.later(delay_seconds)
    attempt = Attempt(
        run_id=ctx.run.id,
        step=step,
        slot_idx=slot.idx if slot is not None else None,
        origin_step=origin[0] if origin else step,
        origin_slot=origin[1] if origin else (slot.idx if slot is not None else None),
        prompt_id=prompt_id,
        try_no=try_no,
        reason=reason.value,
        state=AttemptState.PENDING.value,
        min_weight_version=max(0, step - ctx.settings.max_lookahead_versions),
        created_at=ctx.now,
        available_at=available,
    )
    ctx.session.add(attempt)
    if slot is not None:
        slot.attempts += 1
    row = Outbox(
        run_id=ctx.run.id,
        kind=OutboxKind.GENERATE.value,
        attempt=attempt,
        payload={},
        created_at=ctx.now,
        available_at=available,
    )
    ctx.session.add(row)
    ctx.outbox.append(row)
    return attempt


def dispatch_spare(ctx: RunContext, slot: Slot, reason: AttemptReason) -> bool:
    """Dispatch a spare prompt for `slot`; False when the data has run out."""
    spare = take_spare(ctx)
    if spare is None:
        return False
    attempt = dispatch(ctx, step=slot.step, slot=slot, prompt_id=spare.prompt_id, reason=reason)
    ctx.session.flush()
    spare.taken_by_attempt = attempt.id
    return True


# --- settle ------------------------------------------------------------------------------


def fill(ctx: RunContext, slot: Slot, group: Group, *, moved: bool) -> None:
    slot.status = SlotStatus.COMMITTED.value
    slot.group_attempt_id = group.attempt_id
    slot.needs_replacement = False
    slot.settled_at = ctx.now
    group.parked = False
    if moved:
        slot.borrowed_in += 1
        group.moves += 1
    step = ctx.step(slot.step)
    step.committed += 1
    maybe_release(ctx, step)


def shrink(ctx: RunContext, slot: Slot, reason: ShrinkReason) -> None:
    slot.status = SlotStatus.SHRUNK.value
    slot.shrink_reason = reason.value
    slot.needs_replacement = False
    slot.settled_at = ctx.now
    step = ctx.step(slot.step)
    step.shrunk += 1
    if reason is ShrinkReason.DROPPED:
        step.dropped_shrunk += 1
        if decisions.step_too_short(
            step.num_slots, step.dropped_shrunk, ctx.settings.min_step_batch_fraction
        ):
            fail_run(
                ctx,
                decisions.short_step_message(
                    step=step.step,
                    num_prompts_per_step=step.num_slots,
                    dropped_shrunk=step.dropped_shrunk,
                    min_step_batch_fraction=ctx.settings.min_step_batch_fraction,
                    recent_errors=recent_errors(ctx, step.step),
                ),
                "short_step",
            )
    maybe_release(ctx, step)


def maybe_release(ctx: RunContext, step: Step) -> bool:
    """The barrier: release a full step exactly once and queue its training."""
    if step.status != StepStatus.OPEN.value or not decisions.step_is_full(
        step.committed, step.num_slots, step.shrunk
    ):
        return False
    ctx.session.flush()
    # The conditional update is the exactly-once guarantee even if a caller forgot the run
    # lock: only the transaction that moves the row out of 'open' releases it.
    released = ctx.session.execute(
        update(Step)
        .where(
            Step.run_id == ctx.run.id,
            Step.step == step.step,
            Step.status == StepStatus.OPEN.value,
            Step.committed == Step.num_slots - Step.shrunk,
        )
        .values(status=StepStatus.RELEASED.value, released_at=ctx.now)
        .execution_options(synchronize_session=False)
    ).rowcount
    ctx.session.refresh(step)
    if released != 1:
        return False
    from refill.models.metrics import record_release_metrics

    record_release_metrics(ctx, step)
    if ctx.run.weight_version == step.step:
        queue_training(ctx, step.step)
    return True


def queue_training(ctx: RunContext, step: int) -> None:
    row = Outbox(
        run_id=ctx.run.id,
        kind=OutboxKind.TRAIN_STEP.value,
        step=step,
        payload={"run_id": ctx.run.id, "step": step},
        created_at=ctx.now,
        available_at=ctx.now,
    )
    ctx.session.add(row)
    ctx.outbox.append(row)


# --- replacement (SPEC §3.4) -------------------------------------------------------------


def replace(ctx: RunContext, slot: Slot, *, after_filter: bool) -> None:
    """Find `slot` a new group: borrow one, else dispatch a spare prompt, else shrink."""
    if after_filter:
        slot.filter_replacements += 1
    else:
        slot.drop_replacements += 1
    slot.needs_replacement = True
    view = SlotView(slot.step, slot.idx, True)
    lender = ctx.sampler.lender(view, lender_candidates(ctx, slot.step))
    spare_available = ctx.spare_count > 0 or not ctx.run.loader_exhausted
    source = decisions.replacement_source(lender is not None, spare_available)
    if source is decisions.Source.BORROW:
        assert lender is not None
        borrow(ctx, lender, slot)
        return
    reason = AttemptReason.FILTER_REPLACEMENT if after_filter else AttemptReason.DROP_REPLACEMENT
    if source is decisions.Source.SHRINK or not dispatch_spare(ctx, slot, reason):
        shrink(ctx, slot, ShrinkReason.END_OF_DATA)


def lender_candidates(ctx: RunContext, step: int, limit: int = 128) -> list[GroupView]:
    """Groups `step` may borrow: parked surplus and groups committed for later open steps."""
    settings = ctx.settings
    session = ctx.session
    session.flush()
    later = session.execute(
        select(Slot.step, Slot.idx, Group.attempt_id, Group.weight_version)
        .join(Group, Group.attempt_id == Slot.group_attempt_id)
        .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
        .where(
            Slot.run_id == ctx.run.id,
            Slot.step > step,
            Slot.status == SlotStatus.COMMITTED.value,
            Step.status == StepStatus.OPEN.value,
            Group.weight_version >= step - settings.max_lookahead_versions,
        )
        .order_by(Slot.step.desc(), Group.attempt_id.desc())
        .limit(limit)
    ).all()
    parked = session.execute(
        select(Group.attempt_id, Group.weight_version)
        .where(
            Group.run_id == ctx.run.id,
            Group.parked.is_(True),
            Group.weight_version >= step - settings.max_lookahead_versions,
            Group.weight_version <= step,
        )
        .order_by(Group.weight_version, Group.attempt_id)
        .limit(limit)
    ).all()
    return [GroupView(a, v, None, None) for a, v in parked] + [
        GroupView(a, v, s, i) for s, i, a, v in later
    ]


def borrow(ctx: RunContext, lender: GroupView, slot: Slot) -> None:
    """Move a committed group into `slot`; the lender's slot gets the spare prompt instead."""
    group = ctx.session.get(Group, lender.attempt_id)
    assert group is not None
    if lender.step is not None and lender.idx is not None:
        source = ctx.slot(lender.step, lender.idx)
        source.status = SlotStatus.OPEN.value
        source.group_attempt_id = None
        source.settled_at = None
        source.lent_out += 1
        ctx.step(lender.step).committed -= 1
        # Flush before the borrower takes the group: the unique index on
        # slots.group_attempt_id is checked row by row.
        ctx.session.flush()
        fill(ctx, slot, group, moved=True)
        source.needs_replacement = True
        if not dispatch_spare(ctx, source, AttemptReason.RESPAWN):
            shrink(ctx, source, ShrinkReason.END_OF_DATA)
    else:
        fill(ctx, slot, group, moved=True)


# --- placement of a committed group ------------------------------------------------------


def placement_candidates(ctx: RunContext, group: Group, own: Slot | None, limit: int = 32) -> list[SlotView]:
    """Open slots, earlier than the group's own, that it may fill within the staleness bound."""
    settings = ctx.settings
    bound_step = group.weight_version + settings.max_lookahead_versions
    query = (
        select(Slot.step, Slot.idx, Slot.needs_replacement)
        .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
        .where(
            Slot.run_id == ctx.run.id,
            Slot.status == SlotStatus.OPEN.value,
            Step.status == StepStatus.OPEN.value,
            Slot.step <= bound_step,
        )
    )
    if own is not None:
        query = query.where(Slot.step < own.step)
    if settings.sampler_name == "in_order":
        query = query.where(Slot.needs_replacement.is_(True))
    rows = ctx.session.execute(
        query.order_by(Slot.step, Slot.needs_replacement.desc(), Slot.idx).limit(limit)
    ).all()
    return [SlotView(s, i, bool(n)) for s, i, n in rows]


def reaim(ctx: RunContext, source: Slot, target: Slot) -> bool:
    """Hand `source`'s live attempt over to `target`, if it can still serve `target`.

    An attempt that has not started takes the target's staleness floor as its minimum weight
    version (the worker reads it from the ledger when it starts). A running one keeps the
    version it started with, so it may only move to a step that version can still train.
    """
    floor = max(0, target.step - ctx.settings.max_lookahead_versions)
    ctx.session.flush()
    moved = ctx.session.execute(
        update(Attempt)
        .where(
            Attempt.run_id == ctx.run.id,
            Attempt.step == source.step,
            Attempt.slot_idx == source.idx,
            Attempt.state.in_(LIVE),
            (Attempt.state != AttemptState.RUNNING.value) | (Attempt.min_weight_version >= floor),
        )
        .values(
            step=target.step,
            slot_idx=target.idx,
            min_weight_version=case(
                (Attempt.min_weight_version < floor, floor), else_=Attempt.min_weight_version
            ),
        )
        .execution_options(synchronize_session=False)
    ).rowcount
    if moved:
        target.attempts += 1
        # Objects already loaded must see the new aim.
        for obj in list(ctx.session.identity_map.values()):
            if isinstance(obj, Attempt) and obj.step == source.step and obj.slot_idx == source.idx:
                ctx.session.expire(obj)
    return bool(moved)


def has_live_attempt(ctx: RunContext, slot: Slot) -> bool:
    ctx.session.flush()
    return bool(
        ctx.session.scalar(
            select(
                exists().where(
                    Attempt.run_id == ctx.run.id,
                    Attempt.step == slot.step,
                    Attempt.slot_idx == slot.idx,
                    Attempt.state.in_(LIVE),
                )
            )
        )
    )


def place(ctx: RunContext, group: Group, own: Slot | None) -> Slot | None:
    """Put a newly committed group where the sampler wants it; None when it is parked."""
    view = GroupView(group.attempt_id, group.weight_version, None, None)
    own_view = SlotView(own.step, own.idx, own.needs_replacement) if own is not None else None
    candidates: Sequence[SlotView] = placement_candidates(ctx, group, own)
    for _ in range(8):
        choice = ctx.sampler.place(view, own_view, candidates)
        if choice is None:
            group.parked = True
            return None
        if own is not None and (choice.step, choice.idx) == (own.step, own.idx):
            fill(ctx, own, group, moved=False)
            return own
        target = ctx.slot(choice.step, choice.idx)
        if target.status != SlotStatus.OPEN.value:
            candidates = [c for c in candidates if c != choice]
            continue
        if own is not None:
            if not reaim(ctx, target, own):
                candidates = [c for c in candidates if c != choice]
                continue
        elif has_live_attempt(ctx, target):
            # An extra fills a slot whose own attempt then becomes an extra of that step.
            release_to_extra(ctx, target)
        fill(ctx, target, group, moved=own is not None)
        return target
    if own is not None:
        fill(ctx, own, group, moved=False)
        return own
    group.parked = True
    return None


def release_to_extra(ctx: RunContext, slot: Slot) -> None:
    ctx.session.flush()
    ctx.session.execute(
        update(Attempt)
        .where(
            Attempt.run_id == ctx.run.id,
            Attempt.step == slot.step,
            Attempt.slot_idx == slot.idx,
            Attempt.state.in_(LIVE),
        )
        .values(slot_idx=None, reason=AttemptReason.EXTRA.value)
        .execution_options(synchronize_session=False)
    )
    for obj in list(ctx.session.identity_map.values()):
        if isinstance(obj, Attempt) and obj.step == slot.step and obj.slot_idx == slot.idx:
            ctx.session.expire(obj)


# --- failures (SPEC §3.2, §3.6) ----------------------------------------------------------


def infra_failure(ctx: RunContext, attempt: Attempt, error: str) -> None:
    attempt.state = AttemptState.FAILED.value
    attempt.failure_kind = FailureKind.INFRA.value
    attempt.error = error[:4000]
    attempt.finished_at = attempt.finished_at or ctx.now
    slot = aimed_slot(ctx, attempt)
    if slot is None:
        return
    slot.infra_failures += 1
    settings = ctx.settings
    if decisions.should_retry(attempt.try_no, settings.max_attempts_per_prompt):
        dispatch(
            ctx,
            step=slot.step,
            slot=slot,
            prompt_id=attempt.prompt_id,
            reason=AttemptReason.RETRY,
            try_no=attempt.try_no + 1,
            delay_seconds=decisions.retry_backoff(
                attempt.try_no, settings.retry_backoff_seconds, settings.retry_backoff_max_seconds
            ),
            origin=(attempt.origin_step, attempt.origin_slot),
        )
        return
    drop(ctx, slot, infra=True, last_error=error)


def data_failure(ctx: RunContext, attempt: Attempt, error: str) -> None:
    """The prompt's output is unusable; retrying the same prompt would fail the same way, so
    the prompt is dropped at once and the slot follows `on_dropped_prompt`."""
    attempt.state = AttemptState.FAILED.value
    attempt.failure_kind = FailureKind.DATA.value
    attempt.error = error[:4000]
    attempt.finished_at = attempt.finished_at or ctx.now
    slot = aimed_slot(ctx, attempt)
    if slot is None:
        return
    slot.data_failures += 1
    drop(ctx, slot, infra=False, last_error=error)


def drop(ctx: RunContext, slot: Slot, *, infra: bool, last_error: str | None) -> None:
    settings = ctx.settings
    slot.drops += 1
    if infra:
        ctx.run.consecutive_dropped += 1
        if ctx.run.consecutive_dropped > settings.max_consecutive_dropped_prompts:
            fail_run(
                ctx,
                decisions.consecutive_drops_message(
                    ctx.run.consecutive_dropped, settings.max_consecutive_dropped_prompts, last_error
                ),
                "fleet_failed",
            )
    choice = decisions.after_drop(
        settings.on_dropped_prompt, slot.drop_replacements, settings.max_replacement_attempts
    )
    if choice is decisions.AfterDrop.REPLACE:
        replace(ctx, slot, after_filter=False)
    else:
        shrink(ctx, slot, ShrinkReason.DROPPED)


def aimed_slot(ctx: RunContext, attempt: Attempt) -> Slot | None:
    """The open slot an attempt serves; None for an extra (or a slot settled otherwise)."""
    if attempt.slot_idx is None:
        return None
    slot = ctx.slot(attempt.step, attempt.slot_idx)
    return slot if slot.status == SlotStatus.OPEN.value else None


# --- run end -----------------------------------------------------------------------------


def fail_run(ctx: RunContext, message: str, reason: str) -> None:
    """Mark the run failed with `message` and stop the current operation (RunFailed).

    `reason` is the run's end_reason: budget_exhausted, short_step or fleet_failed (the only
    one `refill run resume` accepts, once the workers are fixed)."""
    run = ctx.run
    if run.status in (RunStatus.FAILED.value, RunStatus.COMPLETED.value):
        raise RunFailed(run.error or message)
    run.status = RunStatus.FAILED.value
    run.error = message
    run.end_reason = reason
    run.finished_at = ctx.now
    cancel_live_attempts(ctx, "run failed")
    raise RunFailed(message)


def cancel_live_attempts(ctx: RunContext, why: str) -> int:
    ctx.session.flush()
    count = ctx.session.execute(
        update(Attempt)
        .where(Attempt.run_id == ctx.run.id, Attempt.state.in_(LIVE))
        .values(state=AttemptState.CANCELLED.value, error=why, finished_at=ctx.now)
        .execution_options(synchronize_session=False)
    ).rowcount
    for obj in list(ctx.session.identity_map.values()):
        if isinstance(obj, Attempt):
            ctx.session.expire(obj)
    return count


def recent_errors(ctx: RunContext, step: int, limit: int = 3) -> list[str]:
    ctx.session.flush()
    rows = ctx.session.execute(
        select(Attempt.id, Attempt.error)
        .where(
            Attempt.run_id == ctx.run.id,
            Attempt.step == step,
            Attempt.state == AttemptState.FAILED.value,
        )
        .order_by(Attempt.id.desc())
        .limit(limit)
    ).all()
    return [f"attempt {a}: {(e or '').splitlines()[0][:200]}" for a, e in rows]


def measured_zero_variance(ctx: RunContext) -> tuple[int, int]:
    """(zero-variance groups, finished groups) over the whole run so far."""
    ctx.session.flush()
    zero, total = ctx.session.execute(
        select(
            func.count().filter(Attempt.zero_variance.is_(True)),
            func.count(),
        ).where(Attempt.run_id == ctx.run.id, Attempt.zero_variance.is_not(None))
    ).one()
    return int(zero or 0), int(total or 0)
