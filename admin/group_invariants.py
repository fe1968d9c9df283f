"""The invariants of committed groups: no slot committed twice, no zero-variance group trained
under dynamic sampling, the staleness bound, and each group in exactly one place.

What "a slot committed twice" can look like in this schema, and what catches it:
- one group in two slots (`slots.group_attempt_id` appears twice);
- a group trained in two steps: a slot of trained step t holds a group whose `trained_step`
  says another step, or a group marked trained in step t sits in no slot of step t (its slot
  was committed again after training: two groups trained for one slot over time);
- a committed slot whose group is not a committed attempt's group.
"""

from __future__ import annotations

from sqlalchemy import and_, func, select

from refill.admin.invariant_types import LIVE, Context, Violation
from refill.models import decisions
from refill.models.tables import (
    Attempt,
    AttemptState,
    Group,
    Slot,
    SlotStatus,
    Step,
    StepStatus,
    WeightVersion,
)

# --- no slot committed twice ---------------------------------------------------------------


def check_committed_once(ctx: Context) -> list[Violation]:
    s, run_id, out = ctx.session, ctx.run.id, []
    name = "slot_committed_twice"
    holders: dict[int, list[tuple[int, int]]] = {}
    for group_id, step, idx in s.execute(
        select(Slot.group_attempt_id, Slot.step, Slot.idx)
        .where(Slot.run_id == run_id, Slot.group_attempt_id.is_not(None))
        .order_by(Slot.step, Slot.idx)
    ).all():
        holders.setdefault(group_id, []).append((step, idx))
    for group_id, places in holders.items():
        if len(places) > 1:
            listed = ", ".join(f"({a}, {b})" for a, b in places)
            for step, idx in places:
                out.append(
                    ctx.violation(
                        name,
                        f"group {group_id} sits in {len(places)} slots: {listed}",
                        step=step,
                        slot=idx,
                        attempt=group_id,
                    )
                )
    # A committed slot holds a committed attempt's group.
    for step, idx, group_id, group_row, state in s.execute(
        select(Slot.step, Slot.idx, Slot.group_attempt_id, Group.attempt_id, Attempt.state)
        .outerjoin(Group, Group.attempt_id == Slot.group_attempt_id)
        .outerjoin(Attempt, Attempt.id == Slot.group_attempt_id)
        .where(Slot.run_id == run_id, Slot.status == SlotStatus.COMMITTED.value)
        .order_by(Slot.step, Slot.idx)
    ).all():
        if group_id is None:
            out.append(ctx.violation(name, "committed slot holds no group", step=step, slot=idx))
        elif group_row is None or state != AttemptState.COMMITTED.value:
            what = "has no group row" if group_row is None else f"is {state}, not committed"
            out.append(
                ctx.violation(
                    name, f"slot holds attempt {group_id}, which {what}", step=step, slot=idx, attempt=group_id
                )
            )
    # Trained groups: each exactly once, in a slot of the step that trained it.
    trained_steps = set(
        s.scalars(select(Step.step).where(Step.run_id == run_id, Step.status == StepStatus.TRAINED.value))
    )
    for step, idx, group_id, marked in s.execute(
        select(Slot.step, Slot.idx, Group.attempt_id, Group.trained_step)
        .join(Group, Group.attempt_id == Slot.group_attempt_id)
        .join(Step, and_(Step.run_id == Slot.run_id, Step.step == Slot.step))
        .where(Slot.run_id == run_id, Step.status == StepStatus.TRAINED.value)
        .order_by(Slot.step, Slot.idx)
    ).all():
        if marked != step:
            out.append(
                ctx.violation(
                    name,
                    f"slot of trained step {step} holds group {group_id}, which is marked trained in "
                    f"step {marked}: a group trained in two steps",
                    step=step,
                    slot=idx,
                    attempt=group_id,
                )
            )
    for group_id, marked, step, idx in s.execute(
        select(Group.attempt_id, Group.trained_step, Slot.step, Slot.idx)
        .outerjoin(Slot, Slot.group_attempt_id == Group.attempt_id)
        .where(Group.run_id == run_id, Group.trained_step.is_not(None))
        .order_by(Group.attempt_id)
    ).all():
        if step == marked:
            continue
        if marked not in trained_steps:
            message = f"group {group_id} is marked trained in step {marked}, which is not trained"
        elif step is None:
            message = (
                f"group {group_id} was trained in step {marked} but sits in no slot: its slot was "
                f"committed again after training"
            )
        else:
            message = f"group {group_id} was trained in step {marked} but sits in slot ({step}, {idx})"
        out.append(ctx.violation(name, message, step=marked, slot=idx if step == marked else None, attempt=group_id))
    return out


# --- no zero-variance group trained under dynamic sampling ---------------------------------


def check_zero_variance(ctx: Context) -> list[Violation]:
    s, run_id, settings, out = ctx.session, ctx.run.id, ctx.settings, []
    name = "zero_variance_trained"
    tolerance = settings.zero_variance_tolerance
    if settings.use_dynamic_sampling:
        for group_id, flagged, rewards, step, idx, trained in s.execute(
            select(Group.attempt_id, Group.zero_variance, Group.rewards, Slot.step, Slot.idx, Group.trained_step)
            .outerjoin(Slot, Slot.group_attempt_id == Group.attempt_id)
            .where(Group.run_id == run_id, (Slot.idx.is_not(None)) | (Group.trained_step.is_not(None)))
            .order_by(Group.attempt_id)
        ).all():
            flat = bool(rewards) and decisions.is_zero_variance([float(r) for r in rewards], tolerance)
            if not (flagged or flat):
                continue
            why = f"its rewards are all {float(rewards[0]):g}" if flat else "it is flagged zero-variance"
            where = f"trained in step {trained}" if trained is not None else "committed"
            out.append(
                ctx.violation(
                    name,
                    f"group {group_id} is {where} although {why} and grpo.use_dynamic_sampling is on",
                    step=step if step is not None else trained,
                    slot=idx,
                    attempt=group_id,
                )
            )
    # The filter fired only on zero-variance groups (a filtered group with spread lost signal).
    for attempt_id, step, idx, flagged, rewards in s.execute(
        select(Attempt.id, Attempt.step, Attempt.slot_idx, Attempt.zero_variance, Attempt.rewards)
        .where(Attempt.run_id == run_id, Attempt.state == AttemptState.FILTERED.value)
        .order_by(Attempt.id)
    ).all():
        flat = bool(rewards) and decisions.is_zero_variance([float(r) for r in rewards], tolerance)
        if not flagged or (rewards and not flat):
            out.append(
                ctx.violation(
                    name,
                    f"attempt was filtered, but its rewards {rewards} have spread above {tolerance:g}",
                    step=step,
                    slot=idx,
                    attempt=attempt_id,
                )
            )
    return out


# --- staleness bound held ------------------------------------------------------------------


def check_staleness(ctx: Context) -> list[Violation]:
    s, run_id, out = ctx.session, ctx.run.id, []
    name = "staleness_bound"
    bound = ctx.run.max_lookahead_versions
    for group_id, version, step, idx, trained in s.execute(
        select(Group.attempt_id, Group.weight_version, Slot.step, Slot.idx, Group.trained_step)
        .outerjoin(Slot, Slot.group_attempt_id == Group.attempt_id)
        .where(Group.run_id == run_id, (Slot.idx.is_not(None)) | (Group.trained_step.is_not(None)))
        .order_by(Group.attempt_id)
    ).all():
        for target, where in ((step, "sits in"), (trained, "was trained in")):
            if target is None:
                continue
            staleness = decisions.staleness(target, version)
            if staleness > bound:
                out.append(
                    ctx.violation(
                        name,
                        f"group {group_id} of weights v{version} {where} step {target}: staleness "
                        f"{staleness}, past max_lookahead_versions={bound}",
                        step=target,
                        slot=idx if target == step else None,
                        attempt=group_id,
                    )
                )
            elif staleness < 0:
                out.append(
                    ctx.violation(
                        name,
                        f"group {group_id} of weights v{version} {where} step {target}, whose "
                        f"weights are older than the group's",
                        step=target,
                        slot=idx if target == step else None,
                        attempt=group_id,
                    )
                )
            if target == step and trained == step:
                break
    for attempt_id, step, idx, floor in s.execute(
        select(Attempt.id, Attempt.step, Attempt.slot_idx, Attempt.min_weight_version)
        .where(Attempt.run_id == run_id, Attempt.state.in_(LIVE))
        .order_by(Attempt.id)
    ).all():
        if floor < step - bound:
            out.append(
                ctx.violation(
                    name,
                    f"live attempt may generate with v{floor}, below v{step - bound}, the oldest "
                    f"weights step {step} can train on",
                    step=step,
                    slot=idx,
                    attempt=attempt_id,
                )
            )
    for step, admitted_at, published in s.execute(
        select(Step.step, Step.admitted_at, WeightVersion.created_at)
        .outerjoin(
            WeightVersion,
            and_(WeightVersion.run_id == Step.run_id, WeightVersion.version == Step.step - bound),
        )
        .where(Step.run_id == run_id, Step.step >= bound)
        .order_by(Step.step)
    ).all():
        if published is None or published > admitted_at:
            out.append(
                ctx.violation(
                    name,
                    f"step was admitted before weight version {step - bound} existed",
                    step=step,
                )
            )
    return out


# --- ledger consistency --------------------------------------------------------------------


def check_group_placement(ctx: Context) -> list[Violation]:
    """A committed group is in exactly one place (a slot, or parked); groups belong to
    committed attempts and committed attempts have groups; only committed slots hold groups."""
    s, run_id, out = ctx.session, ctx.run.id, []
    placed = (
        select(Slot.group_attempt_id.label("g"), func.count().label("n"))
        .where(Slot.run_id == run_id, Slot.group_attempt_id.is_not(None))
        .group_by(Slot.group_attempt_id)
        .subquery()
    )
    for group_id, parked, n, step, idx in s.execute(
        select(Group.attempt_id, Group.parked, func.coalesce(placed.c.n, 0), Attempt.step, Attempt.slot_idx)
        .outerjoin(placed, placed.c.g == Group.attempt_id)
        .join(Attempt, Attempt.id == Group.attempt_id)
        .where(Group.run_id == run_id)
        .order_by(Group.attempt_id)
    ).all():
        if bool(parked) == bool(n):
            state = "parked" if parked else "not parked"
            out.append(
                ctx.violation(
                    "group_placement",
                    f"group is {state} and sits in {n} slots (a group is in one slot, or parked)",
                    step=step,
                    slot=idx,
                    attempt=group_id,
                )
            )
    for attempt_id, step, idx, state in s.execute(
        select(Attempt.id, Attempt.step, Attempt.slot_idx, Attempt.state)
        .outerjoin(Group, Group.attempt_id == Attempt.id)
        .where(
            Attempt.run_id == run_id,
            (Attempt.state == AttemptState.COMMITTED.value) != Group.attempt_id.is_not(None),
        )
        .order_by(Attempt.id)
    ).all():
        what = "is committed but has no group" if state == AttemptState.COMMITTED.value else f"is {state} but has a group"
        out.append(ctx.violation("group_placement", f"attempt {what}", step=step, slot=idx, attempt=attempt_id))
    # Only a committed slot holds a group (an open or shrunk slot that does hides it from training).
    for step, idx, status, group_id in s.execute(
        select(Slot.step, Slot.idx, Slot.status, Slot.group_attempt_id)
        .where(
            Slot.run_id == run_id,
            Slot.status != SlotStatus.COMMITTED.value,
            Slot.group_attempt_id.is_not(None),
        )
        .order_by(Slot.step, Slot.idx)
    ).all():
        out.append(
            ctx.violation(
                "group_placement",
                f"{status} slot holds group {group_id} (only a committed slot holds a group)",
                step=step,
                slot=idx,
                attempt=group_id,
            )
        )
    return out
