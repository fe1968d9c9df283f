"""The life of a slot: dispatch, commit, borrow, replace, drop, shrink; each slot settled
asks the barrier (`barrier.maybe_release`) whether its step is full.

Invariant kept by every function here: an open slot has exactly one live attempt (pending,
queued or running) aimed at it, and a settled (committed or shrunk) slot has none. Over-
dispatched EXTRA attempts serve a step without a slot. All functions run inside a
`RunContext`, i.e. with the run's row locked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update

from refill.models import decisions, sql
from refill.models.barrier import maybe_release
from refill.models.context import LENDER_CHOICES, PLACEMENT_CHOICES, RunContext
from refill.models.dataloader import mark_taken, take_spare
from refill.models.rows import AttemptRow, GroupRow, SlotRow
from refill.models.samplers import GroupView, SlotView
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    FailureKind,
    RunStatus,
    ShrinkReason,
    Slot,
    SlotStatus,
)

LIVE = tuple(s.value for s in AttemptState.live())
_attempts = Attempt.__table__
_RUNNING, _PENDING = AttemptState.RUNNING.value, AttemptState.PENDING.value
# Plain strings: an enum member's `.value` is a Python property call, on every placement.
_SLOT_OPEN, _SLOT_COMMITTED = SlotStatus.OPEN.value, SlotStatus.COMMITTED.value

log = logging.getLogger(__name__)


class RunFailed(Exception):
    """Raised inside a ledger operation after the run was marked failed, to stop its work.

    The transaction still commits: the failure and the error message are part of the ledger.
    """


# --- dispatch ----------------------------------------------------------------------------


def attempt_values(
    ctx: RunContext,
    *,
    step: int,
    slot_idx: int | None,
    prompt_id: int,
    reason: AttemptReason,
    try_no: int = 1,
    available: datetime,
    origin: tuple[int, int | None] | None = None,
) -> dict[str, Any]:
    """The columns of a new attempt (for `dispatch`, and admission's multi-row insert)."""
    return {
        "run_id": ctx.run.id,
        "step": step,
        "slot_idx": slot_idx,
        "origin_step": origin[0] if origin else step,
        "origin_slot": origin[1] if origin else slot_idx,
        "prompt_id": prompt_id,
        "try_no": try_no,
        "reason": reason.value,
        "state": _PENDING,
        "min_weight_version": max(0, step - ctx.settings.max_lookahead_versions),
        "created_at": ctx.now,
        "available_at": available,
    }


def dispatch(
    ctx: RunContext,
    *,
    step: int,
    slot: SlotRow | None,
    prompt_id: int,
    reason: AttemptReason,
    try_no: int = 1,
    delay_seconds: float = 0.0,
    origin: tuple[int, int | None] | None = None,
) -> AttemptRow:
    """A new attempt for `slot` (or an EXTRA for `step`): pending, it is its own generate
    message, due at `available_at` (`refill.models.outbox`)."""
    available = ctx.later(delay_seconds)
    attempt = ctx.new_attempt(
        attempt_values(
            ctx,
            step=step,
            slot_idx=slot.idx if slot is not None else None,
            prompt_id=prompt_id,
            reason=reason,
            try_no=try_no,
            available=available,
            origin=origin,
        )
    )
    if slot is not None:
        slot.attempts += 1
    return attempt


def dispatch_spare(ctx: RunContext, slot: SlotRow, reason: AttemptReason) -> bool:
    """Dispatch a spare prompt for `slot`; False when the data has run out."""
    spare = take_spare(ctx)
    if spare is None:
        return False
    mark_taken(spare, dispatch(ctx, step=slot.step, slot=slot, prompt_id=spare.prompt_id, reason=reason))
    return True


def dispatch_retry(
    ctx: RunContext, attempt: AttemptRow, slot: SlotRow, *, spend_try: bool, delay_seconds: float = 0.0
) -> AttemptRow:
    """Dispatch `attempt`'s prompt again for `slot`, as a retry of the same origin.

    `spend_try` counts it against `rollout_failure.max_attempts_per_prompt`: only a failure
    that says something about the prompt should (an engine error does; a lost message or a
    group the ledger itself declined does not).
    """
    return dispatch(
        ctx,
        step=slot.step,
        slot=slot,
        prompt_id=attempt.prompt_id,
        reason=AttemptReason.RETRY,
        try_no=attempt.try_no + 1 if spend_try else attempt.try_no,
        delay_seconds=delay_seconds,
        origin=(attempt.origin_step, attempt.origin_slot),
    )


# --- settle ------------------------------------------------------------------------------


def fill(ctx: RunContext, slot: SlotRow, group: GroupRow, *, moved: bool) -> None:
    slot.status = _SLOT_COMMITTED
    slot.group_attempt_id = group.attempt_id
    # Set only where they change: a row's attribute set is a Python call that notes the old
    # value, and a step fills thousands of slots (most never waited, most groups never parked).
    if slot.needs_replacement:
        slot.needs_replacement = False
    slot.settled_at = ctx.now
    if group.parked:
        group.parked = False
    if moved:
        slot.borrowed_in += 1
        group.moves += 1
    ctx.waiting_removed(slot)
    ctx.lendable_added(GroupView(group.attempt_id, group.weight_version, slot.step, slot.idx))
    step = ctx.step(slot.step)
    step.committed += 1
    maybe_release(ctx, step)


def shrink(ctx: RunContext, slot: SlotRow, reason: ShrinkReason) -> None:
    slot.status = SlotStatus.SHRUNK.value
    slot.shrink_reason = reason.value
    slot.needs_replacement = False
    slot.settled_at = ctx.now
    ctx.waiting_removed(slot)
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
                    dropped_prompts=prompts_dropped_by_shrunk_slots(ctx, step.step),
                    min_step_batch_fraction=ctx.settings.min_step_batch_fraction,
                    recent_errors=recent_errors(ctx, step.step),
                ),
                "short_step",
            )
    maybe_release(ctx, step)


# --- replacement (SPEC §3.4) -------------------------------------------------------------


def replace(ctx: RunContext, slot: SlotRow, *, after_filter: bool) -> None:
    """Find `slot` a new group: borrow one, else dispatch a spare prompt, else shrink."""
    if after_filter:
        slot.filter_replacements += 1
    else:
        slot.drop_replacements += 1
    slot.needs_replacement = True
    view = SlotView(slot.step, slot.idx, True)
    offered = lender_candidates(ctx, slot.step)
    lender = ctx.sampler.lender(view, offered)
    # By identity first (what the built-in samplers answer), not a set built per replacement.
    if lender is not None and lender not in offered:
        _sampler_broke_contract(ctx, "lender", lender, None)
        lender = None
    spare_available = ctx.spare_count > 0 or not ctx.run.loader_exhausted
    source = decisions.replacement_source(lender is not None, spare_available)
    if source is decisions.Source.BORROW:
        assert lender is not None
        borrow(ctx, lender, slot)
        return
    reason = AttemptReason.FILTER_REPLACEMENT if after_filter else AttemptReason.DROP_REPLACEMENT
    if source is decisions.Source.SHRINK or not dispatch_spare(ctx, slot, reason):
        shrink(ctx, slot, ShrinkReason.END_OF_DATA)
        return
    ctx.waiting_added(slot)


def lender_candidates(ctx: RunContext, step: int, limit: int = LENDER_CHOICES) -> list[GroupView]:
    """Groups `step` may borrow: parked surplus and groups committed for later open steps,
    within the staleness bound of `step`."""
    floor = step - ctx.settings.max_lookahead_versions
    found: list[GroupView] = []
    seen: set[int] = set()
    parked, committed, added = ctx.lendable_parts()

    def take(views: list[GroupView], most: int | None = None) -> None:
        taken = 0
        for view in views:
            if most is not None and taken >= most:
                return
            if view.attempt_id in seen or view.weight_version < floor:
                continue
            if view.step is None:
                if view.weight_version > step:
                    continue
            elif view.step <= step:
                continue
            if not ctx.still_lendable(view):
                continue
            seen.add(view.attempt_id)
            found.append(view)
            taken += 1

    take(parked)
    take(added)
    # Already in the final order: past the first `limit` usable ones, none can make the cut.
    take(committed, limit)
    # Parked groups first, then the latest steps: the order the cache was built in, with the
    # groups committed during this transaction sorted in.
    found.sort(key=lambda v: (v.step is not None, -(v.step or 0), -v.attempt_id))
    return found[:limit]


def borrow(ctx: RunContext, lender: GroupView, slot: SlotRow) -> None:
    """Move a committed group into `slot`; the lender's slot gets the spare prompt instead."""
    group = ctx.group(lender.attempt_id)
    if group is None:
        raise LookupError(f"run {ctx.run.id}: lender group {lender.attempt_id} is not in the ledger")
    if lender.step is not None and lender.idx is not None:
        source = ctx.slot(lender.step, lender.idx)
        source.status = SlotStatus.OPEN.value
        source.group_attempt_id = None
        source.settled_at = None
        source.lent_out += 1
        ctx.step(lender.step).committed -= 1
        # Written before the borrower takes the group: the unique index on
        # slots.group_attempt_id is checked row by row.
        ctx.flush()
        fill(ctx, slot, group, moved=True)
        source.needs_replacement = True
        if not dispatch_spare(ctx, source, AttemptReason.RESPAWN):
            shrink(ctx, source, ShrinkReason.END_OF_DATA)
        else:
            ctx.waiting_added(source)
    else:
        fill(ctx, slot, group, moved=True)


# --- placement of a committed group ------------------------------------------------------


def placement_candidates(
    ctx: RunContext, group: GroupRow, own: SlotRow | None, limit: int = PLACEMENT_CHOICES
) -> list[SlotView]:
    """Open slots, earlier than the group's own, that it may fill within the staleness bound:
    slots waiting on a replacement for `in_order`, any open slot for the other samplers."""
    bound_step = group.weight_version + ctx.settings.max_lookahead_versions
    ceiling = own.step if own is not None else bound_step + 1
    max_step = min(ceiling - 1, bound_step)
    slots: dict[tuple[int, int], SlotRow] = {(slot.step, slot.idx): slot for slot in ctx.waiting_up_to(max_step, limit)}
    if ctx.settings.sampler_name != "in_order" or own is None:
        # An extra serves its step, not a slot: any open slot it may fill is a candidate.
        slots.update(((slot.step, slot.idx), slot) for slot in ctx.open_slots(max_step, limit))
    if not slots:
        return []  # most groups of the earliest open step: no earlier slot to offer
    open_steps = {step: ctx.step_open(step) for step in {step for step, _ in slots}}
    usable = [slot for slot in slots.values() if slot.status == _SLOT_OPEN and open_steps[slot.step]]
    usable.sort(key=lambda slot: (slot.step, not slot.needs_replacement, slot.idx))
    # Views of the first `limit` only: a frozen dataclass costs a microsecond to make, and a
    # batch places thousands of groups.
    return [SlotView(slot.step, slot.idx, bool(slot.needs_replacement)) for slot in usable[:limit]]


def reaim(ctx: RunContext, source: SlotRow, target: SlotRow) -> bool:
    """Hand `source`'s live attempt over to `target`, if it can still serve `target`.

    An attempt that has not started takes the target's staleness floor as its minimum weight
    version (the worker reads it from the ledger when it starts). A running one keeps the
    version it started with, so it may only move to a step that version can still train.
    """
    floor = max(0, target.step - ctx.settings.max_lookahead_versions)
    attempt = ctx.live_attempt(source)
    if attempt is None or (attempt.state == _RUNNING and attempt.min_weight_version < floor):
        return False
    attempt.step, attempt.slot_idx = target.step, target.idx
    attempt.min_weight_version = max(attempt.min_weight_version, floor)
    target.attempts += 1
    return True


def place(ctx: RunContext, group: GroupRow, own: SlotRow | None, candidates: Sequence[SlotView]) -> SlotRow | None:
    """Put a newly committed group where the sampler wants it among `candidates` (from
    `placement_candidates`; an extra's, `own` None, narrowed by `overdispatch.place_extra`);
    None when it is parked."""
    view = GroupView(group.attempt_id, group.weight_version, None, None)
    own_view = SlotView(own.step, own.idx, own.needs_replacement) if own is not None else None
    for _ in range(8):
        choice = ctx.sampler.place(view, own_view, candidates)
        if choice is not None and not _was_offered(choice, own, candidates):
            # Only the candidates are within the staleness bound and open: a custom sampler
            # that answers otherwise would train a group too stale, or fill a released step.
            _sampler_broke_contract(ctx, "place", choice, group.attempt_id)
            choice = None
        if choice is None:
            park(ctx, group)
            return None
        if own is not None and (choice.step, choice.idx) == (own.step, own.idx):
            fill(ctx, own, group, moved=False)
            return own
        target = ctx.slot(choice.step, choice.idx)
        if target.status != _SLOT_OPEN:
            candidates = [c for c in candidates if c != choice]
            continue
        if own is not None:
            if not reaim(ctx, target, own):
                candidates = [c for c in candidates if c != choice]
                continue
        else:
            # An extra fills a slot whose own attempt (if any) then becomes an extra of that step.
            release_to_extra(ctx, target)
        fill(ctx, target, group, moved=own is not None)
        return target
    if own is not None:
        fill(ctx, own, group, moved=False)
        return own
    park(ctx, group)
    return None


def _was_offered(choice: SlotView, own: SlotRow | None, candidates: Sequence[SlotView]) -> bool:
    if choice in candidates:  # what the built-in samplers answer: found by identity at once
        return True
    key = (choice.step, choice.idx)
    if own is not None and key == (own.step, own.idx):
        return True
    return any((c.step, c.idx) == key for c in candidates)


def _sampler_broke_contract(ctx: RunContext, method: str, answer: Any, attempt_id: int | None) -> None:
    """A sampler's `place` or `lender` answered with something it was not offered: taken as
    None (the group parks; the slot gets a spare prompt), and said, since only a custom sampler
    can do it and its author needs to know."""
    log.warning(
        "run %s: the sampler's %s answered %r%s, which was not among what it was offered; "
        "taken as None (async_rl.sampler: `place` must return one of `candidates` or `own`, "
        "`lender` one of its `candidates`)",
        ctx.run.id,
        method,
        answer,
        f" for attempt {attempt_id}" if attempt_id is not None else "",
    )


def park(ctx: RunContext, group: GroupRow) -> None:
    group.parked = True
    ctx.lendable_added(GroupView(group.attempt_id, group.weight_version, None, None))


def release_to_extra(ctx: RunContext, slot: SlotRow) -> None:
    """The live attempt of `slot`, which a group is about to fill, serves its step as an extra
    from now on (its result is placed like any extra's)."""
    ctx.hand_over(slot)


# --- failures (SPEC §3.2, §3.6) ----------------------------------------------------------


#: How much of a failure's error an attempt keeps: the row holds what a person reads first; a
#: worker's full traceback belongs in its log.
ERROR_CHARS = 4000


def _failed(ctx: RunContext, attempt: AttemptRow, kind: FailureKind, error: str) -> None:
    attempt.state = AttemptState.FAILED.value
    attempt.failure_kind = kind.value
    attempt.error = error[:ERROR_CHARS]
    attempt.finished_at = attempt.finished_at or ctx.now


def infra_failure(ctx: RunContext, attempt: AttemptRow, error: str) -> None:
    _failed(ctx, attempt, FailureKind.INFRA, error)
    slot = aimed_slot(ctx, attempt)
    if slot is None:
        return
    slot.infra_failures += 1
    settings = ctx.settings
    if decisions.should_retry(attempt.try_no, settings.max_attempts_per_prompt):
        dispatch_retry(
            ctx,
            attempt,
            slot,
            spend_try=True,
            delay_seconds=decisions.retry_backoff(
                attempt.try_no, settings.retry_backoff_seconds, settings.retry_backoff_max_seconds
            ),
        )
        return
    drop(ctx, slot, infra=True, last_error=error)


def lost_in_queue(ctx: RunContext, attempt: AttemptRow, error: str) -> None:
    """A dispatched attempt no worker ever took: its message was lost (a flushed or restarted
    broker). That says nothing about the prompt, so the prompt is sent again without spending
    its retries; a fleet with no worker at all keeps the run waiting rather than failing it."""
    _failed(ctx, attempt, FailureKind.INFRA, error)
    slot = aimed_slot(ctx, attempt)
    if slot is None:
        return  # an extra: over-dispatch sends another if the step still needs it
    dispatch_retry(ctx, attempt, slot, spend_try=False)


def data_failure(ctx: RunContext, attempt: AttemptRow, error: str) -> None:
    """The prompt's output is unusable; retrying the same prompt would fail the same way, so
    the prompt is dropped at once and the slot follows `on_dropped_prompt`."""
    _failed(ctx, attempt, FailureKind.DATA, error)
    slot = aimed_slot(ctx, attempt)
    if slot is None:
        return
    slot.data_failures += 1
    drop(ctx, slot, infra=False, last_error=error)


def drop(ctx: RunContext, slot: SlotRow, *, infra: bool, last_error: str | None) -> None:
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
    # The slot's stored budget, not the config's: a run's budgets are what its slots say.
    choice = decisions.after_drop(settings.on_dropped_prompt, slot.drop_replacements, slot.drop_budget)
    if choice is decisions.AfterDrop.REPLACE:
        replace(ctx, slot, after_filter=False)
    else:
        shrink(ctx, slot, ShrinkReason.DROPPED)


def aimed_slot(ctx: RunContext, attempt: AttemptRow) -> SlotRow | None:
    """The open slot an attempt serves; None for an extra (or a slot settled otherwise)."""
    if attempt.slot_idx is None:
        return None
    slot = ctx.slot(attempt.step, attempt.slot_idx)
    if slot.status != _SLOT_OPEN:
        return None
    return slot


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
    ctx.flush()
    values = {"state": AttemptState.CANCELLED.value, "error": why, "finished_at": ctx.now}
    live = sql.attempts_locked_by_id("live", _attempts.c.run_id == ctx.run.id, _attempts.c.state.in_(LIVE))
    cancelled = ctx.session.execute(
        update(_attempts)
        .where(_attempts.c.id == live.c.id)
        .values(**values)
        .returning(_attempts.c.id)
    ).scalars().all()
    for attempt_id in cancelled:
        ctx.rows.patched(AttemptRow, attempt_id, **values)
    return len(cancelled)


def prompts_dropped_by_shrunk_slots(ctx: RunContext, step: int) -> int:
    """The prompts dropped by the slots of `step` that were shrunk for dropping them: one slot
    may drop several (its own, then each replacement) before it is shrunk."""
    ctx.flush()
    total = ctx.session.scalar(
        select(func.coalesce(func.sum(Slot.drops), 0)).where(
            Slot.run_id == ctx.run.id,
            Slot.step == step,
            Slot.status == SlotStatus.SHRUNK.value,
            Slot.shrink_reason == ShrinkReason.DROPPED.value,
        )
    )
    return int(total or 0)


def recent_errors(ctx: RunContext, step: int, limit: int = 3) -> list[str]:
    ctx.flush()
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
