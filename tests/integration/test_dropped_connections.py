"""A pooled connection the database dropped costs a transaction nothing: the pool's ping
finds it out on checkout (of a connection idle a while: `db._ping_when_idle`), and a connection that drops under a transaction makes
`Ledger.transaction` (and the exporter's read) run again on a fresh one. A transaction whose
process froze inside it is ended by the server, so its row locks do not outlive the freeze."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from refill.admin.exporter import read_ledger
from refill.admin.snapshot import read_snapshot
from refill.models import db
from refill.models.db import Ledger, make_engine


def _drop_connections(url: str, application_name: str) -> int:
    killer = make_engine(url)
    with killer.begin() as connection:
        killed = connection.execute(
            text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :name"),
            {"name": application_name},
        ).scalar_one()
    killer.dispose()
    return int(killed)


def test_a_transaction_on_a_dropped_connection_runs_again_on_a_fresh_one(pg_url) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(pg_url, application_name="refill-test-dropped")
    try:
        pid = ledger.transaction(lambda s: s.scalar(text("SELECT pg_backend_pid()")))
        assert _drop_connections(pg_url, "refill-test-dropped") == 1
        # The pooled connection is dead; the transaction still runs, on a fresh one.
        again = ledger.transaction(lambda s: s.scalar(text("SELECT pg_backend_pid()")))
        assert again != pid
        # The exporter's read (one retry) as well.
        ledger.transaction(lambda s: s.scalar(text("SELECT 1")))
        assert _drop_connections(pg_url, "refill-test-dropped") == 1
        runs, rejected = read_ledger(ledger, recent_minutes=60)
        assert isinstance(runs, list) and isinstance(rejected, dict)
    finally:
        ledger.dispose()


def test_a_connection_idle_in_the_pool_is_pinged_and_replaced_if_dropped_one_just_used_is_not(pg_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`db._ping_when_idle`: a connection checked out again within `PING_AFTER_IDLE_SECONDS` of
    its last use costs no ping; one idle longer is pinged, and if the server dropped it
    meanwhile, the pool hands out a fresh one: the session's first statement succeeds, with
    no transaction run again."""
    monkeypatch.setattr(db, "PING_AFTER_IDLE_SECONDS", 0.3)
    ledger = Ledger(pg_url, application_name="refill-test-idle-ping")
    pings: list[bool] = []
    ping = ledger.engine.dialect.do_ping

    def counted(dbapi_connection):  # type: ignore[no-untyped-def]
        try:
            alive = ping(dbapi_connection)
        except Exception:
            pings.append(False)
            raise
        pings.append(bool(alive))
        return alive

    monkeypatch.setattr(ledger.engine.dialect, "do_ping", counted)

    def backend() -> int:
        # A session straight from the pool, not `Ledger.transaction`: nothing runs it again.
        with ledger.sessions.begin() as session:
            return int(session.scalar(text("SELECT pg_backend_pid()")))

    try:
        first = backend()
        assert [backend() for _ in range(5)] == [first] * 5  # back to back: the same connection
        assert pings == []
        time.sleep(0.4)
        assert backend() == first and pings == [True]  # idle past the window: pinged, alive
        time.sleep(0.4)
        assert _drop_connections(pg_url, "refill-test-idle-ping") == 1
        fresh = backend()
        assert fresh != first and pings == [True, False]
    finally:
        ledger.dispose()


def test_the_server_ends_a_transaction_left_idle_and_the_admins_reads_may_think(pg_url, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    default = make_engine(pg_url)
    with default.connect() as connection:
        assert connection.execute(text("SHOW idle_in_transaction_session_timeout")).scalar_one() == f"{db.IDLE_IN_TRANSACTION_SECONDS}s"
    default.dispose()
    own = make_engine(f"{pg_url}?options=-c%20idle_in_transaction_session_timeout%3D7min")
    with own.connect() as connection:  # a URL that sets it keeps its own
        assert connection.execute(text("SHOW idle_in_transaction_session_timeout")).scalar_one() == "7min"
    own.dispose()

    monkeypatch.setattr(db, "IDLE_IN_TRANSACTION_SECONDS", 1)
    ledger = Ledger(pg_url)
    other = make_engine(pg_url)
    try:
        with ledger.engine.connect() as frozen:
            frozen.begin()
            frozen.execute(text("CREATE TEMP TABLE held (id int PRIMARY KEY)"))
            frozen.execute(text("INSERT INTO held VALUES (1)"))
            frozen.execute(text("SELECT pg_advisory_xact_lock(424242)"))
            time.sleep(2.5)  # a process frozen mid-transaction, past the timeout
            with other.connect() as connection:
                # Its locks went with its transaction: another takes the same lock at once.
                assert connection.execute(text("SELECT pg_try_advisory_lock(424242)")).scalar_one() is True
                connection.execute(text("SELECT pg_advisory_unlock(424242)"))
            with pytest.raises(DBAPIError) as ended:
                frozen.execute(text("SELECT 1"))
            assert db.is_retryable(ended.value)  # a woken holder's Ledger.transaction runs again
        # The admin's snapshot reads opt out: one may think between its queries.
        with read_snapshot(ledger) as session:
            session.execute(text("SELECT 1"))
            time.sleep(2.5)
            assert session.execute(text("SELECT 2")).scalar_one() == 2
    finally:
        ledger.dispose()
        other.dispose()
