"""The fleet as the ledger sees it (`refill workers`): per worker the attempts or step it
holds, its last heartbeat and recent work; the attempts waiting for a worker; and how the
running runs share the fleet (each run's share and attempts in flight).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.admin.snapshot import count_by, get_run
from refill.config import ConfigError, from_snapshot
from refill.models.clock import ledger_now
from refill.models.tables import Attempt, AttemptState, Run, RunStatus, Step, StepStatus


def worker_rows(
    session: Session, *, run_id: int | None = None, since_seconds: float = 600.0, now: datetime | None = None
) -> list[dict[str, Any]]:
    """The fleet as the ledger sees it: per generation worker, the attempts it holds now and
    its last heartbeat (a lease is pushed to now + lease_seconds at every heartbeat, so the
    last one was at leased_until - lease_seconds), and what it finished recently; plus the
    trainers holding a step. Workers silent for longer than `since_seconds` are left out."""
    from refill.models.settings import LedgerSettings

    now = now or ledger_now(session)
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
    counts = count_by(session, Attempt.state, *where)
    return {state: counts.get(state, 0) for state in (AttemptState.PENDING.value, AttemptState.QUEUED.value)}


def in_flight_by_run(session: Session, run_ids: list[int] | None = None) -> dict[int, dict[str, int]]:
    """Per run, its attempts in flight: queued (sent to the broker, no worker yet) and running.
    Every run that has any, or only `run_ids`."""
    where = [Attempt.state.in_([AttemptState.QUEUED.value, AttemptState.RUNNING.value])]
    if run_ids is not None:
        where.append(Attempt.run_id.in_(run_ids))
    out: dict[int, dict[str, int]] = {}
    for a_run, state, n in session.execute(
        select(Attempt.run_id, Attempt.state, func.count()).where(*where).group_by(Attempt.run_id, Attempt.state)
    ).all():
        out.setdefault(int(a_run), {"queued": 0, "running": 0})[str(state)] = int(n)
    return out


def run_share(config: Any) -> float | None:
    """A run's `run.share` (its weight on a shared fleet), from its stored config; None when
    that config no longer validates (`refill run show RUN` names the problem), so that one old
    run does not hide the others from `refill runs`."""
    try:
        return from_snapshot(config).run.share
    except ConfigError:
        return None


def fleet_shares(session: Session, *, run_id: int | None = None) -> list[dict[str, Any]]:
    """How the running runs share the generation workers: per run its share, its attempts in
    flight, the part of the fleet's running attempts it holds and the part its share entitles
    it to among the running runs (what the relay's metering aims at while every run has work:
    refill.tasks.relay)."""
    query = select(Run.id, Run.name, Run.config).where(Run.status == RunStatus.RUNNING.value).order_by(Run.id)
    runs = session.execute(query).all()
    flight = in_flight_by_run(session, [r.id for r in runs])
    shares = {r.id: run_share(r.config) for r in runs}
    total_share = sum(share for share in shares.values() if share is not None)
    total_running = sum(f["running"] for f in flight.values())
    rows = []
    for r in runs:
        if run_id is not None and r.id != run_id:
            continue
        counts = flight.get(r.id, {"queued": 0, "running": 0})
        rows.append(
            {
                "run_id": r.id,
                "name": r.name,
                "share": shares[r.id],
                "entitled_fraction": shares[r.id] / total_share if total_share and shares[r.id] is not None else None,
                "queued": counts["queued"],
                "running": counts["running"],
                "running_fraction": counts["running"] / total_running if total_running else None,
            }
        )
    return rows
