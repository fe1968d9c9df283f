"""The relay's side of the ledger: find what is due to send, build the messages, mark them sent.

Two kinds of message follow a commit (SPEC §2), each written in the transaction of the decision
that needs it: a **pending attempt is its own `generate` message** (its row says what to
generate and, in `available_at`, when: a retry's back-off), and a `train_step` message is a row
of the `outbox` table. Both are sent at least once: a relay that dies after publishing and
before `mark_sent` leaves the attempt pending and the row unsent (the fleet's relay: its
transaction rolls back; one that committed a claim first: when the claim expires), they are sent
again, and the receivers ignore the repeat (a generate message for an attempt that is no longer
pending is skipped by the worker's lease handshake; a train_step for a trained step is a no-op).

Until stop 52 every attempt also had a `generate` row in the outbox, written with it and
updated when sent: 7,700 inserts and as many updates of a 4096-group step's 63,000 row writes,
which said nothing the attempt's own `state` and `available_at` did not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import DateTime, Interval, Text, bindparam, cast, func, or_, select, text, update
from sqlalchemy.orm import Session

from refill.config import from_snapshot
from refill.models import driver
from refill.models.column_types import UTCDateTime
from refill.models.payload import generate_body
from refill.models.settings import LedgerSettings, cached_settings, settings_for
from refill.models.sql import ids_in, ids_param, literal
from refill.models.tables import Attempt, AttemptState, Outbox, OutboxKind, Prompt, Run, RunStatus

GENERATE = "generate"
QUEUE_OF = {GENERATE: "generate", OutboxKind.TRAIN_STEP.value: "train"}
_PENDING, _RUNNING = AttemptState.PENDING.value, RunStatus.RUNNING.value


@dataclass(frozen=True)
class ToSend:
    """What a transaction left for the relay to send at once after its commit (rather than at
    the controller's next pass): the attempts it made (each its own generate message) and the
    outbox rows it wrote (train_step)."""

    attempt_ids: tuple[int, ...] = ()
    outbox_ids: tuple[int, ...] = ()
    #: the runs the attempts belong to: a metering relay sizes each run's room before it locks
    #: any of them (`claim_outbox`)
    run_ids: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.attempt_ids or self.outbox_ids)

    @staticmethod
    def merged(parts: Iterable[ToSend]) -> ToSend:
        attempts: list[int] = []
        outbox: list[int] = []
        runs: set[int] = set()
        for part in parts:
            attempts.extend(part.attempt_ids)
            outbox.extend(part.outbox_ids)
            runs.update(part.run_ids)
        return ToSend(tuple(attempts), tuple(outbox), tuple(sorted(runs)))

    def chunks(self, size: int) -> list[ToSend]:
        """This in pieces of at most `size` attempts (the outbox rows, a few, with the first)."""
        starts = range(0, max(1, len(self.attempt_ids)), size)
        return [
            ToSend(self.attempt_ids[start : start + size], self.outbox_ids if start == 0 else (), self.run_ids)
            for start in starts
        ]


@dataclass(frozen=True)
class Outgoing:
    kind: str  # "generate" or "train_step"
    queue: str
    run_id: int
    body: dict[str, Any]
    #: a train_step message's outbox row (a generate message's row is its attempt)
    outbox_id: int | None = None
    #: a generate message's: how long its attempt may wait on the broker, queued, before the
    #: reaper sends it again (the run's `infra.queue_timeout_seconds`); set by `claim_outbox`,
    #: read by `mark_sent`
    queue_timeout_seconds: float | None = None
    #: who sends it, when `claim_outbox` wrote no claim for it (`claim_seconds=None`):
    #: `mark_sent` records the sender and counts the send with a train_step row's `sent_at`
    sender: str | None = None

    @property
    def attempt_id(self) -> int | None:
        return self.body["attempt_id"] if self.kind == GENERATE else None


def claim_outbox(
    session: Session,
    *,
    claimer: str,
    now: datetime,
    limit: int = 500,
    claim_seconds: float | None = 30.0,
    only: ToSend | None = None,
    run_id: int | None = None,
    queued_per_share: int | None = None,
) -> list[Outgoing]:
    """Claim up to `limit` due messages of each kind and return them to publish: pending
    attempts whose `available_at` has passed, of running runs, and unsent `train_step` rows
    (only those `only` names, or those of `run_id`, when given).

    Rows are read locked, skipping those another transaction holds: an attempt a consumer's
    batch is changing right now (it may cancel it or move it) is left for a later pass, and the
    relay never waits on a row.
    A train_step row whose run no longer runs is marked sent without a message, so it drains.

    The claim is for a relay that publishes outside this transaction: if it dies before
    `mark_sent`, what it claimed is due again when the claim expires (a train_step row's
    `claimed_until`; a pending attempt's `available_at`, moved past the claim). A relay that
    marks them sent in this same transaction (the fleet's, `refill.tasks.relay`) passes
    `claim_seconds=None`: its row locks already keep other relays off them, a rollback frees
    them at once, and `mark_sent` writes once (one UPDATE of each kind, not two).

    With `queued_per_share`, generate messages are metered: a run keeps at most
    `queued_per_share * run.share` attempts queued on the broker (sent, not yet taken by a
    worker), and its other attempts wait, pending, for a later pass. Workers take messages in
    the order they were sent, so runs that all have work get the workers in proportion to
    their shares (see `queue_room`).
    """
    steps = [] if only is not None and not only.outbox_ids else _due_rows(session, now, limit, only, run_id)
    attempt_ids = None if only is None else list(only.attempt_ids)
    by_run = [run_id] if run_id is not None else list(only.run_ids) if only is not None and only.run_ids else None
    if attempt_ids is not None and not attempt_ids:
        attempts = []
    elif queued_per_share is None:
        attempts = _due_attempts(session, now, limit, attempt_ids, run_id)
    elif by_run is not None:
        # Each run's room first, then only what it may send is read and locked: a metered run
        # can have hundreds of attempts waiting, and an attempt locked and left would be held
        # through the publish, from a batch that wants to move it (it takes a locked attempt for
        # one a worker is starting).
        attempts = []
        for run, room in sorted(queue_room(session, by_run, queued_per_share).items()):
            if room > 0:
                attempts += _due_attempts(session, now, min(limit, room), attempt_ids, run)
        attempts.sort(key=lambda row: row.id)
    else:  # a pass over every run (a bench's, a test's): the runs are known once read
        attempts = _due_attempts(session, now, limit, attempt_ids, None)
        attempts = _within_room(attempts, queue_room(session, {row.run_id for row in attempts}, queued_per_share))
    if not steps and not attempts:
        return []
    settings_of = _runs(session, [*steps, *attempts])
    sender = claimer[:200] if claim_seconds is None else None
    out: list[Outgoing] = []
    moot: list[int] = []
    for row in steps:
        if row.run_status != _RUNNING:
            moot.append(row.id)
            continue
        out.append(Outgoing(row.kind, QUEUE_OF[row.kind], row.run_id, dict(row.payload), outbox_id=row.id, sender=sender))
    for row in attempts:
        settings = settings_of[row.run_id]
        out.append(
            Outgoing(
                GENERATE,
                QUEUE_OF[GENERATE],
                row.run_id,
                _generate_body(row, settings),
                queue_timeout_seconds=settings.queue_timeout_seconds,
                sender=sender,
            )
        )
    table = Outbox.__table__
    if moot:
        session.execute(update(table).where(ids_in(table.c.id, moot)).values(sent_at=now))
    if claim_seconds is not None:
        until = now + timedelta(seconds=claim_seconds)
        claimed = [m.outbox_id for m in out if m.outbox_id is not None]
        if claimed:
            session.execute(
                update(table)
                .where(ids_in(table.c.id, claimed))
                .values(claimed_by=claimer[:200], claimed_until=until, send_count=table.c.send_count + 1)
            )
        if attempts:
            # Not due again until the claim expires: a relay that dies before `mark_sent`
            # leaves them to be sent then.
            attempts_table = Attempt.__table__
            session.execute(
                update(attempts_table)
                .where(ids_in(attempts_table.c.id, [row.id for row in attempts]))
                .values(available_at=until)
            )
    return out


def _runs(session: Session, rows: list[Any]) -> dict[int, LedgerSettings]:
    """Each run's settings, by the config hash read with the rows. Its config (kilobytes of
    JSON) is read only when this process has not parsed it yet: a run's config never changes,
    and a relay pass needs the settings of the same run or two every few tens of milliseconds."""
    table = Run.__table__
    found: dict[int, LedgerSettings] = {}
    for row in rows:
        if row.run_id in found:
            continue
        settings = cached_settings(row.run_id, row.config_hash)
        if settings is None:
            settings = settings_for(
                session.execute(
                    select(table.c.id, table.c.config_hash, table.c.config).where(table.c.id == row.run_id)
                ).one()
            )
        found[row.run_id] = settings
    return found


def _due_attempts(
    session: Session, now: datetime, limit: int, ids: list[int] | None, run_id: int | None
) -> list[Any]:
    """Pending attempts of running runs, due by `now`, with their prompts, locked (skipping
    those another transaction holds), in id order: by `ids`, by run, or any."""
    if limit <= 0:
        return []
    sql_now, clock = _clock(now)
    params: dict[str, Any] = {"limit": limit, **clock}
    if ids is not None:
        params["ids"] = ids
    if run_id is not None:
        params["run_id"] = run_id
    return driver.rows(session, _due_attempts_statement(ids is not None, run_id is not None, sql_now), params)


@cache
def _due_attempts_statement(by_ids: bool, by_run: bool, sql_now: bool) -> Any:
    """`_due_attempts`' statement for the filters it is given, built once (see `sql.Query`)."""
    attempts, prompts, runs = Attempt.__table__, Prompt.__table__, Run.__table__
    if by_run:
        # The run's row read once (two InitPlans), not joined: in the plan that keeps the
        # attempts' id order (the only one that reads no more than it sends), a join looked the
        # run up again for every attempt.
        def of_run(column: Any) -> Any:
            return select(column).where(runs.c.id == bindparam("run_id")).scalar_subquery()

        status, config_hash = of_run(runs.c.status), of_run(runs.c.config_hash)
    else:
        status, config_hash = runs.c.status, runs.c.config_hash
    query = (
        select(
            attempts.c.id,
            attempts.c.run_id,
            attempts.c.min_weight_version,
            prompts.c.text,
            cast(prompts.c.row, Text).label("row"),
            status.label("run_status"),
            config_hash.label("config_hash"),
        )
        .join(prompts, prompts.c.id == attempts.c.prompt_id)
        .where(attempts.c.available_at <= _now(sql_now), status == literal(_RUNNING))
        .order_by(attempts.c.id)
        .limit(bindparam("limit"))
        # NO KEY UPDATE, as every other lock on an attempt: `mark_sent` updates no key.
        .with_for_update(key_share=True, skip_locked=True, of=attempts)
    )
    if by_run:
        query = query.where(attempts.c.run_id == bindparam("run_id"))
    else:
        query = query.join(runs, runs.c.id == attempts.c.run_id)
    if by_ids:
        # By key only: the state as an expression, not the column, so that PostgreSQL does not
        # AND a scan of a partial index of pending attempts (a whole step's, on a new run's
        # statistics, which count none) with the key lookups.
        return query.where(ids_param(attempts.c.id, "ids"), attempts.c.state.concat("") == literal(_PENDING))
    # `state = 'pending'` written out: the predicate of `ix_attempts_unsent` (run, id), which
    # serves a run's pass in id order, and a pass over every run (a bench's, a test's).
    return query.where(attempts.c.state == literal(_PENDING))


def _due_rows(session: Session, now: datetime, limit: int, only: ToSend | None, run_id: int | None) -> list[Any]:
    """Unsent, due, unclaimed train_step rows (by id, by run or any), locked, with their runs'
    status and config hash."""
    sql_now, clock = _clock(now)
    params: dict[str, Any] = {"limit": limit, **clock}
    if only is not None:
        params["ids"] = list(only.outbox_ids)
    if run_id is not None:
        params["run_id"] = run_id
    # Plain rows, not ORM objects: the ORM's per-object bookkeeping cost more than the SQL.
    return driver.rows(session, _due_statement(only is not None, run_id is not None, sql_now), params)


@cache
def _due_statement(by_ids: bool, by_run: bool, sql_now: bool) -> Any:
    """`_due_rows`' statement for the filters it is given, built once (see `sql.Query`)."""
    table, runs = Outbox.__table__, Run.__table__
    now = _now(sql_now)
    query = (
        select(
            table.c.id,
            table.c.run_id,
            table.c.kind,
            table.c.payload,
            runs.c.status.label("run_status"),
            runs.c.config_hash,
        )
        .join(runs, runs.c.id == table.c.run_id)
        .where(
            table.c.sent_at.is_(None),
            table.c.available_at <= now,
            or_(table.c.claimed_until.is_(None), table.c.claimed_until < now),
        )
        .order_by(table.c.id)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True, of=table)
    )
    if by_ids:
        query = query.where(ids_param(table.c.id, "ids"))
    if by_run:
        query = query.where(table.c.run_id == bindparam("run_id"))
    return query


def _within_room(rows: list[Any], room: dict[int, int]) -> list[Any]:
    """The attempts a pass may send: each run's first ones up to its room. The others stay
    pending for a later pass."""
    left = dict(room)
    out = []
    for row in rows:
        if left.get(row.run_id, 0) <= 0:
            continue
        left[row.run_id] -= 1
        out.append(row)
    return out


#: The first key of the advisory lock a metering relay takes per run (the second is the run).
_METER_LOCK = 0x5EF1


def queued_window(share: float, queued_per_share: int) -> int:
    """How many of a run's attempts may wait on the broker: its share of the window, at least 1."""
    return max(1, round(share * queued_per_share))


def queue_room(session: Session, run_ids: Iterable[int], queued_per_share: int) -> dict[int, int]:
    """How many more attempts each run may have queued on the broker now.

    Why this gives each run its share of the workers without a scheduler: the broker's queue is
    FIFO and holds about `queued_window` attempts of each run that has work; each time a worker
    takes one, the relay sends another of the same run to the back. The queue's mix of runs is
    therefore the windows' ratio, and so is the rate at which workers take each run's attempts.
    A run with nothing to send leaves its room to the others (nothing is reserved).

    Two relays metering one run at once would both see the same room; on PostgreSQL a relay
    takes a per-run advisory lock for its transaction and a run locked by another relay gets no
    room this pass (that relay is sending its rows; the controller's next pass comes soon).
    """
    wanted = sorted(set(run_ids))
    if not wanted:
        return {}
    found = _run_queues(session, wanted)
    # A run that is not running sends nothing (the relay reads only running runs' attempts).
    room = {run: 0 for run in wanted if found.get(run, ("",))[0] != _RUNNING}
    metered = [run for run in wanted if run not in room]
    if not metered:
        return room
    shares = run_shares(session, metered, hashes={run: found[run][1] for run in metered})
    for run in metered:
        _, _, locked, queued = found[run]
        room[run] = queued_window(shares[run], queued_per_share) - queued if locked else 0
    return room


def _run_queues(session: Session, run_ids: list[int]) -> dict[int, tuple[str, str, bool, int]]:
    """Each run's status and config hash, whether this transaction holds its metering lock
    (taken here for a running run, without waiting; PostgreSQL only) and its attempts queued
    on the broker: one statement for all four."""
    if session.get_bind().dialect.name != "postgresql":
        runs = Run.__table__.alias("r")
        queued = (
            select(func.count())
            .where(Attempt.__table__.c.run_id == runs.c.id, Attempt.__table__.c.state == literal(AttemptState.QUEUED.value))
            .scalar_subquery()
        )
        rows = session.execute(
            select(runs.c.id, runs.c.status, runs.c.config_hash, queued).where(ids_in(runs.c.id, run_ids))
        ).all()
        return {run: (status, config_hash, True, int(count)) for run, status, config_hash, count in rows}
    rows = session.execute(
        text(
            "SELECT r.id, r.status, r.config_hash, "
            "CASE WHEN r.status = 'running' THEN pg_try_advisory_xact_lock(:key, r.id) ELSE false END, "
            "(SELECT count(*) FROM attempts a WHERE a.run_id = r.id AND a.state = 'queued') "
            "FROM runs r WHERE r.id = ANY(CAST(:runs AS integer[])) ORDER BY r.id"
        ),
        {"key": _METER_LOCK, "runs": run_ids},
    ).all()
    return {run: (status, config_hash, bool(locked), int(count)) for run, status, config_hash, locked, count in rows}


#: (run id, config hash) -> run.share; a run's config never changes. Bounded: a process that
#: drives runs for months must not keep one entry per run it ever saw.
_shares: dict[tuple[int, str], float] = {}
_SHARES_KEPT = 4096


def run_shares(session: Session, run_ids: Iterable[int], *, hashes: Mapping[int, str] | None = None) -> dict[int, float]:
    """Each run's `run.share`, read from its stored config once per process. `hashes`: the
    runs' config hashes, when the caller has read them."""
    wanted = list(run_ids)
    if hashes is None:
        hashes = dict(session.execute(select(Run.id, Run.config_hash).where(ids_in(Run.id, wanted))).all())
    missing = [run for run in wanted if (run, hashes.get(run)) not in _shares]
    if missing:
        if len(_shares) > _SHARES_KEPT:
            _shares.clear()
        for run, config_hash, config in session.execute(
            select(Run.id, Run.config_hash, Run.config).where(ids_in(Run.id, missing))
        ).all():
            _shares[(run, config_hash)] = from_snapshot(config, source=f"run {run}'s stored config").run.share
    return {run: _shares[(run, hashes[run])] for run in wanted if run in hashes}


def _generate_body(row: Any, settings: LedgerSettings) -> dict[str, Any]:
    return generate_body(
        run_id=row.run_id,
        attempt_id=row.id,
        prompt=row.text,
        # The prompt's row as text, read here by the standard library as psycopg's JSONB
        # loader would (a user's row may hold an integer past 64 bits, which orjson reads as
        # a float), without the loader's per-value detour (bytes, their encoding detected).
        row=json.loads(row.row),
        n=settings.group_size,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=(settings.seed * 1_000_003 + row.id) % 2**31,
        min_weight_version=row.min_weight_version,
    )


def mark_sent(session: Session, sent: list[Outgoing], now: datetime) -> None:
    """Record that these messages reached the broker: train_step rows are sent, attempts queued."""
    if not sent:
        return
    sql_now, clock = _clock(now)
    # Both kinds of UPDATE go out together, in one round trip (`driver.execute`).
    writes: list[tuple[Any, dict[str, Any]]] = []
    # Rows claimed earlier (sender None) only become sent; the others count their send here.
    by_sender: dict[str | None, list[int]] = {}
    for message in sent:
        if message.outbox_id is not None:
            by_sender.setdefault(message.sender, []).append(message.outbox_id)
    for sender, outbox_ids in by_sender.items():
        by = {} if sender is None else {"sender": sender}
        writes.append((_mark_sent(sender is not None, sql_now), {"ids": outbox_ids, **clock, **by}))
    by_timeout: dict[float, list[int]] = {}
    for message in sent:
        if message.kind == GENERATE:
            if message.queue_timeout_seconds is None:
                raise ValueError(
                    f"generate message of attempt {message.attempt_id} has no queue timeout: "
                    "mark_sent takes the messages claim_outbox returned"
                )
            by_timeout.setdefault(message.queue_timeout_seconds, []).append(message.body["attempt_id"])
    for seconds, attempt_ids in by_timeout.items():
        # Only a pending attempt becomes queued: a fast worker may already hold its lease.
        # The fleet's relay locked them in this transaction (`claim_outbox`): no wait here.
        timeout = timedelta(seconds=seconds)
        lease = {"timeout": timeout} if sql_now else {"until": now + timeout}
        writes.append((_mark_queued(sql_now), {"ids": attempt_ids, **lease, **clock}))
    driver.execute(session, writes)


def _now(sql_now: bool) -> Any:
    """The clock in a statement built once: a parameter `now`, or the database's `now()` where
    the caller passed the ledger's clock as SQL (`ledger_now_in`)."""
    return func.now(type_=DateTime(timezone=True)) if sql_now else bindparam("now", type_=UTCDateTime())


def _clock(now: Any) -> tuple[bool, dict[str, Any]]:
    """Whether `now` is the database's `now()` (SQL, not a time), and the parameters it takes."""
    if isinstance(now, datetime):
        return False, {"now": now}
    if getattr(now, "name", None) != "now":
        raise TypeError(f"the relay's clock must be a datetime or the ledger's now(), not {now!r}")
    return True, {}


@cache
def _mark_sent(by_sender: bool, sql_now: bool) -> Any:
    """`mark_sent`'s UPDATE of outbox rows, built once (see `sql.Query`)."""
    table = Outbox.__table__
    marked = update(table).where(ids_param(table.c.id, "ids")).values(sent_at=_now(sql_now))
    return marked.values(claimed_by=bindparam("sender"), send_count=table.c.send_count + 1) if by_sender else marked


@cache
def _mark_queued(sql_now: bool) -> Any:
    """`mark_sent`'s UPDATE of the sent rows' attempts, built once."""
    attempts = Attempt.__table__
    now = _now(sql_now)
    # A time given is summed here (SQLite has no interval sum), the database's clock there.
    until = now + bindparam("timeout", type_=Interval()) if sql_now else bindparam("until", type_=UTCDateTime())
    return (
        update(attempts)
        .where(ids_param(attempts.c.id, "ids"), attempts.c.state == AttemptState.PENDING.value)
        .values(state=AttemptState.QUEUED.value, dispatched_at=now, leased_until=until)
    )
