"""The outbox relay's side of the ledger: claim unsent messages, build them, mark them sent.

Rows are written in the same transaction as the decision that needs them (SPEC §2) and sent at
least once: a relay that dies after publishing and before `mark_sent` leaves the row unsent
(the fleet's relay: its transaction rolls back; one that committed a claim first: when the
claim expires), the row is sent again, and the receivers ignore the repeat (a generate
message for an attempt that is no longer pending is skipped by the worker's lease handshake;
a train_step for a trained step is a no-op).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import DateTime, Interval, bindparam, case, delete, func, or_, select, text, update
from sqlalchemy.orm import Session

from refill.config import from_snapshot
from refill.models import driver
from refill.models.column_types import UTCDateTime
from refill.models.payload import GenerateMessage
from refill.models.settings import LedgerSettings, cached_settings, settings_for
from refill.models.sql import ids_in, ids_param, literal_in
from refill.models.tables import (
    Attempt,
    AttemptState,
    Outbox,
    OutboxKind,
    Prompt,
    Run,
    RunStatus,
)

QUEUE_OF = {OutboxKind.GENERATE.value: "generate", OutboxKind.TRAIN_STEP.value: "train"}


@dataclass(frozen=True)
class Outgoing:
    outbox_id: int
    kind: str
    queue: str
    run_id: int
    body: dict[str, Any]
    #: a generate message's: how long its attempt may wait on the broker, queued, before the
    #: reaper sends it again (the run's `infra.queue_timeout_seconds`); set by `claim_outbox`,
    #: read by `mark_sent`
    queue_timeout_seconds: float | None = None
    #: who sends it, when `claim_outbox` wrote no claim for it (`claim_seconds=None`):
    #: `mark_sent` records the sender and counts the send with the row's `sent_at`
    sender: str | None = None


def claim_outbox(
    session: Session,
    *,
    claimer: str,
    now: datetime,
    limit: int = 500,
    claim_seconds: float | None = 30.0,
    ids: list[int] | None = None,
    run_id: int | None = None,
    queued_per_share: int | None = None,
) -> list[Outgoing]:
    """Claim up to `limit` due, unsent rows and return the messages to publish.

    Rows whose message no longer makes sense (the attempt was cancelled, the run ended) are
    marked sent without a message, so the outbox drains.

    The claim (`claimed_by`, `claimed_until`, `send_count`) is for a relay that publishes
    outside this transaction: if it dies before `mark_sent`, the rows are claimable again when
    the claim expires. A relay that marks the rows sent in this same transaction (the fleet's,
    `refill.tasks.relay`) passes `claim_seconds=None`: its row locks already keep other relays
    off the rows, a rollback frees them at once, and `mark_sent` writes the claim's columns with
    `sent_at` (one UPDATE of the rows, not two).

    With `queued_per_share`, generate rows are metered: a run keeps at most
    `queued_per_share * run.share` attempts queued on the broker (sent, not yet taken by a
    worker), and its other rows wait, unclaimed, for a later pass. Workers take messages in
    the order they were sent, so runs that all have work get the workers in proportion to
    their shares (see `queue_room`).
    """
    table = Outbox.__table__
    if queued_per_share is None:
        rows = _due_rows(session, now, limit, ids=ids, run_id=run_id)
    elif run_id is not None:
        # Ask only for what the run may send: a metered run can have hundreds of rows waiting,
        # and the controller's relay passes every few tens of milliseconds.
        rows = _due_rows(session, now, limit, ids=ids, run_id=run_id, kind=OutboxKind.TRAIN_STEP.value)
        room = queue_room(session, [run_id], queued_per_share).get(run_id, 0)
        if room > 0:
            rows += _due_rows(
                session, now, min(limit, room), ids=ids, run_id=run_id, kind=OutboxKind.GENERATE.value
            )
        rows.sort(key=lambda row: row.id)
    else:
        rows = _due_rows(session, now, limit, ids=ids)
        metered = {row.run_id for row in rows if row.kind == OutboxKind.GENERATE.value}
        known = {row.run_id: (row.run_status, row.config_hash) for row in rows}
        rows = _within_room(rows, queue_room(session, metered, queued_per_share, known=known) if metered else {})
    if not rows:
        return []
    runs = _runs(session, rows)
    attempts, busy = _sendable_attempts(session, [row.attempt_id for row in rows if row.attempt_id is not None])
    out: list[Outgoing] = []
    moot: list[int] = []
    for row in rows:
        status, settings = runs[row.run_id]
        if row.attempt_id in busy and status == RunStatus.RUNNING.value:
            continue
        body = _body(row, row.run_id, status, settings, attempts)
        if body is None:
            moot.append(row.id)
            continue
        out.append(
            Outgoing(
                row.id,
                row.kind,
                QUEUE_OF[row.kind],
                row.run_id,
                body,
                settings.queue_timeout_seconds,
                sender=claimer[:200] if claim_seconds is None else None,
            )
        )
    if moot:
        session.execute(update(table).where(ids_in(table.c.id, moot)).values(sent_at=now))
    if out and claim_seconds is not None:
        session.execute(
            update(table)
            .where(ids_in(table.c.id, [m.outbox_id for m in out]))
            .values(
                claimed_by=claimer[:200],
                claimed_until=now + timedelta(seconds=claim_seconds),
                send_count=table.c.send_count + 1,
            )
        )
    return out


def _runs(session: Session, rows: list[Any]) -> dict[int, tuple[str, LedgerSettings]]:
    """Each run's status and settings, from the status and config hash `_due_rows` read with the
    rows. Its config (kilobytes of JSON) is read only when this process has not parsed it yet:
    a run's config never changes, and a relay pass needs the settings of the same run or two
    every few tens of milliseconds."""
    table = Run.__table__
    found: dict[int, tuple[str, LedgerSettings]] = {}
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
        found[row.run_id] = (row.run_status, settings)
    return found


def _sendable_attempts(session: Session, attempt_ids: list[int]) -> tuple[dict[int, Any], set[int]]:
    """The attempts (with their prompts) whose messages may go out, locked now, and those busy.

    Locked without waiting: `mark_sent` updates them, and a relay that waited there for an
    attempt a consumer's batch held, holding others the batch then wanted, deadlocked with it.
    An attempt that is pending or queued but locked by another transaction is busy: its row
    stays unclaimed for a later pass (the batch is changing that attempt; the row may be moot
    by then). Any other attempt's message is moot. The states of the attempts the locked read
    did not return are read only when there are such (a cancellation, a busy row: rare)."""
    if not attempt_ids:
        return {}, set()
    attempts_table = Attempt.__table__
    sendable_states = (AttemptState.PENDING.value, AttemptState.QUEUED.value)
    found = {row.id: row for row in driver.rows(session, _SENDABLE, {"ids": attempt_ids})}
    others = [attempt for attempt in attempt_ids if attempt not in found]
    busy: set[int] = set()
    if others:
        busy = set(
            session.scalars(
                select(attempts_table.c.id).where(
                    ids_in(attempts_table.c.id, others), literal_in(attempts_table.c.state, sendable_states)
                )
            ).all()
        )
    return found, busy


_SENDABLE = (
    select(Attempt.__table__.c.id, Attempt.__table__.c.min_weight_version, Prompt.__table__.c.text, Prompt.__table__.c.row)
    .join(Prompt.__table__, Prompt.__table__.c.id == Attempt.__table__.c.prompt_id)
    .where(
        ids_param(Attempt.__table__.c.id, "ids"),
        # The state as an expression, not the column: `state IN ('pending', 'queued')` names the
        # predicate of the partial index of live attempts, and on a new run's statistics (which
        # count none) PostgreSQL ANDed a scan of that whole index, every live attempt of the
        # run (7,000 at a 4096-slot step, `bench overhead` under auto_explain), with the key
        # lookups on every relay pass, and planned the prompts' join for one row. By key only.
        literal_in(Attempt.__table__.c.state.concat(""), (AttemptState.PENDING.value, AttemptState.QUEUED.value)),
    )
    .order_by(Attempt.__table__.c.id)
    .with_for_update(key_share=True, skip_locked=True, of=Attempt.__table__)
)


def _due_rows(
    session: Session,
    now: datetime,
    limit: int,
    *,
    ids: list[int] | None = None,
    run_id: int | None = None,
    kind: str | None = None,
) -> list[Any]:
    sql_now, clock = _clock(now)
    params: dict[str, Any] = {"limit": limit, **clock}
    if ids is not None:
        params["ids"] = ids
    if run_id is not None:
        params["run_id"] = run_id
    if kind is not None:
        params["kind"] = kind
    # Plain rows, not ORM objects, and one UPDATE per kind of change below: a relay pass
    # handles up to `limit` rows, and the ORM's per-object bookkeeping cost more than the SQL.
    return driver.rows(session, _due_statement(ids is not None, run_id is not None, kind is not None, sql_now), params)


@cache
def _due_statement(by_ids: bool, by_run: bool, by_kind: bool, sql_now: bool) -> Any:
    """`_due_rows`' statement for the filters it is given, built once (see `sql.Query`)."""
    table, runs = Outbox.__table__, Run.__table__
    now = _now(sql_now)
    query = (
        select(
            table.c.id,
            table.c.run_id,
            table.c.kind,
            table.c.attempt_id,
            # A generate row's payload is `{}` (its message is built from its attempt): parsing
            # it was a JSON decode per message.
            case((table.c.kind == OutboxKind.TRAIN_STEP.value, table.c.payload)).label("payload"),
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
    if by_kind:
        query = query.where(table.c.kind == bindparam("kind"))
    return query


def _within_room(rows: list[Any], room: dict[int, int]) -> list[Any]:
    """The rows a pass may send: every train_step row, and each run's first generate rows up
    to its room. The others stay unclaimed for a later pass."""
    left = dict(room)
    out = []
    for row in rows:
        if row.kind == OutboxKind.GENERATE.value:
            if left.get(row.run_id, 0) <= 0:
                continue
            left[row.run_id] -= 1
        out.append(row)
    return out


#: The first key of the advisory lock a metering relay takes per run (the second is the run).
_METER_LOCK = 0x5EF1
#: The room of a run that is not metered (not running: its rows are moot and drain).
UNMETERED = 2**31 - 1


def queued_window(share: float, queued_per_share: int) -> int:
    """How many of a run's attempts may wait on the broker: its share of the window, at least 1."""
    return max(1, round(share * queued_per_share))


def queue_room(
    session: Session,
    run_ids: Iterable[int],
    queued_per_share: int,
    *,
    known: Mapping[int, tuple[str, str]] | None = None,
) -> dict[int, int]:
    """How many more attempts each run may have queued on the broker now. `known`: runs'
    (status, config hash) already read (with the due rows); the others are read here.

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
    runs = dict(known or {})
    missing = [run for run in wanted if run not in runs]
    if missing:
        table = Run.__table__
        runs.update(
            (run, (status, config_hash))
            for run, status, config_hash in session.execute(
                select(table.c.id, table.c.status, table.c.config_hash).where(ids_in(table.c.id, missing))
            ).all()
        )
    # A run that is not running sends nothing: its rows are drained as moot, without room.
    room = {run: UNMETERED for run in wanted if runs.get(run, ("", ""))[0] != RunStatus.RUNNING.value}
    metered = [run for run in wanted if run not in room]
    if not metered:
        return room
    shares = run_shares(session, metered, hashes={run: runs[run][1] for run in metered})
    for run, (locked, queued) in _queued_if_locked(session, metered).items():
        room[run] = queued_window(shares[run], queued_per_share) - queued if locked else 0
    return room


def _queued_if_locked(session: Session, run_ids: list[int]) -> dict[int, tuple[bool, int]]:
    """Each run's attempts queued on the broker, and whether this transaction holds the run's
    metering lock (taken here, without waiting; PostgreSQL only): one statement for both."""
    if session.get_bind().dialect.name != "postgresql":
        queued = dict(
            session.execute(
                select(Attempt.run_id, func.count())
                .where(literal_in(Attempt.run_id, run_ids), Attempt.state == AttemptState.QUEUED.value)
                .group_by(Attempt.run_id)
            ).all()
        )
        return {run: (True, int(queued.get(run, 0))) for run in run_ids}
    found = session.execute(
        text(
            "SELECT r.id, pg_try_advisory_xact_lock(:key, r.id), "
            "(SELECT count(*) FROM attempts a WHERE a.run_id = r.id AND a.state = 'queued') "
            "FROM unnest(CAST(:runs AS integer[])) AS r(id) ORDER BY r.id"
        ),
        {"key": _METER_LOCK, "runs": run_ids},
    ).all()
    return {run: (bool(locked), int(queued)) for run, locked, queued in found}


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


def prune_relayed(session: Session, run_id: int, before: datetime, *, chunk: int = 20_000) -> int:
    """Delete up to `chunk` of a run's generate rows relayed before `before`; returns how many.

    A sent generate row has done its work: its attempt's state says where the attempt is, and
    nothing reads the row again (a re-dispatch writes a new row). Train_step rows stay: the
    reaper and `refill check` read them, and there is one per step. Without this the outbox
    keeps a row for every attempt a run ever made.
    """
    table = Outbox.__table__
    doomed = (
        select(table.c.id)
        .where(
            table.c.run_id == run_id,
            table.c.kind == OutboxKind.GENERATE.value,
            table.c.sent_at.is_not(None),
            table.c.sent_at < before,
        )
        .order_by(table.c.id)
        .limit(chunk)
    )
    result = session.execute(delete(table).where(table.c.id.in_(doomed.scalar_subquery())))
    return int(result.rowcount or 0)


def _body(
    row: Any, run_id: int, status: str, settings: LedgerSettings, attempts: dict[int, Any]
) -> dict[str, Any] | None:
    if status != RunStatus.RUNNING.value:
        return None
    if row.kind == OutboxKind.TRAIN_STEP.value:
        return dict(row.payload)
    found = attempts.get(row.attempt_id or -1)
    if found is None:  # neither pending nor queued any more
        return None
    return GenerateMessage(
        run_id=run_id,
        attempt_id=found.id,
        prompt=found.text,
        row=found.row,
        n=settings.group_size,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=(settings.seed * 1_000_003 + found.id) % 2**31,
        min_weight_version=found.min_weight_version,
    ).to_json()


def mark_sent(session: Session, sent: list[Outgoing], now: datetime) -> None:
    """Record that these messages reached the broker; their attempts are now queued."""
    if not sent:
        return
    # Rows claimed earlier (sender None) only become sent; the others count their send here.
    by_sender: dict[str | None, list[int]] = {}
    for message in sent:
        by_sender.setdefault(message.sender, []).append(message.outbox_id)
    sql_now, clock = _clock(now)
    # Both kinds of UPDATE go out together, in one round trip (`driver.execute`).
    writes: list[tuple[Any, dict[str, Any]]] = []
    for sender, outbox_ids in by_sender.items():
        by = {} if sender is None else {"sender": sender}
        writes.append((_mark_sent(sender is not None, sql_now), {"ids": outbox_ids, **clock, **by}))
    by_timeout: dict[float, list[int]] = {}
    for message in sent:
        if message.kind == OutboxKind.GENERATE.value:
            if message.queue_timeout_seconds is None:
                raise ValueError(
                    f"generate message of outbox row {message.outbox_id} has no queue timeout: "
                    "mark_sent takes the messages claim_outbox returned"
                )
            by_timeout.setdefault(message.queue_timeout_seconds, []).append(message.body["attempt_id"])
    for seconds, attempt_ids in by_timeout.items():
        # Only a pending attempt becomes queued: a fast worker may already hold its lease.
        # `claim_outbox` locked their rows in this transaction (the relay's way): no wait here.
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
