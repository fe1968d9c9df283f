"""The ledger's clock.

Leases and time-outs are judged on one clock, the database's. A fleet's processes run on
machines whose clocks disagree (no NTP, a VM resumed from a snapshot, a container with a
skewed host): a lease a worker computed from its own clock minutes behind would be reaped at
once, and one minutes ahead would keep a dead worker's attempts for minutes. So a lease is
written, extended and judged with PostgreSQL's `now()` (the transaction's start: every row a
transaction writes carries the same time). An embedded SQLite ledger lives in one process,
whose clock is then the database's.

`utcnow` is this process's own clock: for what a process reports, never for what the ledger
decides. The fault suite shifts it (`set_clock_offset`, from `REFILL_CHAOS_CLOCK_OFFSET_SECONDS`
in refill.tasks.chaos) to prove that nothing decides on it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import DateTime, func, select
from sqlalchemy.orm import Session

_offset = timedelta(0)
#: session.info key of the clock read in the session's current transaction
_CACHE = "refill_ledger_now"


def set_clock_offset(seconds: float) -> None:
    """Shift this process's clock by `seconds` (fault injection only: a skewed machine)."""
    global _offset
    _offset = timedelta(seconds=seconds)


def utcnow() -> datetime:
    """This process's clock."""
    return datetime.now(UTC) + _offset


def ledger_now(session: Session) -> datetime:
    """The database's clock in the session's transaction (read once per transaction)."""
    if session.get_bind().dialect.name != "postgresql":
        return utcnow()
    cached = session.info.get(_CACHE)
    if cached is not None and cached[0] is session.get_transaction():
        return cached[1]
    now = session.scalar(select(func.now())).astimezone(UTC)
    # Keyed by the transaction object: now() is the same for the whole transaction, and a
    # later transaction of the same session reads it again.
    session.info[_CACHE] = (session.get_transaction(), now)
    return now


def ledger_now_in(session: Session, now: datetime | None = None) -> Any:
    """The ledger's clock for a statement to write: `now` if given (a test's, a simulation's),
    else what `ledger_now` would return, but on PostgreSQL, where the transaction has not read
    it yet, as `now()` inside the statement itself. A worker's lease handshake and heartbeat
    are one statement each: reading the clock first was a round trip of its own, a third of
    the handshake's."""
    if now is not None:
        return now
    if session.get_bind().dialect.name != "postgresql":
        return utcnow()
    cached = session.info.get(_CACHE)
    if cached is not None and cached[0] is session.get_transaction():
        return cached[1]
    # Typed as a plain timestamp: `now + timedelta` is then an interval sum, where the column
    # type's own decorator would bind the timedelta as a timestamp.
    return func.now(type_=DateTime(timezone=True))


def remember_ledger_now(session: Session, now: datetime) -> None:
    """Keep a `now()` that a statement of the current transaction already returned (the run
    lock reads it beside the run's row), so that `ledger_now` needs no round trip of its own."""
    session.info[_CACHE] = (session.get_transaction(), now.astimezone(UTC))


def ledger_up_seconds(session: Session) -> float | None:
    """Seconds since the database server last started (None where unknown: SQLite).

    A restart drops every connection: no worker could renew a lease while it was down, so a
    lease that ran out meanwhile says nothing about its worker (see leases.expire_leases)."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    return float(session.scalar(select(func.extract("epoch", func.now() - func.pg_postmaster_start_time()))))
