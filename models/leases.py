"""Leases: a worker takes one before generating, keeps it alive with heartbeats, and the
reaper turns an expired one into an infra failure (SPEC §3.6).

The worker-side calls are single-row conditional updates and do not take the run lock: a
heartbeat for an attempt that is no longer running simply changes nothing, which tells the
worker to give up.

Every lease is written and judged on the database's clock (refill.models.clock), never on the
worker's; and a lease that ran out while the database itself was down or unreachable is not
judged until its holder has had a full lease to renew it (`expire_leases`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import DateTime, Integer, Interval, Update, bindparam, case, func, select, update
from sqlalchemy.orm import Session

from refill.models.barrier import queue_training
from refill.models.clock import ledger_now, ledger_now_in, ledger_up_seconds
from refill.models.context import ATTEMPT_COLUMNS, RunContext
from refill.models.overdispatch import reaim_if_steps_changed
from refill.models.rows import AttemptRow, StepRow
from refill.models.settings import settings_for
from refill.models.slots import RunFailed, infra_failure, lost_in_queue
from refill.models.sql import STEP_COLUMNS, literal_in
from refill.models.tables import (
    Attempt,
    AttemptState,
    Outbox,
    OutboxKind,
    Run,
    RunStatus,
    Step,
    StepStatus,
)

_steps = Step.__table__


@dataclass(frozen=True)
class Lease:
    attempt_id: int
    run_id: int
    #: the lowest weight version the worker may generate with (it may have been raised since
    #: the message was sent, when the attempt was handed to a later step)
    min_weight_version: int
    lease_seconds: float
    #: when the worker got it (its monotonic clock): a worker that finds it went a whole lease
    #: without renewing it (it was frozen) checks it before trusting it
    taken_at: float = field(default_factory=time.monotonic, compare=False)


def start_attempt(
    session: Session, attempt_id: int, worker: str, now: datetime | None = None,
    engine_version: int | None = None,
) -> Lease | None:
    """Take the lease on a pending or queued attempt; None if it is not ours to run.

    `engine_version` is the version the worker's engine holds now. The worker never generates
    with anything older than the returned minimum, so recording the larger of the two tells a
    later re-aim how stale this generation can be at worst.
    """
    now = now or ledger_now(session)
    found = session.execute(
        select(Attempt.run_id, Run.status, Run.id).join(Run, Run.id == Attempt.run_id).where(Attempt.id == attempt_id)
    ).first()
    if found is None or found[1] != RunStatus.RUNNING.value:
        return None
    run = session.get(Run, found[0])
    assert run is not None
    settings = settings_for(run)
    floor = engine_version if engine_version is not None else 0
    row = session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt_id,
            Attempt.state.in_([AttemptState.PENDING.value, AttemptState.QUEUED.value]),
        )
        .values(
            state=AttemptState.RUNNING.value,
            worker=worker[:200],
            started_at=now,
            dispatched_at=case((Attempt.dispatched_at.is_(None), now), else_=Attempt.dispatched_at),
            leased_until=now + timedelta(seconds=settings.lease_seconds),
            min_weight_version=case(
                (Attempt.min_weight_version < floor, floor), else_=Attempt.min_weight_version
            ),
        )
        .returning(Attempt.min_weight_version)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        return None
    return Lease(attempt_id, run.id, int(row[0]), settings.lease_seconds)


def start_attempts(
    session: Session,
    run_id: int,
    attempt_ids: list[int],
    worker: str,
    lease_seconds: float,
    now: datetime | None = None,
    engine_version: int | None = None,
    *,
    wait: bool = True,
) -> dict[int, Lease]:
    """`start_attempt` for several attempts of one run, in one statement, for a worker that
    already knows the run's lease length (from the run's config, which never changes).

    Takes the lease on each attempt of `run_id` that is pending or queued while the run is
    running; returns the leases taken, by attempt id. An attempt of another run, or one that
    is not ours to run, is left out.

    With `wait=False` an attempt whose row another transaction holds locked is left out too,
    and the statement never waits. Why: a consumer's batch locks the attempts it changes one
    decision at a time, in no particular order, and an update of several rows that waits for
    one of them while holding the others can close a deadlock with it. A worker takes what it
    can this way, commits, and then takes the attempts left out (`GenerationService`), holding
    nothing else while it waits for them.
    """
    if not attempt_ids:
        return {}
    now = ledger_now_in(session, now)
    server_clock = not isinstance(now, datetime)
    parameters: dict[str, Any] = {
        "b_ids": list(attempt_ids),
        "b_run_id": run_id,
        "b_worker": worker[:200],
        "b_floor": engine_version if engine_version is not None else 0,
    }
    if server_clock:
        parameters["b_lease"] = timedelta(seconds=lease_seconds)
    else:
        parameters["b_now"], parameters["b_leased_until"] = now, now + timedelta(seconds=lease_seconds)
    rows = session.execute(_handshake(wait, server_clock), parameters).all()
    return {int(i): Lease(int(i), run_id, int(version), lease_seconds) for i, version in rows}


@functools.cache
def _handshake(wait: bool, server_clock: bool) -> Update:
    """`start_attempts`' statement, built once per process for each (wait, clock) and run with
    its values as parameters: a worker runs it for every bundle, and building it (a CTE, two
    CASEs, an EXISTS) and its cache key took more of the worker's CPU than running it.

    The attempts' rows are locked first, by primary key alone and in id order (so two
    handshakes that share attempts wait on each other rather than deadlock), or, with
    `wait=False`, only those no one holds; then those of the run still startable are updated.
    Materialized and found by id alone, so that no plan can reach them through the run's other
    attempts: with the run and the live states beside the ids, PostgreSQL chose the index of
    the run's live attempts whenever its statistics had not yet seen the run's rows (a new run,
    a fresh database), and ran the locking subquery once for each of them: 10 ms and 16,000
    buffers for 8 attempts of a 1,024-prompt step, where this is 8 index lookups.

    `server_clock`: the lease is written with the database's `now()` (a worker's), else with
    the `b_now` and `b_leased_until` parameters (a test's or a simulation's clock, SQLite's)."""
    table, runs = Attempt.__table__, Run.__table__
    run = bindparam("b_run_id", type_=Integer)
    floor = bindparam("b_floor", type_=Integer)
    if server_clock:
        # Typed as a plain timestamp: `now() + interval` is then an interval sum.
        now = func.now(type_=DateTime(timezone=True))
        leased_until = now + bindparam("b_lease", type_=Interval())
    else:
        now = bindparam("b_now", type_=table.c.started_at.type)
        leased_until = bindparam("b_leased_until", type_=table.c.leased_until.type)
    locked = (
        select(table.c.id, table.c.run_id, table.c.state)
        .where(table.c.id.in_(bindparam("b_ids", expanding=True)))
        .order_by(table.c.id)
        .with_for_update(key_share=True, skip_locked=not wait)
        .cte("handshake")
        .prefix_with("MATERIALIZED")
    )
    running = select(runs.c.id).where(runs.c.id == run, runs.c.status == RunStatus.RUNNING.value).exists()
    return (
        update(table)
        .where(table.c.id == locked.c.id, locked.c.run_id == run, locked.c.state.in_(_STARTABLE), running)
        .values(
            state=AttemptState.RUNNING.value,
            worker=bindparam("b_worker", type_=table.c.worker.type),
            started_at=now,
            dispatched_at=case((table.c.dispatched_at.is_(None), now), else_=table.c.dispatched_at),
            leased_until=leased_until,
            min_weight_version=case((table.c.min_weight_version < floor, floor), else_=table.c.min_weight_version),
        )
        .returning(table.c.id, table.c.min_weight_version)
    )


def startable(session: Session, run_id: int, attempt_ids: list[int]) -> list[int]:
    """Those of `attempt_ids` that are pending or queued in `run_id` (read, not locked): after
    `start_attempts(wait=False)`, the attempts it left out because their rows were busy."""
    if not attempt_ids:
        return []
    table = Attempt.__table__
    return list(session.scalars(select(table.c.id).where(table.c.id.in_(attempt_ids), *_can_start(run_id))))


_STARTABLE = (AttemptState.PENDING.value, AttemptState.QUEUED.value)


def _can_start(run_id: int) -> tuple[Any, Any]:
    """An attempt of `run_id` that a worker may still take: pending or queued."""
    table = Attempt.__table__
    return table.c.run_id == run_id, table.c.state.in_(_STARTABLE)


def extend_lease(session: Session, attempt_id: int, worker: str, seconds: float, now: datetime | None = None) -> bool:
    """Heartbeat: push the lease out; False when the attempt is no longer ours."""
    return attempt_id in extend_leases(session, {attempt_id: seconds}, worker, now)


def extend_leases(session: Session, held: dict[int, float], worker: str, now: datetime | None = None) -> set[int]:
    """A worker's heartbeat: push out the leases of `held` (attempt -> lease seconds) that are
    still `worker`'s, from the database's clock; returns the attempts extended (one that is not
    was taken back: the worker stops caring for it). One statement per lease length, each
    writing `now()` itself (`ledger_now_in`)."""
    now = ledger_now_in(session, now)
    table = Attempt.__table__
    extended: set[int] = set()
    for seconds in sorted(set(held.values())):
        ids = sorted(a for a, s in held.items() if s == seconds)
        extended.update(
            session.scalars(
                update(table)
                .where(
                    literal_in(table.c.id, ids),
                    table.c.state == AttemptState.RUNNING.value,
                    table.c.worker == worker[:200],
                )
                .values(leased_until=now + timedelta(seconds=seconds))
                .returning(table.c.id)
            )
        )
    return extended


@dataclass
class Reaped:
    attempts: int = 0
    train_steps: int = 0
    failed: str | None = None


def expire_leases(
    session: Session, run_id: int, now: datetime | None = None, reachable_for: float | None = None
) -> Reaped:
    """Expired generation leases become infra failures (retried, replaced or shrunk); an
    expired trainer lease sends the step to the trainer again.

    A lease is judged only once the ledger has been reachable for a whole lease of its kind
    (generation.lease_seconds for a running attempt, generation.queue_timeout_seconds for a
    queued one, infra.trainer_lease_seconds for a step): while the database was down nobody
    could renew a lease, so one that ran out meanwhile says nothing about its holder, and a
    live holder renews it within a heartbeat of the database's return. The ledger counts as
    reachable since the database server last started and, when the caller says so, for the
    last `reachable_for` seconds (the controller's own view: an outage without a restart).
    With an explicit `now` (a test's or a simulation's clock) only `reachable_for` applies.
    """
    with RunContext.open(session, run_id, now) as ctx:
        return _reap(ctx, session, now, reachable_for)


def _reap(ctx: RunContext, session: Session, now: datetime | None, reachable_for: float | None) -> Reaped:
    run_id = ctx.run.id
    reaped = Reaped()
    if not ctx.running:
        return reaped
    up = [reachable_for] if reachable_for is not None else []
    if now is None:
        server_up = ledger_up_seconds(session)
        if server_up is not None:
            up.append(server_up)
    up_for = min(up, default=None)

    def judged(lease_seconds: float) -> bool:
        return up_for is None or up_for >= lease_seconds

    states = [
        state
        for state, length in (
            (AttemptState.QUEUED.value, ctx.settings.queue_timeout_seconds),
            (AttemptState.RUNNING.value, ctx.settings.lease_seconds),
        )
        if judged(length)
    ]
    # Lock the expired rows as they are read: a heartbeat (extend_lease) or a worker taking
    # the lease (start_attempt) does not take the run lock, and without the row lock it could
    # commit between this read and the write below, and be told it holds an attempt that is
    # then failed anyway. With it, whichever goes first wins and the other sees its result.
    # A row locked already is skipped, not waited for: its holder is renewing it right now,
    # or is frozen mid-transaction, and waiting would hold the run's lock, and every batch of
    # the run, until the server ends that transaction (models/db.py); the next pass judges it.
    expired = (
        ctx.rows.load(
            AttemptRow,
            select(*ATTEMPT_COLUMNS)
            .where(
                Attempt.run_id == run_id,
                Attempt.state.in_(states),
                Attempt.leased_until < ctx.now,
            )
            .order_by(Attempt.id)
            .with_for_update(key_share=True, skip_locked=True),
        )
        if states
        else []
    )
    try:
        for attempt in expired:
            if attempt.state == AttemptState.QUEUED.value:
                lost_in_queue(
                    ctx,
                    attempt,
                    f"lease expired at {attempt.leased_until:%H:%M:%S}: the message waited on the "
                    "generate queue past generation.queue_timeout_seconds (lost, or no worker took "
                    "it); sent again without spending a retry",
                )
            else:
                infra_failure(
                    ctx,
                    attempt,
                    f"lease expired at {attempt.leased_until:%H:%M:%S}: worker {attempt.worker} "
                    "stopped heartbeating (crashed, lost, or its result was lost)",
                )
            reaped.attempts += 1
    except RunFailed as failure:
        reaped.failed = str(failure)
    # Locked as read (or skipped), for the reasons above: extend_training_lease takes no run lock.
    stuck = (
        ctx.rows.load(
            StepRow,
            select(*STEP_COLUMNS)
            .where(
                _steps.c.run_id == run_id,
                _steps.c.status == StepStatus.TRAINING.value,
                _steps.c.trainer_lease_until < ctx.now,
            )
            .with_for_update(key_share=True, skip_locked=True),
            refresh=True,
        )
        if judged(ctx.settings.trainer_lease_seconds)
        else []
    )
    for step in stuck:
        step.status = StepStatus.RELEASED.value
        step.trainer_id = None
        if ctx.run.weight_version == step.step and ctx.running:
            queue_training(ctx, step.step)
        reaped.train_steps += 1
    reaped.train_steps += _requeue_lost_training(ctx)
    # A failure that shrank a slot may have released its step, stranding its unstarted extras.
    reaim_if_steps_changed(ctx)
    return reaped


def _requeue_lost_training(ctx: RunContext) -> int:
    """A released step that is next to train but whose train_step message went out long ago
    and was never claimed lost that message (a flushed or restarted broker): send another."""
    step_no = ctx.run.weight_version
    step = ctx.find_step(step_no)
    if step is None or step.status != StepStatus.RELEASED.value:
        return 0
    last = ctx.session.execute(
        select(Outbox.sent_at, Outbox.created_at)
        .where(Outbox.run_id == ctx.run.id, Outbox.kind == OutboxKind.TRAIN_STEP.value, Outbox.step == step_no)
        .order_by(Outbox.id.desc())
        .limit(1)
    ).first()
    if last is not None and last[0] is None:
        return 0  # one is waiting in the outbox already
    since = last[0] if last is not None else step.released_at
    if since is not None and (ctx.now - since).total_seconds() < ctx.settings.queue_timeout_seconds:
        return 0
    queue_training(ctx, step_no)
    return 1
