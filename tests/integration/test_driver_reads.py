"""Reads run on psycopg directly (`models/driver.py:rows`): the same rows as SQLAlchemy's
execution, on either ledger, with what SQLAlchemy's execution gives its callers (listeners,
its errors, the session's transaction and autoflush)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from sqlalchemy import bindparam, event, func, literal_column, select, text, update
from sqlalchemy.exc import DBAPIError

from refill.models import driver
from refill.models.clock import utcnow
from refill.models.column_types import json_text, read_json
from refill.models.db import lock_run
from refill.models.sql import ids_param, literal, literal_in
from refill.models.tables import Attempt, Outbox, Run, RunStatus
from tests.support.databases import backend_seen
from tests.support.driver import Driver

_attempts, _outbox, _runs = Attempt.__table__, Outbox.__table__, Run.__table__

#: Built once, as the ledger's reads are: a timestamp, a float, JSON, a nullable column, an
#: array parameter, an expanding list and a label.
_READ = (
    select(
        _attempts.c.id,
        _attempts.c.created_at,
        _attempts.c.reward_mean,
        _attempts.c.state,
        _attempts.c.slot_idx,
        (_attempts.c.try_no + 1).label("next_try"),
    )
    .where(ids_param(_attempts.c.id, "ids"), _attempts.c.slot_idx.in_(bindparam("slots", expanding=True)))
    .order_by(_attempts.c.id)
)
#: Constants written into the SQL (`sql.literal`, `sql.literal_in`): written in once, at compile.
_LIVE_OF_RUN = (
    select(_attempts.c.id, _attempts.c.state)
    .where(_attempts.c.run_id == bindparam("run_id"), literal_in(_attempts.c.state, ("pending", "queued")), _attempts.c.reason != literal("none"))
    .order_by(_attempts.c.id)
)
#: A percent sign in the SQL, and a parameter named twice: sent with PostgreSQL's own
#: placeholders, one number per name (`driver._numbered`).
_PERCENT = (
    select(_attempts.c.id, literal_column("'50%'").label("share"), (_attempts.c.run_id + bindparam("run_id")).label("twice"))
    .where(_attempts.c.run_id == bindparam("run_id"), _attempts.c.state.like(literal("pend%")))
    .order_by(_attempts.c.id)
)
_RUN = select(_runs.c.id, _runs.c.config, _runs.c.status, func.now().label("refill_now")).where(_runs.c.id == bindparam("run_id"))


def test_a_read_on_the_driver_returns_what_sqlalchemy_returns(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    live_attempts = d.live()
    first = sorted(live_attempts, key=lambda a: a.id)[:5]
    params = {"ids": [a.id for a in first], "slots": [a.slot_idx for a in first[:3]]}
    with ledger.session() as session:
        expected = session.execute(_READ, params).all()
        found = driver.rows(session, _READ, params)
        assert [tuple(row) for row in found] == [tuple(row) for row in expected]
        # Only the attempts of the listed slots (the first five may share a slot across steps).
        assert 3 <= len(found) < 5 and {r.slot_idx for r in found} == set(params["slots"])
        row = found[0]
        assert (row.id, row.state, row.next_try) == (first[0].id, first[0].state, first[0].try_no + 1)
        # Read back timezone-aware on both ledgers (UTCDateTime's result processor).
        assert isinstance(row.created_at, datetime) and row.created_at.tzinfo is not None
        assert row.reward_mean is None
        run = driver.rows(session, _RUN, {"run_id": d.run_id})
        assert run[0].config == session.execute(_RUN, {"run_id": d.run_id}).one().config
        assert isinstance(run[0].config, dict) and run[0].status == RunStatus.RUNNING.value
        # Another parameter set of the same statement: a longer expanding list.
        again = driver.rows(session, _READ, {**params, "slots": [a.slot_idx for a in first]})
        assert [r.id for r in again] == [a.id for a in first]
        live = driver.rows(session, _LIVE_OF_RUN, {"run_id": d.run_id})
        assert live == session.execute(_LIVE_OF_RUN, {"run_id": d.run_id}).all()
        percent = driver.rows(session, _PERCENT, {"run_id": d.run_id})
        assert percent == session.execute(_PERCENT, {"run_id": d.run_id}).all()
        assert percent and {(row.share, row.twice) for row in percent} == {("50%", 2 * d.run_id)}
        assert len(live) == len(live_attempts) and {r.state for r in live} <= {"pending", "queued"}
    if ledger.engine.dialect.name == "postgresql":
        # Its text fixed once; a statement with a list given per execution is written each time.
        assert driver._compiled(_LIVE_OF_RUN, ledger.engine.dialect).fixed is not None
        assert driver._compiled(_READ, ledger.engine.dialect).fixed is None


def test_a_read_on_the_driver_is_seen_by_listeners_and_fails_as_sqlalchemy_does(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    seen: list[str] = []

    def listen(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append(statement)

    d = Driver(pg_ledger)
    event.listen(pg_ledger.engine, "before_cursor_execute", listen)
    try:
        with pg_ledger.session() as session:
            driver.rows(session, _RUN, {"run_id": d.run_id})
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", listen)
    assert len(seen) == 1 and "FROM runs" in seen[0]

    broken = select(text("1 / 0"))
    with pg_ledger.session() as session, pytest.raises(DBAPIError, match="division by zero"):
        driver.rows(session, broken, {})


def test_a_read_on_the_driver_runs_in_the_sessions_transaction(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """It sees what the session wrote and has not committed (an autoflushing session's pending
    objects flushed first), and a lock it takes is the session's, held to its end."""
    d = Driver(pg_ledger)
    with pg_ledger.session() as session:
        run = session.get(Run, d.run_id)
        run.status = RunStatus.STOPPED.value  # pending, not flushed
        assert session.autoflush
        [row] = driver.rows(session, _RUN, {"run_id": d.run_id})
        assert row.status == RunStatus.STOPPED.value
        session.rollback()
    with pg_ledger.session() as holder, pg_ledger.session() as other:
        found = lock_run(holder, d.run_id)
        assert found["id"] == d.run_id and found["refill_now"].tzinfo is not None
        other.execute(text("SET LOCAL lock_timeout = '100ms'"))
        with pytest.raises(DBAPIError, match="lock timeout"):
            lock_run(other, d.run_id)
    assert utcnow() > found["refill_now"]


_NOTE = update(_attempts).where(ids_param(_attempts.c.id, "ids")).values(error=bindparam("note"))
_BUMP = update(_runs).where(_runs.c.id == bindparam("run_id")).values(zero_variance_groups=_runs.c.zero_variance_groups + 1)


def test_writes_on_the_driver_go_out_together_and_count_their_rows(ledger) -> None:  # type: ignore[no-untyped-def]
    """`driver.execute`: each statement's row count, in order; on PostgreSQL in one round trip
    (listeners see the second as sent with the first: `PIPELINED`)."""
    from refill.models.driver import PIPELINED

    d = Driver(ledger, check=False)  # rows changed by hand
    d.admit()
    ids = [a.id for a in d.live()[:3]]
    seen: list[bool] = []

    def listen(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if statement.startswith("UPDATE"):
            seen.append(bool(conn.info.get(PIPELINED)))

    event.listen(ledger.engine, "before_cursor_execute", listen)
    try:
        with ledger.session() as session:
            counts = driver.execute(session, [(_NOTE, {"ids": ids, "note": "noted"}), (_BUMP, {"run_id": d.run_id})])
            session.commit()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", listen)
    assert counts == [3, 1]
    assert seen == ([False, True] if ledger.engine.dialect.name == "postgresql" else [False, False])
    assert {d.attempt(i).error for i in ids} == {"noted"}
    assert d.query(lambda s: s.get(Run, d.run_id).zero_variance_groups) == 1


def _sleeping(ledger, pid: int, *, within: float) -> bool:  # type: ignore[no-untyped-def]
    """Whether PostgreSQL backend `pid` is running a statement that sleeps (`pg_sleep`), seen
    from another connection within `within` seconds."""
    condition = "pid = :pid AND state = 'active' AND query LIKE '%pg_sleep%'"
    return backend_seen(ledger.engine, condition, {"pid": pid}, within=within)


def test_pipelined_statements_built_as_they_are_taken_go_out_before_the_next_is_built(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """`driver.execute_pipelined` takes each statement of a generator only once the one before
    it went out: the server runs a statement while this process builds the next (a batch's
    write, `driver.send_changes`), and the counts still come back in order."""
    d = Driver(pg_ledger, check=False)
    d.admit()
    running: list[bool] = []

    def server_runs(pid: int) -> bool:
        return _sleeping(pg_ledger, pid, within=0.8)  # the statement sleeps for 1.5 s

    with pg_ledger.session() as session:
        pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()

        def statements():  # type: ignore[no-untyped-def]
            yield "SELECT pg_sleep(1.5)", {}
            running.append(server_runs(pid))  # building the second statement
            yield "UPDATE runs SET zero_variance_groups = zero_variance_groups + 1 WHERE id = %(run_id)s", {"run_id": d.run_id}

        counts = driver.execute_pipelined(session, statements())
        session.commit()
    assert running == [True]
    assert counts == [1, 1]
    assert d.query(lambda s: s.get(Run, d.run_id).zero_variance_groups) == 1


def test_a_read_sent_after_another_runs_while_this_process_reads_the_first(ledger) -> None:  # type: ignore[no-untyped-def]
    """`driver.rows_then`: `meanwhile` gets the first read's rows as `rows` returns them, and
    on PostgreSQL the second read is running on the server meanwhile; its rows come back too.
    On SQLite the two run one after the other, with the same rows."""
    d = Driver(ledger, check=False)
    d.admit()
    ids = [a.id for a in d.live()[:3]]
    postgres = ledger.engine.dialect.name == "postgresql"
    slow = select(_runs.c.id, func.pg_sleep(1.0).is_not(None).label("slept")) if postgres else select(_runs.c.id, literal_column("1").label("slept"))
    slow = slow.where(_runs.c.id == bindparam("run_id"))

    with ledger.session() as session:
        pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one() if postgres else None
        seen: list[tuple[list[int], bool]] = []

        def meanwhile(found):  # type: ignore[no-untyped-def]
            # the second read sleeps for 1 s
            seen.append(([row.id for row in found], _sleeping(ledger, pid, within=0.6) if postgres else False))
            return len(found)

        first = (_READ, {"ids": ids, "slots": list(range(100))})
        got, then = driver.rows_then(session, first, (slow, {"run_id": d.run_id}), meanwhile)
        alone = [row.id for row in driver.rows(session, *first)]
    assert seen == [(alone, postgres)] and got == 3
    assert [(row.id, bool(row.slept)) for row in then] == [(d.run_id, True)]


def test_json_values_are_stored_and_read_alike_on_every_path(ledger) -> None:  # type: ignore[no-untyped-def]
    """The ledger's JSON (`json_text`, `column_types.read_json`): written by COPY (`insert_rows`) and by
    SQLAlchemy, read by `driver.rows` and by SQLAlchemy, the same value on either ledger,
    including what orjson refuses (an integer past 64 bits) and keys that are not strings."""
    payload = {"big": 2**70 + 1, 3: "an int key", "text": "na\u00efve \u2603", "nested": [1.5, None, True, -0.0]}
    stored = {"big": 2**70 + 1, "3": "an int key", "text": "na\u00efve \u2603", "nested": [1.5, None, True, -0.0]}
    d = Driver(ledger, check=False)  # an outbox row written by hand
    d.admit()
    now = utcnow()
    with ledger.session() as session:
        row = {"id": 10**9, "run_id": d.run_id, "kind": "train_step", "payload": payload, "created_at": now, "available_at": now, "sent_at": now}
        driver.insert_rows(session, _outbox, [row])
        session.execute(update(_runs).where(_runs.c.id == d.run_id).values(config=payload))
        session.commit()
    read = select(_outbox.c.payload, _runs.c.config).join(_runs, _runs.c.id == _outbox.c.run_id).where(_outbox.c.id == bindparam("id"))
    with ledger.session() as session:
        [(by_copy, by_sqlalchemy)] = driver.rows(session, read, {"id": 10**9})
        assert by_copy == by_sqlalchemy == stored
        assert tuple(session.execute(read, {"id": 10**9}).one()) == (stored, stored)
    # A non-finite float is JSON's null (PostgreSQL refused the standard library's NaN).
    with ledger.session() as session:
        session.execute(update(_runs).where(_runs.c.id == d.run_id).values(config={"nan": float("nan"), "inf": float("inf")}))
        session.commit()
    with ledger.session() as session:
        assert session.execute(select(_runs.c.config).where(_runs.c.id == d.run_id)).scalar_one() == {"nan": None, "inf": None}
    # orjson spells what it can, the standard library the rest (the integer past 64 bits).
    assert json_text([1.5, "x"]) == '[1.5,"x"]' and json.loads(json_text(payload)) == stored
    # The joint read's own JSON: every BIGINT exact; an older SQLite ledger's NaN still reads.
    assert read_json(b"[9223372036854775807, -9223372036854775808, 0.1]") == [2**63 - 1, -(2**63), 0.1]
    assert read_json("[NaN]")[0] != read_json("[NaN]")[0]
