"""Connections to the ledger and the unit of work every ledger operation runs in.

PostgreSQL is the production ledger; SQLite is the embedded default. The differences that
matter are handled here and nowhere else:

- SQLite has one writer at a time. pysqlite would start a transaction lazily on the first
  write, so two readers could both try to upgrade and one would fail with "database is locked"
  instead of waiting; we emit `BEGIN IMMEDIATE` so a transaction takes the write lock up front
  and waits for it (busy_timeout).
- PostgreSQL serialises writers of one run with `SELECT ... FOR NO KEY UPDATE` on the run row
  (`lock_run`), which SQLite does not need.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine, bindparam, create_engine, event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from refill.models import driver
from refill.models.clock import remember_ledger_now
from refill.models.column_types import json_text
from refill.models.tables import Run

log = logging.getLogger(__name__)

T = TypeVar("T")

#: SQLSTATEs after which the whole transaction can simply run again.
_RETRYABLE_SQLSTATES = {
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "57P01",  # admin_shutdown (pg_terminate_backend)
    "08000",
    "08003",
    "08006",  # connection exceptions
    "25P03",  # idle_in_transaction_session_timeout: the server ended a frozen transaction
}


#: How long PostgreSQL lets a ledger connection sit idle inside a transaction (`make_engine`).
IDLE_IN_TRANSACTION_SECONDS = 15

#: How long a new PostgreSQL connection may take to be established (libpq's `connect_timeout`;
#: its own default waits forever). A fleet process that gives up tries again (`PatientLedger`).
CONNECT_TIMEOUT_SECONDS = 10

#: A pooled PostgreSQL connection idle in the pool longer than this is pinged before it is
#: handed out (`_ping_when_idle`); one back within it was in use a moment ago.
PING_AFTER_IDLE_SECONDS = 0.5


def redact(url: str) -> str:
    """A URL fit for logs and terminals: the password, if any, replaced by ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a malformed URL must still never print its secret
        return "<unparseable URL>"


def make_engine(url: str, *, echo: bool = False, application_name: str | None = None) -> Engine:
    """An Engine for the ledger at `url` (a SQLAlchemy URL). On PostgreSQL, `application_name`
    names this process's connections in pg_stat_activity (an operator sees which role holds
    what; the fault tests terminate one role's connections)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        in_memory = parsed.database in (None, "", ":memory:")
        engine = create_engine(
            url,
            echo=echo,
            json_serializer=json_text,
            connect_args={"check_same_thread": False, "timeout": 60},
            # The embedded runner uses the ledger from several threads.
            **({} if in_memory else {"pool_size": 8, "max_overflow": 8}),
        )
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        # Plain postgresql:// would pick psycopg2, which refill does not depend on.
        parsed = parsed.set(drivername="postgresql+psycopg")
    connect_args: dict[str, str] = {"application_name": application_name[:63]} if application_name else {}
    # A process frozen inside a transaction (a VM paused, SIGSTOP, a partition) keeps its row
    # locks until the server ends the transaction: a worker frozen mid-heartbeat would stall
    # every batch that touches its attempt, under the run's lock, for as long as it sleeps.
    # The server ends a transaction idle this long (the holder's `Ledger.transaction` runs it
    # again if it wakes). The fleet's transactions are milliseconds between statements; the
    # admin's long reads opt out (`admin/snapshot.py`); a URL that sets it keeps its own.
    options = str(parsed.query.get("options") or "")
    # libpq waits for a connection without end by default: a server that accepts and never
    # answers (a hung host, a half-open proxy) held `refill runs` and any worker's next
    # transaction forever. A URL that sets it keeps its own.
    if "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = str(CONNECT_TIMEOUT_SECONDS)
    if "idle_in_transaction_session_timeout" not in options:
        connect_args["options"] = f"{options} -c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_SECONDS}s".strip()
    engine = create_engine(
        parsed,
        echo=echo,
        # psycopg's JSON dumper on this engine's connections too.
        json_serializer=json_text,
        # Each fleet process needs few connections (the consumer commits in groups); a fleet
        # of dozens of processes must fit PostgreSQL's max_connections.
        pool_size=5,
        max_overflow=10,
        pool_recycle=1800,
        connect_args=connect_args,
    )
    _ping_when_idle(engine)
    return engine


_IDLE_SINCE = "refill_idle_since"


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection on checkout when it sat in the pool longer than
    `PING_AFTER_IDLE_SECONDS`, and replace it if the server dropped it (a restart, a
    terminated backend): SQLAlchemy's `pool_pre_ping`, but not for a connection checked in a
    moment ago.

    Every write survives a dropped connection without a ping (`Ledger.transaction` runs it
    again), but the fault suite's PostgreSQL restart once saw workers' first heartbeats after
    it come too late and 11 leases reaped (stop 28), so idle connections are still pinged. A
    ping is a round trip, and a consumer's batches, a relay's passes and a worker's lease
    handshakes check a connection out again within milliseconds: pinged on every checkout,
    each of their transactions paid one more round trip for a connection it had just used
    (HikariCP's `aliveBypassWindowMs` is the same trade)."""
    dialect = engine.dialect

    @event.listens_for(engine, "connect")
    def _connected(dbapi_connection, record):  # type: ignore[no-untyped-def]
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection, record):  # type: ignore[no-untyped-def]
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection, record, proxy):  # type: ignore[no-untyped-def]
        if time.monotonic() - record.info.get(_IDLE_SINCE, 0.0) <= PING_AFTER_IDLE_SECONDS:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            if dialect.is_disconnect(error, dbapi_connection, None):
                # The pool drops this connection and checks out a fresh one (three tries).
                raise DisconnectionError(f"pooled connection dropped while idle: {error}") from error
            raise


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        # Let SQLAlchemy, not pysqlite, decide when transactions begin (see module doc).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):  # type: ignore[no-untyped-def]
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def is_retryable(error: BaseException) -> bool:
    """True for failures after which re-running the whole transaction is safe and useful."""
    if isinstance(error, DBAPIError) and error.connection_invalidated:
        return True
    orig = getattr(error, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in _RETRYABLE_SQLSTATES:
        return True
    if isinstance(error, OperationalError):
        message = str(orig or error).lower()
        return any(
            s in message
            for s in ("database is locked", "server closed the connection", "connection", "terminating")
        )
    return False


class Ledger:
    """The ledger's connection and unit of work.

    `ledger.transaction(fn)` runs `fn(session)` in one transaction and commits, retrying the
    whole function on deadlocks, serialisation failures and dropped connections; everything
    fn does is therefore either applied once or not at all.
    """

    #: The longest pause between two tries of a transaction: the pause doubles from 50 ms up to
    #: it, each drawn between the delay and twice it (a fleet process's is shorter: PatientLedger).
    max_retry_delay = 2.0

    def __init__(self, url: str, *, engine: Engine | None = None, application_name: str | None = None) -> None:
        self.url = url
        self.engine = engine or make_engine(url, application_name=application_name)
        self.dialect = self.engine.dialect.name
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def __repr__(self) -> str:
        return f"Ledger({redact(self.url)})"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction (commit on success, rollback on error); no retry."""
        with self.sessions.begin() as session:
            yield session

    def transaction(
        self, fn: Callable[[Session], T], *, attempts: int = 8, what: str = "ledger write"
    ) -> T:
        delay = 0.05
        for attempt in range(1, attempts + 1):
            try:
                with self.sessions.begin() as session:
                    return fn(session)
            except (OperationalError, DBAPIError) as error:
                if attempt == attempts or not is_retryable(error):
                    raise
                log.warning(
                    "%s failed (%s); retrying (%d/%d)",
                    what,
                    type(getattr(error, "orig", error)).__name__,
                    attempt,
                    attempts,
                )
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, self.max_retry_delay)
        raise AssertionError("unreachable")

    def dispose(self) -> None:
        self.engine.dispose()


#: Built once: every transaction that changes a run starts with it.
_LOCK_RUN = (
    select(Run.__table__, func.now().label("refill_now"))
    .where(Run.__table__.c.id == bindparam("run_id"))
    .with_for_update(key_share=True)
)


def lock_run(session: Session, run_id: int) -> Mapping[str, Any]:
    """Read a run's row (its columns, as a mapping) and hold its lock until the transaction
    ends.

    Every write that changes a run's scheduling state goes through here first, so decisions
    over its slots, spare pool and counters see a consistent snapshot and never interleave.
    """
    runs = Run.__table__
    if session.get_bind().dialect.name != "postgresql":
        row = session.execute(select(runs).where(runs.c.id == run_id).with_for_update()).mappings().first()
        if row is None:
            raise UnknownRun(run_id)
        return row
    # The database's clock comes with the row: every locked transaction decides on it
    # (models/clock.py), and reading it here saves that transaction a round trip.
    # FOR NO KEY UPDATE: it excludes the other holders of this lock as FOR UPDATE would, but
    # not the key-share locks that other transactions' foreign-key checks take on the run's
    # row (another transaction's insert of a row that names the run), which would otherwise queue
    # behind every batch and could close a deadlock with it.
    found = driver.rows(session, _LOCK_RUN, {"run_id": run_id})
    if not found:
        raise UnknownRun(run_id)
    row = found[0]._asdict()
    remember_ledger_now(session, row["refill_now"])
    return row


class UnknownRun(LookupError):
    def __init__(self, run_id: int) -> None:
        super().__init__(f"there is no run {run_id} in this ledger")
        self.run_id = run_id
