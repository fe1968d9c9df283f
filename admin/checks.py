"""The ledger's invariants (SPEC §8), as SQL-backed checks over one run's rows.

`refill check RUN` runs them all. Each check returns `Violation`s that name where the ledger
is wrong (run, step, slot, attempt) and how; an empty list means the invariant holds. They read
the tables only, never a process's memory, so they prove what the ledger says happened.

Several invariants are also CHECK constraints or unique indexes of the schema
(`models/tables.py`); the checks do not trust them: a ledger restored from a dump, a
constraint dropped by hand, or a bug in a migration must still be caught, and where a
constraint covers a counter the checks also compare the counter with the rows it counts.

What "a slot committed twice" can look like in this schema, and what catches it:
- one group in two slots (`slots.group_attempt_id` appears twice);
- a group trained in two steps: a slot of trained step t holds a group whose `trained_step`
  says another step, or a group marked trained in step t sits in no slot of step t (its slot
  was committed again after training: two groups trained for one slot over time);
- a committed slot whose group is not a committed attempt's group.

Run them on one snapshot (`refill.models.queries.read_snapshot`: REPEATABLE READ on PostgreSQL),
so that a check of a running run sees one consistent state of the ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from refill.models import decisions
from refill.models.settings import LedgerSettings
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    Group,
    Outbox,
    OutboxKind,
    Run,
    RunStatus,
    ShrinkReason,
    Slot,
    SlotStatus,
    SparePrompt,
    Step,
    StepMetrics,
    StepStatus,
    WeightVersion,
)

LIVE = tuple(s.value for s in AttemptState.live())


@dataclass(frozen=True)
class Violation:
    """One broken invariant, located as precisely as the ledger allows."""

    check: str
    message: str
    run_id: int
    step: int | None = None
    slot: int | None = None
    attempt: int | None = None

    @property
    def where(self) -> str:
        parts = [f"run {self.run_id}"]
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.slot is not None:
            parts.append(f"slot {self.slot}")
        if self.attempt is not None:
            parts.append(f"attempt {self.attempt}")
        return ", ".join(parts)

    def __str__(self) -> str:
        return f"{self.check}: {self.where}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    session: Session
    run: Run
    settings: LedgerSettings

    def violation(self, check: str, message: str, **where: int | None) -> Violation:
        return Violation(check, message, self.run.id, **where)


CheckFn = Callable[[Context], list[Violation]]


@dataclass(frozen=True)
class Check:
    name: str
    description: str
    fn: CheckFn


@dataclass
class CheckResult:
    name: str
    description: str
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class Report:
    run_id: int
    results: list[CheckResult]

    @property
    def violations(self) -> list[Violation]:
        return [v for r in self.results for v in r.violations]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "ok": self.ok,
            "violations": len(self.violations),
            "checks": [
                {
                    "name": r.name,
                    "description": r.description,
                    "ok": r.ok,
                    "violations": [v.as_dict() for v in r.violations],
                }
                for r in self.results
            ],
        }


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


# --- weight versions -----------------------------------------------------------------------


def check_weight_versions(ctx: Context) -> list[Violation]:
    s, run, out = ctx.session, ctx.run, []
    name = "weight_versions"
    versions = s.execute(
        select(WeightVersion.version, WeightVersion.trained_step)
        .where(WeightVersion.run_id == run.id)
        .order_by(WeightVersion.version)
    ).all()
    numbers = [v for v, _ in versions]
    if numbers != list(range(run.weight_version + 1)):
        missing = sorted(set(range(run.weight_version + 1)) - set(numbers))
        extra = sorted(set(numbers) - set(range(run.weight_version + 1)))
        out.append(
            ctx.violation(
                name,
                f"run is at v{run.weight_version}; versions must be 0..{run.weight_version} without gaps "
                f"(missing {missing}, beyond the run's version {extra})",
            )
        )
    for version, trained_step in versions:
        expected = None if version == 0 else version - 1
        if trained_step != expected:
            out.append(
                ctx.violation(
                    name,
                    f"v{version} says it was trained from step {trained_step}, not {expected}",
                    step=trained_step,
                )
            )
    trained = list(
        s.scalars(
            select(Step.step)
            .where(Step.run_id == run.id, Step.status == StepStatus.TRAINED.value)
            .order_by(Step.step)
        )
    )
    for step in sorted(set(trained) ^ set(range(run.weight_version))):
        if step in trained:
            message = f"step is trained, but the run is at v{run.weight_version} (no version v{step + 1} for it)"
        else:
            message = f"v{step + 1} exists, but step {step} is not trained"
        out.append(ctx.violation(name, message, step=step))
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


def check_messages(ctx: Context) -> list[Violation]:
    """A pending attempt has an unsent generate message (else nothing will ever run it and its
    slot is stuck); a released step has its metrics; while the run runs, a step due for
    training had a train_step message."""
    s, run, out = ctx.session, ctx.run, []
    name = "outbox"
    unsent = select(Outbox.attempt_id).where(
        Outbox.run_id == run.id, Outbox.kind == OutboxKind.GENERATE.value, Outbox.sent_at.is_(None)
    )
    for attempt_id, step, idx in s.execute(
        select(Attempt.id, Attempt.step, Attempt.slot_idx)
        .where(Attempt.run_id == run.id, Attempt.state == AttemptState.PENDING.value, ~Attempt.id.in_(unsent))
        .order_by(Attempt.id)
    ).all():
        out.append(
            ctx.violation(
                name,
                "pending attempt has no unsent generate message: nothing will ever send it",
                step=step,
                slot=idx,
                attempt=attempt_id,
            )
        )
    for step in s.scalars(
        select(Step.step)
        .outerjoin(StepMetrics, and_(StepMetrics.run_id == Step.run_id, StepMetrics.step == Step.step))
        .where(Step.run_id == run.id, Step.status != StepStatus.OPEN.value, StepMetrics.step.is_(None))
        .order_by(Step.step)
    ):
        out.append(ctx.violation(name, "released step has no metrics row", step=step))
    if run.status == RunStatus.RUNNING.value:
        queued = set(
            s.scalars(
                select(Outbox.step).where(Outbox.run_id == run.id, Outbox.kind == OutboxKind.TRAIN_STEP.value)
            )
        )
        for step, status in s.execute(
            select(Step.step, Step.status)
            .where(Step.run_id == run.id, Step.status != StepStatus.OPEN.value)
            .order_by(Step.step)
        ).all():
            due = status in (StepStatus.TRAINING.value, StepStatus.TRAINED.value) or step == run.weight_version
            if due and step not in queued:
                out.append(ctx.violation(name, f"{status} step never had a train_step message", step=step))
    return out


def check_spare_pool(ctx: Context) -> list[Violation]:
    """A taken spare prompt names the attempt that took it, and that attempt runs its prompt."""
    out = []
    for spare_id, prompt_id, attempt_id, attempt_prompt, step, idx in ctx.session.execute(
        select(
            SparePrompt.id,
            SparePrompt.prompt_id,
            SparePrompt.taken_by_attempt,
            Attempt.prompt_id,
            Attempt.step,
            Attempt.slot_idx,
        )
        .outerjoin(Attempt, Attempt.id == SparePrompt.taken_by_attempt)
        .where(SparePrompt.run_id == ctx.run.id, SparePrompt.taken_at.is_not(None))
        .order_by(SparePrompt.id)
    ).all():
        if attempt_prompt != prompt_id:
            taker = f"attempt {attempt_id} on prompt {attempt_prompt}" if attempt_prompt is not None else "no attempt"
            out.append(
                ctx.violation(
                    "spare_pool",
                    f"spare {spare_id} (prompt {prompt_id}) was taken by {taker}",
                    step=step,
                    slot=idx,
                    attempt=attempt_id,
                )
            )
    return out


CHECKS: tuple[Check, ...] = (
    Check("slot_committed_twice", "no slot committed twice: a group in one slot, trained in one step", check_committed_once),
    Check("budget_exceeded", "per-slot filter and drop budgets and the run's consecutive-drop limit never exceeded; counts agree with attempts", check_budgets),
    Check("zero_variance_trained", "no zero-variance group trained under dynamic sampling; the filter fired only on zero-variance groups", check_zero_variance),
    Check("staleness_bound", "step - weight version <= max_lookahead_versions for every group and admission", check_staleness),
    Check("released_step_not_full", "each released step full: committed == num_slots - shrunk, no open slot", check_released_full),
    Check("weight_versions", "weight versions 0..v contiguous, one per trained step", check_weight_versions),
    Check("live_attempts", "an open slot of an open step has exactly one live attempt; settled slots none", check_live_attempts),
    Check("step_counters", "step counters (committed, shrunk, dropped) agree with their slots; the run's scored and zero-variance group counts with its attempts, its spare-pool count with the pool", check_counters),
    Check("group_placement", "each committed group in one slot or parked, and only in a committed slot; groups belong to committed attempts", check_group_placement),
    Check("outbox", "pending attempts have an unsent message; released steps have metrics and a train_step message", check_messages),
    Check("spare_pool", "a taken spare prompt is run by the attempt that took it", check_spare_pool),
)


def run_checks(session: Session, run_id: int, only: list[str] | None = None) -> Report:
    """Every check of `CHECKS` (or those named in `only`) over run `run_id`; raises
    LookupError for an unknown run. Give it a session on one snapshot
    (`refill.models.queries.read_snapshot`) to check a running run."""
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    ctx = Context(session, run, LedgerSettings.from_config(run.config))
    results = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        results.append(CheckResult(check.name, check.description, check.fn(ctx)))
    return Report(run_id, results)
