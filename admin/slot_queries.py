"""The questions of `refill slots` and `refill slot`: a step's slots, and every attempt that
touched one slot with where its group went.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.admin.snapshot import (
    LIVE_STATES,
    count_by,
    get_run,
    get_slot,
    get_step,
    seconds_between,
)
from refill.models.tables import (
    Attempt,
    AttemptState,
    Group,
    Prompt,
    RejectedResult,
    Slot,
    Step,
    StepStatus,
)


def slot_rows(
    session: Session, run_id: int, *, step: int | None = None, status: str | None = None
) -> list[dict[str, Any]]:
    """The slots of one step (or, with no step, of every step not yet trained): state, the
    group it holds, its live attempt, budgets and failures."""
    if step is not None:
        get_step(session, run_id, step)
    else:
        get_run(session, run_id)
    live = (
        select(
            Attempt.step.label("step"),
            Attempt.slot_idx.label("idx"),
            func.count().label("n"),
            func.min(Attempt.id).label("attempt_id"),
        )
        .where(Attempt.run_id == run_id, Attempt.state.in_(LIVE_STATES), Attempt.slot_idx.is_not(None))
        .group_by(Attempt.step, Attempt.slot_idx)
        .subquery()
    )
    query = (
        select(Slot, Group.weight_version, Group.reward_mean, live.c.n, live.c.attempt_id, Step.status)
        .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
        .outerjoin(Group, Group.attempt_id == Slot.group_attempt_id)
        .outerjoin(live, (live.c.step == Slot.step) & (live.c.idx == Slot.idx))
        .where(Slot.run_id == run_id)
        .order_by(Slot.step, Slot.idx)
    )
    if step is not None:
        query = query.where(Slot.step == step)
    else:
        query = query.where(Step.status != StepStatus.TRAINED.value)
    if status is not None:
        query = query.where(Slot.status == status)
    rows = session.execute(query).all()
    live_ids = [a for *_, a, _ in rows if a is not None]
    live_attempts = {
        a.id: a for a in session.scalars(select(Attempt).where(Attempt.id.in_(live_ids)))
    } if live_ids else {}
    out = []
    for slot, version, reward, n_live, live_id, step_status in rows:
        attempt = live_attempts.get(live_id) if live_id is not None else None
        out.append(
            {
                "step": slot.step,
                "slot": slot.idx,
                "status": slot.status,
                "step_status": step_status,
                "shrink_reason": slot.shrink_reason,
                "needs_replacement": slot.needs_replacement,
                "group_attempt_id": slot.group_attempt_id,
                "group_weight_version": version,
                "staleness": slot.step - version if version is not None else None,
                "group_reward": reward,
                "live_attempts": int(n_live or 0),
                "live_attempt_id": live_id,
                "live_state": attempt.state if attempt else None,
                "live_worker": attempt.worker if attempt else None,
                "live_started_at": attempt.started_at if attempt else None,
                "live_leased_until": attempt.leased_until if attempt else None,
                "attempts": slot.attempts,
                **_budget_counters(slot),
                "settled_at": slot.settled_at,
            }
        )
    return out


def _budget_counters(slot: Slot) -> dict[str, Any]:
    """A slot's counters and budgets, as `refill slots` and `refill slot` both show them."""
    return {
        "filtered": slot.filtered,
        "filter_replacements": slot.filter_replacements,
        "filter_budget": slot.filter_budget,
        "infra_failures": slot.infra_failures,
        "data_failures": slot.data_failures,
        "drops": slot.drops,
        "drop_replacements": slot.drop_replacements,
        "drop_budget": slot.drop_budget,
        "borrowed_in": slot.borrowed_in,
        "lent_out": slot.lent_out,
    }


def _relation(attempt: Attempt, step: int, idx: int, holder: int | None) -> str:
    """How an attempt touched slot (step, idx); the `slot_history` view's `relation`."""
    aimed = attempt.step == step and attempt.slot_idx == idx
    origin = attempt.origin_step == step and attempt.origin_slot == idx
    if aimed:
        return "own" if origin else "reaimed_in"
    if origin:
        return "reaimed_out"
    if attempt.id == holder:
        return "extra_in" if attempt.slot_idx is None else "borrowed_in"
    raise AssertionError("attempt does not touch the slot")


def slot_history(session: Session, run_id: int, step: int, idx: int) -> dict[str, Any]:
    """Every attempt that touched slot (step, idx): those aimed at it now, those dispatched
    for it and handed elsewhere, and the one whose group it holds. With each: its prompt,
    worker, weight version, rewards, outcome (where its group is now), latency and error."""
    slot = get_slot(session, run_id, step, idx)
    holder = slot.group_attempt_id
    condition = (
        ((Attempt.step == step) & (Attempt.slot_idx == idx))
        | ((Attempt.origin_step == step) & (Attempt.origin_slot == idx))
    )
    if holder is not None:
        condition = condition | (Attempt.id == holder)
    attempts = list(
        session.scalars(select(Attempt).where(Attempt.run_id == run_id, condition).order_by(Attempt.id))
    )
    ids = [a.id for a in attempts]
    prompts = {
        p.id: p
        for p in session.scalars(select(Prompt).where(Prompt.id.in_({a.prompt_id for a in attempts})))
    } if attempts else {}
    groups = {
        g.attempt_id: g for g in session.scalars(select(Group).where(Group.attempt_id.in_(ids)))
    } if ids else {}
    placed = {
        a: (s, i)
        for a, s, i in session.execute(
            select(Slot.group_attempt_id, Slot.step, Slot.idx).where(
                Slot.run_id == run_id, Slot.group_attempt_id.in_(ids)
            )
        ).all()
    } if ids else {}
    rejected = count_by(
        session, RejectedResult.attempt_id, RejectedResult.run_id == run_id, RejectedResult.attempt_id.in_(ids)
    ) if ids else {}
    rows = []
    for a in attempts:
        prompt = prompts.get(a.prompt_id)
        group = groups.get(a.id)
        rows.append(
            {
                "attempt_id": a.id,
                "relation": _relation(a, step, idx, holder),
                "holds_group": a.id == holder,
                "reason": a.reason,
                "try_no": a.try_no,
                "origin": [a.origin_step, a.origin_slot],
                "aimed": [a.step, a.slot_idx],
                "prompt_id": a.prompt_id,
                "prompt_position": prompt.position if prompt else None,
                "prompt": prompt.text if prompt else None,
                "worker": a.worker,
                "min_weight_version": a.min_weight_version,
                "weight_version": a.weight_version,
                "rewards": a.rewards,
                "reward_mean": a.reward_mean,
                "zero_variance": a.zero_variance,
                "state": a.state,
                "failure_kind": a.failure_kind,
                "outcome": _outcome(a, group, placed.get(a.id)),
                "group_slot": list(placed[a.id]) if a.id in placed else None,
                "trained_step": group.trained_step if group else None,
                "generation_seconds": a.generation_seconds,
                "queue_seconds": seconds_between(a.dispatched_at, a.started_at),
                "latency_seconds": seconds_between(a.created_at, a.finished_at),
                "created_at": a.created_at,
                "started_at": a.started_at,
                "finished_at": a.finished_at,
                "leased_until": a.leased_until,
                "error": a.error,
                "rejected_results": rejected.get(str(a.id), 0),
            }
        )
    source = None
    if holder is not None:
        owner = next((a for a in attempts if a.id == holder), None)
        group = groups.get(holder)
        if owner is not None and not (owner.step == step and owner.slot_idx == idx):
            if owner.slot_idx is None:
                source = f"an over-dispatched extra of step {owner.step}"
            else:
                source = f"slot ({owner.step}, {owner.slot_idx})"
            if (owner.origin_step, owner.origin_slot) != (owner.step, owner.slot_idx) and owner.origin_slot is not None:
                source += f", dispatched for slot ({owner.origin_step}, {owner.origin_slot})"
            if group is not None:
                source += f", generated with weights v{group.weight_version}"
    prompt = session.get(Prompt, slot.prompt_id) if slot.prompt_id is not None else None
    return {
        "run_id": run_id,
        "step": step,
        "slot": idx,
        "status": slot.status,
        "shrink_reason": slot.shrink_reason,
        "needs_replacement": slot.needs_replacement,
        "prompt_id": slot.prompt_id,
        "prompt": prompt.text if prompt else None,
        "group_attempt_id": holder,
        "group_weight_version": groups[holder].weight_version if holder in groups else None,
        "group_source": source,
        "borrowed": source is not None,
        **_budget_counters(slot),
        "dispatched": slot.attempts,
        "settled_at": slot.settled_at,
        "attempts": rows,
    }


def _outcome(attempt: Attempt, group: Group | None, placed: tuple[int, int] | None) -> str:
    if attempt.state == AttemptState.FAILED.value:
        return f"failed ({attempt.failure_kind})"
    if attempt.state != AttemptState.COMMITTED.value:
        return attempt.state
    if placed is not None:
        where = f"slot ({placed[0]}, {placed[1]})"
        if group is not None and group.trained_step is not None:
            return f"committed, trained in {where}"
        return f"committed, in {where}"
    if group is not None and group.parked:
        return "committed, parked"
    return "committed, in no slot"
