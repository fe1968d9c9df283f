"""The invariants of slots and steps: budgets never exceeded, each released step full, one live
attempt per open slot, and the step and run counters agreeing with the rows they count.
"""

from __future__ import annotations

from sqlalchemy import and_, func, select

from refill.admin.invariant_types import LIVE, Context, Violation
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    RunStatus,
    ShrinkReason,
    Slot,
    SlotStatus,
    SparePrompt,
    Step,
    StepStatus,
)

# --- budgets never exceeded ---------------------------------------------------------------


def check_budgets(ctx: Context) -> list[Violation]:
    s, run_id, settings, out = ctx.session, ctx.run.id, ctx.settings, []
    name = "budget_exceeded"
    dispatched: dict[tuple[int, int, str], int] = {
        (step, idx, reason): int(n)
        for step, idx, reason, n in s.execute(
            select(Attempt.origin_step, Attempt.origin_slot, Attempt.reason, func.count())
            .where(
                Attempt.run_id == run_id,
                Attempt.origin_slot.is_not(None),
                Attempt.reason.in_(
                    [AttemptReason.FILTER_REPLACEMENT.value, AttemptReason.DROP_REPLACEMENT.value]
                ),
            )
            .group_by(Attempt.origin_step, Attempt.origin_slot, Attempt.reason)
        ).all()
    }
    filtered_here = {
        (step, idx): int(n)
        for step, idx, n in s.execute(
            select(Attempt.step, Attempt.slot_idx, func.count())
            .where(
                Attempt.run_id == run_id,
                Attempt.state == AttemptState.FILTERED.value,
                Attempt.slot_idx.is_not(None),
            )
            .group_by(Attempt.step, Attempt.slot_idx)
        ).all()
    }
    exhausted = ctx.run.status == RunStatus.FAILED.value and ctx.run.end_reason == "budget_exhausted"
    for slot in s.scalars(select(Slot).where(Slot.run_id == run_id).order_by(Slot.step, Slot.idx)):
        def flag(message: str, slot: Slot = slot) -> None:
            out.append(ctx.violation(name, message, step=slot.step, slot=slot.idx))

        fr, fb, dr, db = slot.filter_replacements, slot.filter_budget, slot.drop_replacements, slot.drop_budget
        if fr > fb:
            flag(f"{fr} filter replacements, past the dynamic-sampling budget of {fb}")
        if dr > db:
            flag(f"{dr} drop replacements, past the fault-tolerance budget of {db}")
        if fb != settings.filter_budget:
            flag(
                f"filter budget is {fb}, but the run's config says "
                f"dynamic_sampling_max_replacements_per_slot={settings.filter_budget}"
            )
        if db != settings.drop_budget:
            flag(f"drop budget is {db}, but the run's config allows {settings.drop_budget}")
        if slot.filtered > fb and not exhausted:
            flag(
                f"filtered {slot.filtered} times, past its budget of {fb}, but the run is "
                f"{ctx.run.status} rather than failed with budget_exhausted"
            )
        sent_f = dispatched.get((slot.step, slot.idx, AttemptReason.FILTER_REPLACEMENT.value), 0)
        sent_d = dispatched.get((slot.step, slot.idx, AttemptReason.DROP_REPLACEMENT.value), 0)
        if sent_f > fr:
            flag(f"{sent_f} filter-replacement attempts were dispatched, but it counts {fr} replacements")
        if sent_f > fb:
            flag(f"{sent_f} filter-replacement attempts were dispatched, past its budget of {fb}")
        if sent_d > dr:
            flag(f"{sent_d} drop-replacement attempts were dispatched, but it counts {dr} replacements")
        if sent_d > db:
            flag(f"{sent_d} drop-replacement attempts were dispatched, past its budget of {db}")
        if fr > slot.filtered:
            flag(f"{fr} filter replacements for {slot.filtered} filtered groups")
        if dr > slot.drops:
            flag(f"{dr} drop replacements for {slot.drops} dropped prompts")
        seen = filtered_here.get((slot.step, slot.idx), 0)
        if seen != slot.filtered:
            flag(f"counts {slot.filtered} filtered groups, but {seen} filtered attempts served it")
    # The run's budget of consecutive dropped prompts: the drop past it fails the run.
    limit, drops = settings.max_consecutive_dropped_prompts, ctx.run.consecutive_dropped
    fleet_failed = ctx.run.status == RunStatus.FAILED.value and ctx.run.end_reason == "fleet_failed"
    if drops > limit and not fleet_failed:
        out.append(
            ctx.violation(
                name,
                f"{drops} consecutive dropped prompts, past rollout_failure.max_consecutive_dropped_prompts="
                f"{limit}, but the run is {ctx.run.status} rather than failed with fleet_failed",
            )
        )
    return out


# --- each released step full ---------------------------------------------------------------


def check_released_full(ctx: Context) -> list[Violation]:
    s, run_id, out = ctx.session, ctx.run.id, []
    name = "released_step_not_full"
    counts = {
        step: (int(c), int(sh), int(o))
        for step, c, sh, o in s.execute(
            select(
                Slot.step,
                func.count().filter(Slot.status == SlotStatus.COMMITTED.value),
                func.count().filter(Slot.status == SlotStatus.SHRUNK.value),
                func.count().filter(Slot.status == SlotStatus.OPEN.value),
            )
            .where(Slot.run_id == run_id)
            .group_by(Slot.step)
        ).all()
    }
    for step in s.scalars(
        select(Step).where(Step.run_id == run_id, Step.status != StepStatus.OPEN.value).order_by(Step.step)
    ):
        target = step.num_slots - step.shrunk
        committed, shrunk, open_ = counts.get(step.step, (0, 0, 0))
        if step.committed != target:
            out.append(
                ctx.violation(
                    name, f"{step.status} step counts {step.committed} committed groups of {target}", step=step.step
                )
            )
        if committed != target or shrunk != step.shrunk:
            out.append(
                ctx.violation(
                    name,
                    f"{step.status} step needs {target} committed slots ({step.num_slots} less "
                    f"{step.shrunk} shrunk); its slots hold {committed} committed, {shrunk} shrunk, {open_} open",
                    step=step.step,
                )
            )
    for step, idx, status in s.execute(
        select(Slot.step, Slot.idx, Step.status)
        .join(Step, and_(Step.run_id == Slot.run_id, Step.step == Slot.step))
        .where(Slot.run_id == run_id, Step.status != StepStatus.OPEN.value, Slot.status == SlotStatus.OPEN.value)
        .order_by(Slot.step, Slot.idx)
    ).all():
        out.append(ctx.violation(name, f"slot is open in a {status} step", step=step, slot=idx))
    return out


# --- ledger consistency --------------------------------------------------------------------


def check_live_attempts(ctx: Context) -> list[Violation]:
    s, run, out = ctx.session, ctx.run, []
    name = "live_attempts"
    running = run.status == RunStatus.RUNNING.value
    live: dict[tuple[int, int], list[int]] = {}
    for attempt_id, step, idx in s.execute(
        select(Attempt.id, Attempt.step, Attempt.slot_idx)
        .where(Attempt.run_id == run.id, Attempt.state.in_(LIVE), Attempt.slot_idx.is_not(None))
        .order_by(Attempt.id)
    ).all():
        live.setdefault((step, idx), []).append(attempt_id)
    for step, idx, slot_status, step_status in s.execute(
        select(Slot.step, Slot.idx, Slot.status, Step.status)
        .join(Step, and_(Step.run_id == Slot.run_id, Step.step == Slot.step))
        .where(Slot.run_id == run.id)
        .order_by(Slot.step, Slot.idx)
    ).all():
        ids = live.get((step, idx), [])
        if slot_status == SlotStatus.OPEN.value and step_status == StepStatus.OPEN.value and running:
            if len(ids) != 1:
                out.append(
                    ctx.violation(
                        name,
                        f"open slot has {len(ids)} live attempts {ids}, not exactly 1"
                        + (" (nothing will ever fill it)" if not ids else ""),
                        step=step,
                        slot=idx,
                        attempt=ids[1] if len(ids) > 1 else None,
                    )
                )
        elif ids:
            for attempt_id in ids:
                out.append(
                    ctx.violation(
                        name,
                        f"{slot_status} slot has a live attempt (its step is {step_status}, the run {run.status})",
                        step=step,
                        slot=idx,
                        attempt=attempt_id,
                    )
                )
    # A live extra of a running run is fine wherever it points: one that outlives its step
    # is placed in a later step or parked when it finishes. A run that ended has none.
    if not running:
        extras = select(Attempt.id, Attempt.step).where(
            Attempt.run_id == run.id, Attempt.state.in_(LIVE), Attempt.slot_idx.is_(None)
        )
        for attempt_id, step in s.execute(extras.order_by(Attempt.id)).all():
            out.append(
                ctx.violation(
                    name,
                    f"live extra attempt of a {run.status} run",
                    step=step,
                    attempt=attempt_id,
                )
            )
    return out


def check_counters(ctx: Context) -> list[Violation]:
    s, run_id, out = ctx.session, ctx.run.id, []
    name = "step_counters"
    for step, num_slots, committed, shrunk, dropped, n, c, sh, d in s.execute(
        select(
            Step.step,
            Step.num_slots,
            Step.committed,
            Step.shrunk,
            Step.dropped_shrunk,
            func.count(Slot.idx),
            func.count().filter(Slot.status == SlotStatus.COMMITTED.value),
            func.count().filter(Slot.status == SlotStatus.SHRUNK.value),
            func.count().filter(Slot.shrink_reason == ShrinkReason.DROPPED.value),
        )
        .outerjoin(Slot, and_(Slot.run_id == Step.run_id, Slot.step == Step.step))
        .where(Step.run_id == run_id)
        .group_by(Step.step, Step.num_slots, Step.committed, Step.shrunk, Step.dropped_shrunk)
        .order_by(Step.step)
    ).all():
        if (num_slots, committed, shrunk, dropped) != (n, c, sh, d):
            out.append(
                ctx.violation(
                    name,
                    f"step says {num_slots} slots / {committed} committed / {shrunk} shrunk / "
                    f"{dropped} dropped; its slots say {n} / {c} / {sh} / {d}",
                    step=step,
                )
            )
    zero, scored = s.execute(
        select(func.count().filter(Attempt.zero_variance.is_(True)), func.count()).where(
            Attempt.run_id == run_id, Attempt.zero_variance.is_not(None)
        )
    ).one()
    if (ctx.run.zero_variance_groups, ctx.run.scored_groups) != (zero, scored):
        out.append(
            ctx.violation(
                name,
                f"run counts {ctx.run.zero_variance_groups} zero-variance groups of "
                f"{ctx.run.scored_groups} scored; its attempts say {zero} of {scored}",
            )
        )
    spares = s.scalar(
        select(func.count()).where(SparePrompt.run_id == run_id, SparePrompt.taken_at.is_(None))
    )
    if ctx.run.spare_prompts_available != spares:
        out.append(
            ctx.violation(
                name,
                f"run counts {ctx.run.spare_prompts_available} spare prompts available; "
                f"the pool holds {spares} untaken",
            )
        )
    return out
