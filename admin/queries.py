"""Read-only questions about a run, shared by the controller's progress display and the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select, true
from sqlalchemy.orm import Session

from refill.models.db import Ledger
from refill.models.tables import (
    Attempt,
    AttemptState,
    Group,
    Prompt,
    RejectedResult,
    Run,
    RunStatus,
    Slot,
    SlotStatus,
    SparePrompt,
    Step,
    StepMetrics,
    StepStatus,
)


@dataclass
class StepProgress:
    step: int
    status: str
    committed: int
    target: int


@dataclass
class RunProgress:
    run_id: int
    name: str
    status: str
    end_reason: str | None
    error: str | None
    max_num_steps: int
    trained_steps: int
    weight_version: int
    spare_pool: int
    open_steps: list[StepProgress] = field(default_factory=list)
    last_metrics: dict[str, Any] | None = None


def run_progress(session: Session, run_id: int) -> RunProgress:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    trained = session.scalar(
        select(func.count()).where(Step.run_id == run_id, Step.status == StepStatus.TRAINED.value)
    )
    spare = session.scalar(
        select(func.count()).where(SparePrompt.run_id == run_id, SparePrompt.taken_at.is_(None))
    )
    open_steps = [
        StepProgress(s.step, s.status, s.committed, s.num_slots - s.shrunk)
        for s in session.scalars(
            select(Step)
            .where(Step.run_id == run_id, Step.status != StepStatus.TRAINED.value)
            .order_by(Step.step)
        )
    ]
    last = session.scalars(
        select(StepMetrics)
        .join(Step, (Step.run_id == StepMetrics.run_id) & (Step.step == StepMetrics.step))
        .where(StepMetrics.run_id == run_id, Step.status == StepStatus.TRAINED.value)
        .order_by(StepMetrics.step.desc())
        .limit(1)
    ).first()
    return RunProgress(
        run_id=run.id,
        name=run.name,
        status=run.status,
        end_reason=run.end_reason,
        error=run.error,
        max_num_steps=run.max_num_steps,
        trained_steps=int(trained or 0),
        weight_version=run.weight_version,
        spare_pool=int(spare or 0),
        open_steps=open_steps,
        last_metrics=metrics_dict(last) if last is not None else None,
    )


METRIC_COLUMNS = [c.key for c in StepMetrics.__table__.columns if c.key not in ("run_id", "extra")]


def metrics_dict(row: StepMetrics) -> dict[str, Any]:
    out = {key: getattr(row, key) for key in METRIC_COLUMNS}
    out.update(row.extra or {})
    return out


def step_metrics(session: Session, run_id: int) -> list[dict[str, Any]]:
    return [
        metrics_dict(row)
        for row in session.scalars(
            select(StepMetrics).where(StepMetrics.run_id == run_id).order_by(StepMetrics.step)
        )
    ]


# --- the admin CLI's questions (issue 5) --------------------------------------------------
#
# Each function answers one question with plain data (dicts of JSON-able values, datetimes
# aside) so that the CLI can print it as a table or as JSON. An unknown run, step or slot is a
# `NotFound` (a LookupError) whose message is the one line the CLI prints. They read the
# tables, never the views of migration 0002, so they also work on a ledger built with
# `create_all`; the views answer the same questions in SQL (docs/sql.md) and the acceptance
# tests hold the two to the same numbers.

LIVE_STATES = tuple(s.value for s in AttemptState.live())
FINISHED_RUN_STATES = (RunStatus.COMPLETED.value, RunStatus.FAILED.value, RunStatus.STOPPED.value)


@contextmanager
def read_snapshot(ledger: Ledger) -> Iterator[Session]:
    """A read-only session on one snapshot of the ledger (REPEATABLE READ, READ ONLY on
    PostgreSQL; SQLite reads in one transaction anyway), so that the several queries of one
    answer agree with each other while a run is writing."""
    with ledger.engine.connect() as connection:
        if ledger.engine.dialect.name == "postgresql":
            connection = connection.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        with Session(bind=connection) as session:
            try:
                yield session
            finally:
                session.rollback()


class NotFound(LookupError):
    """No such run, step or slot; str() is a one-line message for people."""


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"there is no run {run_id}")
    return run


def get_step(session: Session, run_id: int, step: int) -> Step:
    get_run(session, run_id)
    row = session.get(Step, (run_id, step))
    if row is None:
        last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id))
        known = "it has no steps yet" if last is None else f"its steps are 0..{last}"
        raise NotFound(f"run {run_id} has no step {step} ({known})")
    return row


def get_slot(session: Session, run_id: int, step: int, idx: int) -> Slot:
    row = get_step(session, run_id, step)
    slot = session.get(Slot, (run_id, step, idx))
    if slot is None:
        raise NotFound(f"step {step} of run {run_id} has no slot {idx} (its slots are 0..{row.num_slots - 1})")
    return slot


def _count_by(session: Session, column: Any, *where: Any) -> dict[str, int]:
    return {
        str(key): int(n)
        for key, n in session.execute(select(column, func.count()).where(*where).group_by(column)).all()
    }


def measured_zero_variance(session: Session, run_id: int) -> tuple[int, int]:
    """(zero-variance groups, finished groups) over every attempt of the run so far."""
    zero, total = session.execute(
        select(func.count().filter(Attempt.zero_variance.is_(True)), func.count()).where(
            Attempt.run_id == run_id, Attempt.zero_variance.is_not(None)
        )
    ).one()
    return int(zero or 0), int(total or 0)


def list_runs(session: Session, *, status: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Every run, newest first, with how far it got."""
    trained = (
        select(Step.run_id, func.count().label("n"))
        .where(Step.status == StepStatus.TRAINED.value)
        .group_by(Step.run_id)
        .subquery()
    )
    query = (
        select(Run, func.coalesce(trained.c.n, 0))
        .outerjoin(trained, trained.c.run_id == Run.id)
        .order_by(Run.id.desc())
    )
    if status is not None:
        query = query.where(Run.status == status)
    if limit is not None:
        query = query.limit(limit)
    out = []
    for run, n_trained in session.execute(query).all():
        out.append(
            {
                "run_id": run.id,
                "name": run.name,
                "status": run.status,
                "end_reason": run.end_reason,
                "trained_steps": int(n_trained),
                "max_num_steps": run.max_num_steps,
                "weight_version": run.weight_version,
                "num_prompts_per_step": run.num_prompts_per_step,
                "group_size": run.group_size,
                "created_at": run.created_at,
                "started_at": run.started_at,
                "finished_at": run.finished_at,
                "seconds": _seconds(run.started_at, run.finished_at),
            }
        )
    return out


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


def run_detail(session: Session, run_id: int) -> dict[str, Any]:
    """Everything about one run that fits on a screen: identity, knobs, position, counts."""
    from refill.models.config import redact_url
    from refill.models.settings import LedgerSettings

    run = get_run(session, run_id)
    settings = LedgerSettings.from_config(run.config)
    zero, total = measured_zero_variance(session, run_id)
    spare = session.scalar(
        select(func.count()).where(SparePrompt.run_id == run_id, SparePrompt.taken_at.is_(None))
    )
    groups_trained, groups_parked, groups_total = session.execute(
        select(
            func.count().filter(Group.trained_step.is_not(None)),
            func.count().filter(Group.parked.is_(True)),
            func.count(),
        ).where(Group.run_id == run_id)
    ).one()
    # A parked group can serve a step at most max_lookahead_versions past its weights; once
    # every step it could serve is released (or the run ended) it will never be trained.
    earliest_open = session.scalar(
        select(func.min(Step.step)).where(Step.run_id == run_id, Step.status == StepStatus.OPEN.value)
    )
    still_useful_from = (run.next_step if earliest_open is None else earliest_open) - settings.max_lookahead_versions
    groups_expired = session.scalar(
        select(func.count()).where(
            Group.run_id == run_id,
            Group.parked.is_(True),
            (Group.weight_version < still_useful_from) if run.status == RunStatus.RUNNING.value else true(),
        )
    )
    metrics = step_metrics(session, run_id)
    trained = [m for m in metrics if m.get("reward") is not None]
    infra = dict((run.config or {}).get("infra") or {})
    generation = dict((run.config or {}).get("generation") or {})
    return {
        "run_id": run.id,
        "name": run.name,
        "status": run.status,
        "end_reason": run.end_reason,
        "error": run.error,
        "run_dir": run.run_dir,
        "config_hash": run.config_hash,
        "data_fingerprint": run.data_fingerprint,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "seconds": _seconds(run.started_at, run.finished_at),
        "controller_id": run.controller_id,
        "controller_seen_at": run.controller_seen_at,
        "stop_requested": run.stop_requested,
        "num_prompts_per_step": run.num_prompts_per_step,
        "group_size": run.group_size,
        "max_num_steps": run.max_num_steps,
        "max_lookahead_versions": run.max_lookahead_versions,
        "num_prompts": run.num_prompts,
        "backend": generation.get("backend"),
        "trainer": infra.get("trainer"),
        "database_url": redact_url(infra["database_url"]) if infra.get("database_url") else None,
        "broker_url": redact_url(infra["broker_url"]) if infra.get("broker_url") else None,
        "use_dynamic_sampling": settings.use_dynamic_sampling,
        "filter_budget": settings.filter_budget,
        "zero_variance_tolerance": settings.zero_variance_tolerance,
        "sampler": settings.sampler_name,
        "over_dispatch": settings.over_dispatch,
        "on_dropped_prompt": settings.on_dropped_prompt,
        "drop_budget": settings.drop_budget,
        "max_attempts_per_prompt": settings.max_attempts_per_prompt,
        "min_step_batch_fraction": settings.min_step_batch_fraction,
        "loader_epoch": run.loader_epoch,
        "loader_cursor": run.loader_cursor,
        "loader_exhausted": run.loader_exhausted,
        "next_step": run.next_step,
        "weight_version": run.weight_version,
        "consecutive_dropped": run.consecutive_dropped,
        "spare_pool": int(spare or 0),
        "steps": _count_by(session, Step.status, Step.run_id == run_id),
        "slots": _count_by(session, Slot.status, Slot.run_id == run_id),
        "attempts": _count_by(session, Attempt.state, Attempt.run_id == run_id),
        "attempt_reasons": _count_by(session, Attempt.reason, Attempt.run_id == run_id),
        "rejected_results": _count_by(session, RejectedResult.reason, RejectedResult.run_id == run_id),
        "groups": {
            "committed": int(groups_total or 0),
            "trained": int(groups_trained or 0),
            "parked": int(groups_parked or 0),
            # of the parked: too stale for every step still to train (wasted generations)
            "parked_expired": int(groups_expired or 0),
        },
        "zero_variance_groups": zero,
        "finished_groups": total,
        "zero_variance_fraction": zero / total if total else None,
        "trained_steps": len(trained),
        "mean_reward_first_steps": _mean([m["reward"] for m in trained[:5]]),
        "mean_reward_last_steps": _mean([m["reward"] for m in trained[-5:]]),
        "last_metrics": metrics[-1] if metrics else None,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_rows(session: Session, run_id: int, *, status: str | None = None) -> list[dict[str, Any]]:
    """One row per step (the `step_summary` view's numbers): counters, what its slots and
    attempts did, its timings and headline metrics."""
    get_run(session, run_id)
    slot_agg = (
        select(
            Slot.step.label("step"),
            func.count().filter(Slot.status == SlotStatus.OPEN.value).label("open_slots"),
            func.coalesce(func.sum(Slot.filter_replacements), 0).label("filter_replacements"),
            func.coalesce(func.sum(Slot.drop_replacements), 0).label("drop_replacements"),
            func.coalesce(func.sum(Slot.borrowed_in), 0).label("borrowed_in"),
        )
        .where(Slot.run_id == run_id)
        .group_by(Slot.step)
        .subquery()
    )
    attempt_agg = (
        select(
            Attempt.step.label("step"),
            func.count().label("attempts"),
            func.count().filter(Attempt.state.in_(LIVE_STATES)).label("live"),
            func.count().filter(Attempt.state == AttemptState.COMMITTED.value).label("committed"),
            func.count().filter(Attempt.state == AttemptState.FILTERED.value).label("filtered"),
            func.count().filter(Attempt.state == AttemptState.FAILED.value).label("failed"),
            func.count().filter(Attempt.state == AttemptState.CANCELLED.value).label("cancelled"),
        )
        .where(Attempt.run_id == run_id)
        .group_by(Attempt.step)
        .subquery()
    )
    query = (
        select(Step, slot_agg, attempt_agg, StepMetrics)
        .outerjoin(slot_agg, slot_agg.c.step == Step.step)
        .outerjoin(attempt_agg, attempt_agg.c.step == Step.step)
        .outerjoin(StepMetrics, (StepMetrics.run_id == Step.run_id) & (StepMetrics.step == Step.step))
        .where(Step.run_id == run_id)
        .order_by(Step.step)
    )
    if status is not None:
        query = query.where(Step.status == status)
    out = []
    for row in session.execute(query).mappings():
        step: Step = row["Step"]
        metrics: StepMetrics | None = row["StepMetrics"]

        def n(key: str, row: Any = row) -> int:
            return int(row[key] or 0)

        out.append(
            {
                "step": step.step,
                "status": step.status,
                "num_slots": step.num_slots,
                "target": step.num_slots - step.shrunk,
                "committed": step.committed,
                "shrunk": step.shrunk,
                "dropped_shrunk": step.dropped_shrunk,
                "open_slots": n("open_slots"),
                "filter_replacements": n("filter_replacements"),
                "drop_replacements": n("drop_replacements"),
                "borrowed_in": n("borrowed_in"),
                "attempts": n("attempts"),
                "live_attempts": n("live"),
                "committed_attempts": n("committed"),
                "filtered_attempts": n("filtered"),
                "failed_attempts": n("failed"),
                "cancelled_attempts": n("cancelled"),
                "admitted_at": step.admitted_at,
                "released_at": step.released_at,
                "trained_at": step.trained_at,
                "trainer_id": step.trainer_id,
                "reward": metrics.reward if metrics else None,
                "unfiltered_reward": metrics.unfiltered_reward if metrics else None,
                "first_attempt_reward": metrics.first_attempt_reward if metrics else None,
                "zero_variance_fraction": metrics.zero_variance_fraction if metrics else None,
                "staleness_max": metrics.staleness_max if metrics else None,
                "step_fill_seconds": metrics.step_fill_seconds if metrics else None,
                "trainer_idle_seconds": metrics.trainer_idle_seconds if metrics else None,
            }
        )
    return out


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
                "settled_at": slot.settled_at,
            }
        )
    return out


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
    rejected = _count_by(
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
                "queue_seconds": _seconds(a.dispatched_at, a.started_at),
                "latency_seconds": _seconds(a.created_at, a.finished_at),
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


def budget_report(
    session: Session, run_id: int, *, step: int | None = None, every_slot: bool = False
) -> dict[str, Any]:
    """Per-slot use of the dynamic-sampling (filter) and fault-tolerance (drop) budgets, the
    measured zero-variance fraction p, and the risk that some slot exhausts its filter budget
    over the run: 1 - (1 - p**(budget+1))**(N * max_num_steps), with the expected number of
    exhausted slots p**(budget+1) * N * max_num_steps (SPEC §3.3)."""
    from refill.models import decisions
    from refill.models.settings import LedgerSettings

    run = get_run(session, run_id)
    if step is not None:
        get_step(session, run_id, step)
    settings = LedgerSettings.from_config(run.config)
    zero, total = measured_zero_variance(session, run_id)
    p = zero / total if total else None
    budget = settings.filter_budget
    n_slots = settings.num_prompts_per_step
    risk = expected = suggested = None
    if p is not None and settings.use_dynamic_sampling:
        risk = decisions.exhaustion_probability(p, budget, n_slots, settings.max_num_steps)
        expected = decisions.expected_exhausted_slots(p, budget, n_slots, settings.max_num_steps)
        if p < 1:
            suggested = decisions.safe_budget(p, n_slots, settings.max_num_steps)
    stored = session.execute(
        select(StepMetrics.step, StepMetrics.budget_exhaustion_risk)
        .where(StepMetrics.run_id == run_id, StepMetrics.budget_exhaustion_risk.is_not(None))
        .order_by(StepMetrics.step.desc())
        .limit(1)
    ).first()
    where = [Slot.run_id == run_id]
    if step is not None:
        where.append(Slot.step == step)
    histogram = {
        int(k): int(v)
        for k, v in session.execute(
            select(Slot.filter_replacements, func.count())
            .where(*where)
            .group_by(Slot.filter_replacements)
            .order_by(Slot.filter_replacements)
        ).all()
    }
    totals = session.execute(
        select(
            func.count(),
            func.coalesce(func.max(Slot.filter_replacements), 0),
            func.coalesce(func.sum(Slot.filter_replacements), 0),
            func.coalesce(func.max(Slot.drop_replacements), 0),
            func.coalesce(func.sum(Slot.drop_replacements), 0),
            func.coalesce(func.sum(Slot.drops), 0),
            func.coalesce(func.sum(Slot.infra_failures), 0),
            func.coalesce(func.sum(Slot.data_failures), 0),
        ).where(*where)
    ).one()
    used = (
        (Slot.filtered > 0)
        | (Slot.filter_replacements > 0)
        | (Slot.drops > 0)
        | (Slot.drop_replacements > 0)
        | (Slot.infra_failures > 0)
        | (Slot.data_failures > 0)
    )
    query = select(Slot).where(*where)
    if not every_slot:
        query = query.where(used)
    slots = [
        {
            "step": s.step,
            "slot": s.idx,
            "status": s.status,
            "filtered": s.filtered,
            "filter_replacements": s.filter_replacements,
            "filter_budget": s.filter_budget,
            "filter_budget_left": s.filter_budget - s.filter_replacements,
            "infra_failures": s.infra_failures,
            "data_failures": s.data_failures,
            "drops": s.drops,
            "drop_replacements": s.drop_replacements,
            "drop_budget": s.drop_budget,
            "drop_budget_left": s.drop_budget - s.drop_replacements,
            "borrowed_in": s.borrowed_in,
            "lent_out": s.lent_out,
        }
        for s in session.scalars(query.order_by(Slot.step, Slot.idx))
    ]
    return {
        "run_id": run_id,
        "step": step,
        "use_dynamic_sampling": settings.use_dynamic_sampling,
        "filter_budget": budget,
        "drop_budget": settings.drop_budget,
        "on_dropped_prompt": settings.on_dropped_prompt,
        "num_prompts_per_step": n_slots,
        "max_num_steps": settings.max_num_steps,
        "zero_variance_groups": zero,
        "finished_groups": total,
        "p": p,
        "budget_exhaustion_risk": risk,
        "expected_exhausted_slots": expected,
        "budget_for_1pct_risk": suggested,
        "last_recorded_risk": (
            {"step": stored[0], "budget_exhaustion_risk": stored[1]} if stored else None
        ),
        "slots_total": int(totals[0]),
        "max_filter_replacements": int(totals[1]),
        "filter_replacements": int(totals[2]),
        "max_drop_replacements": int(totals[3]),
        "drop_replacements": int(totals[4]),
        "drops": int(totals[5]),
        "infra_failures": int(totals[6]),
        "data_failures": int(totals[7]),
        "filter_replacements_histogram": histogram,
        "slots": slots,
    }


def worker_rows(
    session: Session, *, run_id: int | None = None, since_seconds: float = 600.0, now: datetime | None = None
) -> list[dict[str, Any]]:
    """The fleet as the ledger sees it: per generation worker, the attempts it holds now and
    its last heartbeat (a lease is pushed to now + lease_seconds at every heartbeat, so the
    last one was at leased_until - lease_seconds), and what it finished recently; plus the
    trainers holding a step. Workers silent for longer than `since_seconds` are left out."""
    from refill.models.settings import LedgerSettings

    now = now or datetime.now(UTC)
    since = now - timedelta(seconds=since_seconds)
    if run_id is not None:
        get_run(session, run_id)
    lease_of = {
        rid: LedgerSettings.from_config(config).lease_seconds
        for rid, config in session.execute(
            select(Run.id, Run.config).where(
                Run.id.in_(
                    select(Attempt.run_id).where(Attempt.state == AttemptState.RUNNING.value).distinct()
                )
            )
        ).all()
    }
    scope = [Attempt.worker.is_not(None)]
    if run_id is not None:
        scope.append(Attempt.run_id == run_id)
    workers: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return workers.setdefault(
            name,
            {
                "worker": name,
                "role": "generate",
                "in_flight": 0,
                "runs": [],
                "last_heartbeat": None,
                "lease_expires": None,
                "expired_leases": 0,
                "oldest_started_at": None,
                "finished_recently": 0,
                "failed_recently": 0,
                "last_finished_at": None,
            },
        )

    for a_run, worker, started, leased in session.execute(
        select(Attempt.run_id, Attempt.worker, Attempt.started_at, Attempt.leased_until).where(
            *scope, Attempt.state == AttemptState.RUNNING.value
        )
    ).all():
        row = entry(worker)
        row["in_flight"] += 1
        if a_run not in row["runs"]:
            row["runs"].append(a_run)
        if leased is not None:
            beat = leased - timedelta(seconds=lease_of.get(a_run, 0.0))
            row["last_heartbeat"] = max(filter(None, [row["last_heartbeat"], beat]))
            row["lease_expires"] = min(filter(None, [row["lease_expires"], leased]))
            if leased < now:
                row["expired_leases"] += 1
        if started is not None:
            row["oldest_started_at"] = min(filter(None, [row["oldest_started_at"], started]))
    for worker, a_run, n, failed, last in session.execute(
        select(
            Attempt.worker,
            Attempt.run_id,
            func.count(),
            func.count().filter(Attempt.state == AttemptState.FAILED.value),
            func.max(Attempt.finished_at),
        )
        .where(*scope, Attempt.finished_at >= since)
        .group_by(Attempt.worker, Attempt.run_id)
    ).all():
        row = entry(worker)
        row["finished_recently"] += int(n)
        row["failed_recently"] += int(failed)
        row["last_finished_at"] = max(filter(None, [row["last_finished_at"], last]))
        if a_run not in row["runs"]:
            row["runs"].append(a_run)
    trainer_scope = [Step.trainer_id.is_not(None)]
    if run_id is not None:
        trainer_scope.append(Step.run_id == run_id)
    for trainer, s_run, status, lease, started, trained in session.execute(
        select(Step.trainer_id, Step.run_id, Step.status, Step.trainer_lease_until, Step.train_started_at, Step.trained_at).where(
            *trainer_scope,
            (Step.status == StepStatus.TRAINING.value) | (Step.trained_at >= since),
        )
    ).all():
        row = entry(trainer)
        row["role"] = "train"
        if s_run not in row["runs"]:
            row["runs"].append(s_run)
        if status == StepStatus.TRAINING.value:
            row["in_flight"] += 1
            row["lease_expires"] = min(filter(None, [row["lease_expires"], lease]))
            if lease is not None and lease < now:
                row["expired_leases"] += 1
            if started is not None:
                row["oldest_started_at"] = min(filter(None, [row["oldest_started_at"], started]))
        elif trained is not None:
            row["finished_recently"] += 1
            row["last_finished_at"] = max(filter(None, [row["last_finished_at"], trained]))
    for row in workers.values():
        row["runs"].sort()
    return sorted(workers.values(), key=lambda r: (r["role"], r["worker"]))


def queue_counts(session: Session, *, run_id: int | None = None) -> dict[str, int]:
    """Attempts waiting for a worker (pending: not yet on the queue; queued: on it)."""
    where = [Attempt.state.in_([AttemptState.PENDING.value, AttemptState.QUEUED.value])]
    if run_id is not None:
        where.append(Attempt.run_id == run_id)
    else:
        where.append(Attempt.run_id.in_(select(Run.id).where(Run.status == RunStatus.RUNNING.value)))
    counts = _count_by(session, Attempt.state, *where)
    return {state: counts.get(state, 0) for state in (AttemptState.PENDING.value, AttemptState.QUEUED.value)}


@dataclass(frozen=True)
class BudgetRisk:
    step: int
    p: float
    budget: int
    probability: float
    expected_exhausted: float
    safe_budget: int | None


def budget_risk(session: Session, run_id: int) -> BudgetRisk | None:
    """The dynamic-sampling budget risk as of the latest released step (None before one)."""
    from refill.models import decisions
    from refill.models.settings import LedgerSettings

    latest = session.execute(
        select(StepMetrics.step, StepMetrics.budget_exhaustion_risk)
        .where(StepMetrics.run_id == run_id, StepMetrics.budget_exhaustion_risk.is_not(None))
        .order_by(StepMetrics.step.desc())
        .limit(1)
    ).first()
    if latest is None:
        return None
    run = get_run(session, run_id)
    settings = LedgerSettings.from_config(run.config)
    zero, total = measured_zero_variance(session, run_id)
    p = zero / total if total else 0.0
    n, steps = settings.num_prompts_per_step, settings.max_num_steps
    return BudgetRisk(
        step=int(latest[0]),
        p=p,
        budget=settings.filter_budget,
        probability=float(latest[1]),
        expected_exhausted=decisions.expected_exhausted_slots(p, settings.filter_budget, n, steps),
        safe_budget=decisions.safe_budget(p, n, steps) if p < 1 else None,
    )
