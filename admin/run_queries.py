"""The questions of `refill runs`, `refill run show` and `refill steps`: the runs in the
ledger, one run in detail, and one row per step of a run.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, true
from sqlalchemy.orm import Session

from refill.admin.budget_queries import zero_variance_from_attempts
from refill.admin.fleet_queries import in_flight_by_run, run_share
from refill.admin.progress_queries import step_metrics
from refill.admin.snapshot import LIVE_STATES, count_by, get_run, seconds_between
from refill.models.tables import (
    Attempt,
    AttemptState,
    Group,
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
    found = session.execute(query).all()
    flight = in_flight_by_run(session, [run.id for run, _ in found])
    out = []
    for run, n_trained in found:
        counts = flight.get(run.id, {"queued": 0, "running": 0})
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
                "share": run_share(run.config),
                "queued": counts["queued"],
                "running": counts["running"],
                "created_at": run.created_at,
                "started_at": run.started_at,
                "finished_at": run.finished_at,
                "seconds": seconds_between(run.started_at, run.finished_at),
            }
        )
    return out


def run_detail(session: Session, run_id: int) -> dict[str, Any]:
    """Everything about one run that fits on a screen: identity, knobs, position, counts."""
    from refill.config import from_snapshot, redact_url
    from refill.models.settings import LedgerSettings

    run = get_run(session, run_id)
    config = from_snapshot(run.config, source=f"run {run_id}'s stored config")
    settings = LedgerSettings.from_config(config)
    zero, total = zero_variance_from_attempts(session, run_id)
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
        "seconds": seconds_between(run.started_at, run.finished_at),
        "controller_id": run.controller_id,
        "controller_seen_at": run.controller_seen_at,
        "stop_requested": run.stop_requested,
        "num_prompts_per_step": run.num_prompts_per_step,
        "group_size": run.group_size,
        "max_num_steps": run.max_num_steps,
        "max_lookahead_versions": run.max_lookahead_versions,
        "num_prompts": run.num_prompts,
        "backend": config.generation.backend,
        "trainer": config.infra.trainer,
        "database_url": redact_url(config.infra.database_url),
        "broker_url": redact_url(config.infra.broker_url),
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
        "steps": count_by(session, Step.status, Step.run_id == run_id),
        "slots": count_by(session, Slot.status, Slot.run_id == run_id),
        "attempts": count_by(session, Attempt.state, Attempt.run_id == run_id),
        "attempt_reasons": count_by(session, Attempt.reason, Attempt.run_id == run_id),
        "rejected_results": count_by(session, RejectedResult.reason, RejectedResult.run_id == run_id),
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
