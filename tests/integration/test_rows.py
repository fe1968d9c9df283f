"""The rows a ledger operation reads and makes, written back with Core (models/rows.py): one
UPDATE per table and set of changed columns, `UPDATE ... FROM unnest(...)` on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest
from sqlalchemy import event, select, update

from refill.models.context import ATTEMPT_COLUMNS, SLOT_COLUMNS
from refill.models.rows import AttemptRow, RowStore, SlotRow, SpareRow
from refill.models.tables import Attempt, Outbox, Slot, SparePrompt
from tests.support.driver import FLAT, SPREAD, Driver


@contextmanager
def updates(ledger) -> Iterator[list[str]]:  # type: ignore[no-untyped-def]
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE"):
            seen.append(statement)

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)


def _load(store: RowStore, run_id: int) -> tuple[list[AttemptRow], list[SlotRow]]:
    attempts = store.load(AttemptRow, select(*ATTEMPT_COLUMNS).where(Attempt.run_id == run_id, Attempt.step == 0).order_by(Attempt.id))
    slots = store.load(SlotRow, select(*SLOT_COLUMNS).where(Slot.run_id == run_id, Slot.step == 0))
    return attempts, slots


def test_changes_of_many_rows_go_out_as_one_statement_per_table_and_read_back(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger, check=False)  # rows changed by hand, not by the ledger's rules
    d.admit()
    finished = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
    with updates(pg_ledger) as seen, pg_ledger.session() as session:
        store = RowStore(session)
        attempts, slots = _load(store, d.run_id)
        assert len(attempts) >= 3 and len(slots) >= 3
        # Read again: the same objects, as an identity map gives them.
        again, _ = _load(store, d.run_id)
        assert all(a is b for a, b in zip(attempts, again, strict=True))
        for n, attempt in enumerate(attempts):
            attempt.error = f"note {n}"
            attempt.rewards = [0.0, float(n), None]
            attempt.finished_at = finished
            attempt.zero_variance = n % 2 == 0
        for slot in slots:
            slot.filtered += 2
        assert store.write() == len(attempts) + len(slots)
        assert store.write() == 0  # written: nothing left
        session.commit()
    assert [s.split()[1] for s in seen] == ["slots", "attempts"], seen
    assert all("unnest" in s for s in seen)
    with pg_ledger.session() as session:
        stored = {a.id: a for a in session.scalars(select(Attempt).where(Attempt.run_id == d.run_id, Attempt.step == 0))}
        assert [(stored[a.id].error, stored[a.id].rewards, stored[a.id].finished_at, stored[a.id].zero_variance) for a in attempts] == [
            (f"note {n}", [0.0, float(n), None], finished, n % 2 == 0) for n in range(len(attempts))
        ]
        assert {s.filtered for s in session.scalars(select(Slot).where(Slot.run_id == d.run_id, Slot.step == 0))} == {2}


def test_a_column_that_did_not_change_is_not_written_back(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A row is written with the columns it changed only: a worker's heartbeat committed in
    between (another column of the same attempts) survives."""
    d = Driver(pg_ledger, check=False)
    d.admit()
    with pg_ledger.session() as session:
        store = RowStore(session)
        attempts, _ = _load(store, d.run_id)
        ids = [a.id for a in attempts]
        with pg_ledger.session() as other:
            other.execute(update(Attempt).where(Attempt.id.in_(ids)).values(worker="w-elsewhere"))
            other.commit()
        # Rows in two shapes: two statements, each with its own columns.
        for attempt in attempts[:2]:
            attempt.error = "first shape"
        for attempt in attempts[2:]:
            attempt.error = "second shape"
            attempt.num_tokens = 7
        assert store.write() == len(attempts)
        assert not any(store.changed(a) for a in attempts)  # nothing left to write
        session.commit()
    with pg_ledger.session() as session:
        rows = session.execute(
            select(Attempt.worker, Attempt.error, Attempt.num_tokens).where(Attempt.id.in_(ids)).order_by(Attempt.id)
        ).all()
    by_id = dict(zip(ids, rows, strict=True))
    assert {row.worker for row in rows} == {"w-elsewhere"}
    assert [by_id[a.id].error for a in attempts] == ["first shape"] * 2 + ["second shape"] * (len(attempts) - 2)
    assert [by_id[a.id].num_tokens for a in attempts[:2]] == [None, None]


def test_a_row_set_back_to_what_it_held_is_not_written_and_a_later_change_is(ledger) -> None:  # type: ignore[no-untyped-def]
    """A write compares the columns set since the row was last written (`Row._set`): one set
    and set back, or set to the value it held, writes nothing; one set after a write is written
    in the next, alone."""
    d = Driver(ledger, check=False)  # rows changed by hand, not by the ledger's rules
    d.admit()
    with updates(ledger) as seen, ledger.session() as session:
        store = RowStore(session)
        attempts, slots = _load(store, d.run_id)
        first, second = attempts[0], attempts[1]
        first.error = "for a moment"
        first.error = None  # back to what it held
        second.num_tokens = second.num_tokens  # the value it holds
        slots[0].filtered = slots[0].filtered
        assert store.write() == 0 and seen == []
        first.error = "kept"
        assert store.write() == 1
        assert len(seen) == 1
        second.num_tokens = 11
        assert store.write() == 1  # the later change, in a write of its own
        assert len(seen) == 2 and "num_tokens" in seen[1] and "error" not in seen[1]
        assert store.write() == 0
        session.commit()
    assert (d.attempt(first.id).error, d.attempt(first.id).num_tokens) == ("kept", None)
    assert (d.attempt(second.id).error, d.attempt(second.id).num_tokens) == (None, 11)


def test_a_new_row_is_inserted_whole_then_compared_like_a_read_one(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A row made here is inserted with every change made before its insert and no UPDATE;
    after it, `saved` answers what the database holds and a change is written alone. A column
    another statement wrote (`patched`) is what the database holds: setting a row to it writes
    nothing."""
    from refill.models.rows import OutboxRow

    ledger = pg_ledger  # SQLite inserts a new row at once (it numbers it)
    d = Driver(ledger, check=False)
    d.admit()
    with updates(ledger) as seen, ledger.session() as session:
        store = RowStore(session)
        attempts, slots = _load(store, d.run_id)
        when = datetime(2026, 1, 1, tzinfo=UTC)
        values = {"run_id": d.run_id, "kind": "train_step", "step": 0, "payload": {}, "created_at": when, "available_at": when, "send_count": 0}
        note = store.new(OutboxRow, {**values, "id": 10**9})  # its id drawn (IdBlocks)
        assert store.changed(note) and store.saved(note, "send_count") is None
        note.send_count = 3  # before its insert: inserted with it
        first = attempts[0]
        first.error = "made"
        store.write()
        assert seen and not any("outbox" in statement.split()[1] for statement in seen)
        assert store.saved(note, "send_count") == 3 and not store.changed(note)
        assert store.saved(first, "error") == "made" and not store.changed(first)
        first.error = "changed"
        assert store.saved(first, "error") == "made" and store.changed(first)
        store.patched(AttemptRow, first.id, error="by another")  # the database holds it now
        assert first.error == "by another" and not store.changed(first)
        seen.clear()
        assert store.write() == 0 and seen == []
        slots[0].filtered += 1
        assert store.write() == 1 and len(seen) == 1 and "filtered" in seen[0]
        # The store updates the tables it reads; an outbox row changed after its insert would
        # not be written, and is refused rather than dropped.
        note.send_count = 4
        with pytest.raises(TypeError, match=r"rows of \['outbox'\] changed after their insert"):
            store.write()
        session.commit()
    with ledger.session() as session:
        assert session.scalar(select(Outbox.send_count).where(Outbox.id == note.id)) == 3


def test_a_new_row_with_a_name_that_is_no_column_is_refused_and_writes_nothing(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A misspelt column in a new row's values, or set on it before its insert, raises an error
    naming it and the table; the write that finds it writes none of its rows."""
    from refill.models.rows import OutboxRow

    d = Driver(pg_ledger, check=False)
    d.admit()
    when = datetime(2026, 1, 1, tzinfo=UTC)
    with pg_ledger.session() as session:
        store = RowStore(session)
        attempts, _ = _load(store, d.run_id)
        values = {"run_id": d.run_id, "kind": "train_step", "step": 0, "payload": {}, "created_at": when, "available_at": when}
        with pytest.raises(ValueError, match=r"new row of outbox has values for \['sent_count'\], which are not columns of outbox"):
            store.new(OutboxRow, {**values, "id": 10**9, "sent_count": 1})
        kept = store.new(OutboxRow, {**values, "id": 10**9 + 1})
        odd = store.new(OutboxRow, {**values, "id": 10**9 + 2})
        odd.claimd_by = "relay"  # set after it was made: found at the write
        with pytest.raises(ValueError, match=r"\['claimd_by'\]"):
            store.write()
        session.commit()
    with pg_ledger.session() as session:
        assert session.scalar(select(Outbox.id).where(Outbox.id.in_([kept.id, odd.id]))) is None


def test_a_batch_of_results_records_the_same_on_both_ledgers(ledger) -> None:  # type: ignore[no-untyped-def]
    """The consumer's path through it: a batch that commits and filters groups leaves the
    ledger consistent (the suite checks the invariants after each test) and as recorded."""
    d = Driver(ledger)
    d.admit()
    first = [d.live_of(0, idx) for idx in range(4)]
    d.start_all([a.id for a in first])
    batch = d.record(*(d.result(a.id, SPREAD if n != 1 else [1.0] * len(SPREAD)) for n, a in enumerate(first)))
    assert [o.outcome.value for o in batch.outcomes] == ["COMMITTED", "FILTERED", "COMMITTED", "COMMITTED"]
    assert [d.slot(0, idx).status for idx in range(4)] == ["committed", "open", "committed", "committed"]
    assert d.slot(0, 1).filtered == 1 and d.slot(0, 1).needs_replacement
    assert [d.attempt(a.id).state for a in first] == ["committed", "filtered", "committed", "committed"]


def test_sqlite_writes_each_shape_as_an_executemany(sqlite_ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(sqlite_ledger, check=False)
    d.admit()
    with updates(sqlite_ledger) as seen, sqlite_ledger.session() as session:
        store = RowStore(session)
        attempts, _ = _load(store, d.run_id)
        for attempt in attempts:
            attempt.error = "x"
        assert store.write() == len(attempts)
        session.commit()
    assert len(seen) == 1 and "unnest" not in seen[0], seen
    with sqlite_ledger.session() as session:
        assert set(session.scalars(select(Attempt.error).where(Attempt.run_id == d.run_id, Attempt.step == 0))) == {"x"}


def test_the_spares_a_batch_takes_are_marked_in_one_statement_with_their_attempts(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger)
    d.admit()
    first = [d.live_of(0, idx) for idx in range(4)]
    d.start_all([a.id for a in first])
    with updates(pg_ledger) as seen:
        batch = d.record(*(d.result(a.id, FLAT) for a in first))  # each filtered slot takes a spare
    assert [o.outcome.value for o in batch.outcomes] == ["FILTERED"] * 4
    spare_updates = [s for s in seen if s.split()[1] == "spare_prompts"]
    assert len(spare_updates) == 1 and "unnest" in spare_updates[0], spare_updates
    with pg_ledger.session() as session:
        taken = session.execute(
            select(SparePrompt.prompt_id, Attempt.prompt_id, Attempt.step, Attempt.slot_idx)
            .join(Attempt, Attempt.id == SparePrompt.taken_by_attempt)
            .where(SparePrompt.run_id == d.run_id, SparePrompt.taken_at.is_not(None))
        ).all()
    assert sorted((step, idx) for _, _, step, idx in taken) == [(0, idx) for idx in range(4)]
    assert all(spare == attempt for spare, attempt, _, _ in taken)


def test_a_batch_of_results_and_an_admission_write_the_run_and_its_steps_without_the_orm(ledger) -> None:  # type: ignore[no-untyped-def]
    """The run's row and its steps are rows like the others: a batch that commits, filters and
    borrows changes the run's counters and a step's, and none of it goes through an ORM flush;
    nor does admitting a step. (A step's release records its metrics as an ORM object.)"""
    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 8}, "async_rl": {"max_lookahead_versions": 1}}, num_prompts=80)
    flushes: list[int] = []

    def count(session, _context, _instances):  # type: ignore[no-untyped-def]
        flushes.append(len(session.new) + len(session.dirty))

    event.listen(ledger.sessions, "before_flush", count)
    try:
        assert d.admit() == [0, 1]
        d.start_all([a.id for a in d.live()])
        batch = [d.result(d.live_of(1, idx).id, SPREAD) for idx in (0, 1)]
        batch += [d.result(d.live_of(0, idx).id, FLAT) for idx in (2, 3)]  # filtered: they borrow
        outcomes = [r.outcome.value for r in d.record(*batch).outcomes]
    finally:
        event.remove(ledger.sessions, "before_flush", count)
    assert outcomes == ["COMMITTED", "COMMITTED", "FILTERED", "FILTERED"]
    assert flushes == []
    # What the batch changed on the run's row and the steps' is in the ledger.
    run = d.run()
    assert (run.next_step, run.scored_groups, run.zero_variance_groups) == (2, 4, 2)
    assert d.step(1).committed == 0  # lent both of its groups to step 0
    assert d.step(0).committed == 2


def test_integers_booleans_and_floats_are_written_exactly_with_nulls_and_non_finite_values(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """`UPDATE ... FROM unnest` passes each column as one array parameter: every value, NULL,
    NaN and the infinities must come back as set."""
    import math

    d = Driver(pg_ledger, check=False)  # rows changed by hand, not by the ledger's rules
    d.admit()
    means = [0.1, float("nan"), float("inf"), float("-inf"), None, 1e-300, -2.5, 1 / 3]
    with updates(pg_ledger) as seen, pg_ledger.session() as session:
        store = RowStore(session)
        attempts, _ = _load(store, d.run_id)
        assert len(attempts) >= 4
        attempts = attempts[:4]
        for n, attempt in enumerate(attempts):
            attempt.reward_mean, attempt.reward_min = means[2 * n], means[2 * n + 1]
            attempt.zero_variance = (True, False, None, True)[n]
            attempt.num_tokens = (2**31 - 1, 0, None, -7)[n]
        assert store.write() == 4
    assert [s.split()[:4] for s in seen] == [["UPDATE", "attempts", "AS", "t"]]  # one unnest statement
    with pg_ledger.session() as session:
        back = {row.id: row for row in session.scalars(select(Attempt).where(Attempt.id.in_([a.id for a in attempts])))}

    def same(a, b) -> bool:  # type: ignore[no-untyped-def]
        return (a is None and b is None) or (a is not None and b is not None and (a == b or (math.isnan(a) and math.isnan(b))))

    for n, attempt in enumerate(attempts):
        row = back[attempt.id]
        assert same(row.reward_mean, means[2 * n]) and same(row.reward_min, means[2 * n + 1]), (n, row.reward_mean, row.reward_min)
        assert row.zero_variance is (True, False, None, True)[n]
        assert row.num_tokens == (2**31 - 1, 0, None, -7)[n]


def test_a_column_of_mixed_python_types_is_written_as_a_per_row_update_writes_it(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """One array parameter per column of `UPDATE ... FROM unnest`: a whole number beside
    floats in a float column, a bool beside ints in an integer column and an enum member beside
    a string are written as a per-row update writes them, a JSON None as JSON null (not SQL
    NULL), a column of NULLs as NULLs."""
    from refill.models.tables import AttemptState

    d = Driver(pg_ledger, check=False)  # rows changed by hand, not by the ledger's rules
    d.admit()
    with updates(pg_ledger) as seen, pg_ledger.session() as session:
        store = RowStore(session)
        attempts, _ = _load(store, d.run_id)
        attempts = attempts[:4]
        for n, attempt in enumerate(attempts):
            attempt.reward_mean = (1, 0.5, -3, None)[n]
            attempt.num_tokens = (True, 7, False, None)[n]
            attempt.state = (AttemptState.RUNNING, "queued", AttemptState.QUEUED, "running")[n]
            attempt.rewards = ([1, 0.5], None, [], [None])[n]
            attempt.error = None if n else "x"
            attempt.worker = None
        assert store.write() == 4
    assert len(seen) == 1 and "unnest" in seen[0]
    with pg_ledger.session() as session:
        back = {row.id: row for row in session.scalars(select(Attempt).where(Attempt.id.in_([a.id for a in attempts])))}
        sql_null_rewards = session.scalars(
            select(Attempt.id).where(Attempt.id.in_([a.id for a in attempts]), Attempt.rewards.is_(None))
        ).all()
    rows = [back[a.id] for a in attempts]
    assert [r.reward_mean for r in rows] == [1.0, 0.5, -3.0, None]
    assert [type(r.reward_mean) for r in rows[:3]] == [float] * 3
    assert [r.num_tokens for r in rows] == [1, 7, 0, None]
    assert [r.state for r in rows] == ["running", "queued", "queued", "running"]
    assert [r.rewards for r in rows] == [[1, 0.5], None, [], [None]]
    assert sql_null_rewards == []  # the None is JSON null
    assert [r.error for r in rows] == ["x", None, None, None] and {r.worker for r in rows} == {None}


def test_a_list_of_ids_is_one_parameter_and_the_statement_the_same_for_every_list(ledger) -> None:  # type: ignore[no-untyped-def]
    """`sql.ids_in`: the ids bound as one array (a JSON array on SQLite), so PostgreSQL sees
    one statement text whatever the list's length, and psycopg prepares it."""
    from refill.models.sql import ids_in

    d = Driver(ledger, check=False)
    d.admit()
    table = Attempt.__table__
    ids = sorted(a.id for a in d.live())
    seen: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append((statement, parameters))

    lists = [ids[:1], ids, [], [ids[2], ids[2], ids[0], 10**12]]
    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        with ledger.session() as session:
            found = [
                session.scalars(select(table.c.id).where(ids_in(table.c.id, wanted)).order_by(table.c.id)).all()
                for wanted in lists
            ]
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    assert found == [ids[:1], ids, [], [ids[0], ids[2]]]
    reads = [(statement, parameters) for statement, parameters in seen if statement.lstrip().upper().startswith("SELECT")]
    assert len({statement for statement, _ in reads}) == 1, reads
    assert all(len(parameters) == 1 for _, parameters in reads), reads
    if ledger.engine.dialect.name == "postgresql":
        assert "= ANY(" in reads[0][0]


def _new_attempts(d: Driver, first_id: int) -> list[dict[str, object]]:
    """New extras of step 0, among them each kind of value a column can hold; `try_no` left
    out (its default fills it in)."""
    from sqlalchemy import null

    from refill.models.tables import AttemptState

    prompt_id = d.live()[0].prompt_id
    at = datetime(2026, 12, 5, 16, 30, 15, 123456, tzinfo=UTC)
    values = [
        # A str enum member, JSON null (None), a float column given an integer, an emoji.
        (AttemptState.RUNNING, None, 1, float("-inf"), True, 7, "worker \N{HOT PEPPER}"),
        # SQL NULL (`null()`), NaN, a boolean's None, quotes, a backslash and control characters.
        ("filtered", null(), float("nan"), None, None, None, "w'2\"\\\t\n"),
        ("committed", [0.0, 1.5, None, {"k": "v"}], float("inf"), 0.5, False, -3, None),
    ]
    return [
        {
            "id": first_id + n, "run_id": d.run_id, "step": 0, "slot_idx": None, "origin_step": 0,
            # A bool in an integer column: a Core insert casts it (1), COPY must write 1 too.
            "origin_slot": (None, True, 3)[n], "prompt_id": prompt_id, "reason": "extra", "state": state,
            "failure_kind": None, "error": None, "min_weight_version": 0, "weight_version": n,
            "worker": worker, "created_at": at, "available_at": at, "dispatched_at": None,
            "started_at": None, "leased_until": None, "finished_at": at, "generation_seconds": 0.25 * n,
            "rewards": rewards, "reward_mean": mean, "reward_min": low, "reward_max": None,
            "zero_variance": zero, "num_tokens": tokens,
        }
        for n, (state, rewards, mean, low, zero, tokens, worker) in enumerate(values)
    ]


def test_new_rows_go_in_as_one_statement_and_read_back_as_a_core_insert_writes_them(ledger) -> None:  # type: ignore[no-untyped-def]
    """`driver.insert_rows` (a COPY on PostgreSQL) against SQLAlchemy's own `insert(table)` of
    the same rows: every column reads back the same, defaults, JSON null against SQL NULL,
    an enum member, NaN and infinities, quotes and control characters included; listeners of
    the engine see it as one statement."""
    from sqlalchemy import insert

    from refill.models.driver import insert_rows

    d = Driver(ledger, check=False)  # extras made by hand, not by the ledger's rules
    d.admit()
    table = Attempt.__table__
    core, copied = _new_attempts(d, 10**9), _new_attempts(d, 10**9 + 100)
    seen: list[tuple[str, bool]] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append((statement.split()[0].upper(), executemany))

    with ledger.session() as session:
        session.execute(insert(table), core)
        event.listen(ledger.engine, "before_cursor_execute", record)
        try:
            insert_rows(session, table, copied)
        finally:
            event.remove(ledger.engine, "before_cursor_execute", record)
    postgres = ledger.engine.dialect.name == "postgresql"
    assert seen == [("COPY" if postgres else "INSERT", True)]
    _assert_written_as_core_writes_them(ledger, 10**9, 10**9 + 100)


def _assert_written_as_core_writes_them(ledger, core: int, other: int) -> None:  # type: ignore[no-untyped-def]
    """The three rows of `_new_attempts(d, other)` read back as those of `_new_attempts(d,
    core)`, inserted by SQLAlchemy's `insert(table)`, do."""
    import math

    table = Attempt.__table__
    with ledger.session() as session:
        back = {row.id: dict(row._mapping) for row in session.execute(select(table).where(table.c.id.in_([*range(core, core + 3), *range(other, other + 3)])))}
    assert len(back) == 6

    def same(a, b) -> bool:  # type: ignore[no-untyped-def]
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    for n in range(3):
        want, got = back[core + n], back[other + n]
        for column in table.columns.keys():
            if column != "id":
                assert same(got[column], want[column]), (n, column, got[column], want[column])
    assert [back[other + n]["state"] for n in range(3)] == ["running", "filtered", "committed"]
    assert back[other]["try_no"] == 1  # the column's default
    assert back[other + 1]["rewards"] is None and back[other]["rewards"] is None
    if ledger.engine.dialect.name == "postgresql":  # JSON null and SQL NULL are different values there
        with ledger.session() as session:
            nulls = dict(session.execute(select(table.c.id, table.c.rewards.is_(None)).where(table.c.id.in_(range(other, other + 3)))).all())
        assert nulls == {other: False, other + 1: True, other + 2: False}


def test_new_rows_sent_as_arrays_read_back_as_a_core_insert_writes_them(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """`driver.unnest_insert` (a table's few new rows, sent in the round trip of a write's
    UPDATEs) against SQLAlchemy's own `insert(table)`: every column reads back the same, as for
    a COPY."""
    from sqlalchemy import insert

    from refill.models.driver import execute_pipelined, unnest_insert

    d = Driver(pg_ledger, check=False)
    d.admit()
    table = Attempt.__table__
    with pg_ledger.session() as session:
        session.execute(insert(table), _new_attempts(d, 10**9))
        statement = unnest_insert(pg_ledger.engine.dialect, table, _new_attempts(d, 10**9 + 100))
        assert statement[0].startswith("INSERT INTO attempts (") and "unnest(" in statement[0]
        assert execute_pipelined(session, [statement]) == [3]
        session.commit()
    _assert_written_as_core_writes_them(pg_ledger, 10**9, 10**9 + 100)


def test_new_rows_the_database_refuses_raise_sqlalchemys_error_and_leave_nothing(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A COPY that breaks a constraint fails as an INSERT would, with SQLAlchemy's
    IntegrityError (which `Ledger.transaction` and callers know), naming the table; the
    transaction keeps none of the rows."""
    import pytest
    from sqlalchemy.exc import IntegrityError

    from refill.models.driver import insert_rows

    d = Driver(pg_ledger, check=False)
    d.admit()
    table = Attempt.__table__
    rows = _new_attempts(d, 10**9)
    rows[2]["prompt_id"] = 10**12  # no such prompt

    def write(session):  # type: ignore[no-untyped-def]
        insert_rows(session, table, rows)

    with pytest.raises(IntegrityError, match="attempts"):
        pg_ledger.transaction(write)
    with pg_ledger.session() as session:
        assert session.scalars(select(table.c.id).where(table.c.id >= 10**9)).all() == []


def test_an_array_parameter_written_as_text_reads_back_as_the_list_itself(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """`driver.array_text` spells an unnest column's values as the text of an array (psycopg's
    own spelling of a list costs ten times more): every kind of value it writes, cast to its
    column's type, reads back as psycopg's spelling of the same list does, quotes, backslashes,
    braces, commas, the word NULL, empty and multi-line strings, NULLs, non-finite floats and
    time zones and repeated timestamps included."""
    import math
    from datetime import UTC, datetime, timedelta, timezone

    from sqlalchemy import text

    from refill.models.driver import array_text

    columns = {
        "bigint": [1, None, -(2**62), 0],
        "double precision": [0.1, float("nan"), float("inf"), float("-inf"), None, 1e-300, 1 / 3],
        "boolean": [True, False, None],
        "varchar": ['a"b', "c\\d", "{,}", " spaced ", "NULL", "", "é\n\t", None],
        "json": ["[0.0, 1.0]", "null", '{"k": "v \\" w"}', None],
        "timestamp with time zone": [
            datetime(2026, 12, 5, 23, 0, 0, 123456, tzinfo=UTC),
            datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
            None,
            # a value again (spelled once), and the same instant at another offset
            datetime(2026, 12, 5, 23, 0, 0, 123456, tzinfo=UTC),
            datetime(2026, 12, 5, 18, 0, 0, 123456, tzinfo=timezone(timedelta(hours=-5))),
            None,
        ],
        "integer": [None, None],
    }
    assert all(isinstance(array_text(values), str) for values in columns.values())
    assert array_text([1, "mixed"]) == [1, "mixed"]  # left to psycopg

    def same(a, b) -> bool:  # type: ignore[no-untyped-def]
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    with pg_ledger.session() as session:
        for kind, values in columns.items():
            # psycopg has no spelling of a str list as json[]: compared by their text there.
            compare = "text" if kind == "json" else kind
            as_text, as_list = session.execute(
                text(f"SELECT CAST(CAST(:a AS {kind}[]) AS {compare}[]), CAST(:b AS {compare}[])"),
                {"a": array_text(values), "b": values},
            ).one()
            assert len(as_text) == len(values) and all(map(same, as_text, as_list)), (kind, as_text, as_list)


def test_a_writes_updates_go_out_in_one_round_trip_and_a_refused_one_raises_sqlalchemys_error(pg_ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A write's UPDATEs (one per table and set of columns) are sent together in psycopg's
    pipeline mode, in the store's table order; one the database refuses fails the write with
    SQLAlchemy's IntegrityError naming its constraint, and the transaction keeps none of them."""
    import psycopg
    import pytest
    from psycopg import pq
    from sqlalchemy.exc import IntegrityError

    from refill.models.driver import PIPELINED

    d = Driver(pg_ledger, check=False)  # rows changed by hand, not by the ledger's rules
    d.admit()
    sent: list[tuple[str, bool]] = []
    seen: list[bool] = []  # the engine's listeners: whether each went out in the round trip before it
    execute = psycopg.Cursor.execute

    def listen(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if statement.startswith("UPDATE"):
            seen.append(bool(conn.info.get(PIPELINED)))

    event.listen(pg_ledger.engine, "before_cursor_execute", listen)

    def spy(self, query, *args, **kw):  # type: ignore[no-untyped-def]
        if str(query).startswith("UPDATE"):
            sent.append((str(query).split()[1], self.connection.pgconn.pipeline_status != pq.PipelineStatus.OFF))
        return execute(self, query, *args, **kw)

    monkeypatch.setattr(psycopg.Cursor, "execute", spy)
    with pg_ledger.session() as session:
        store = RowStore(session)
        attempts, slots = _load(store, d.run_id)
        attempts[0].error = "a note"
        slots[0].filtered += 1
        slots[1].drops += 1
        assert store.write() == 3
        session.commit()
    event.remove(pg_ledger.engine, "before_cursor_execute", listen)
    # The slots' two ways of changing share one statement (`_UNIFORM_COLUMNS`).
    assert sent == [("slots", True), ("attempts", True)], sent
    # Listeners see both; the second as sent in the first one's round trip (`bench overhead
    # --rtt-ms` charges one round trip for the two).
    assert seen == [False, True], seen
    with pg_ledger.session() as session:
        assert session.scalar(select(Attempt.error).where(Attempt.id == attempts[0].id)) == "a note"

    def refused(session):  # type: ignore[no-untyped-def]
        store = RowStore(session)
        attempts, slots = _load(store, d.run_id)
        attempts[1].error = "kept?"
        slots[2].filter_replacements = slots[2].filter_budget + 1  # breaks ck_slots_filter_budget
        store.write()

    with pytest.raises(IntegrityError, match="filter_budget"):
        pg_ledger.transaction(refused)
    with pg_ledger.session() as session:
        assert session.scalar(select(Attempt.error).where(Attempt.id == attempts[1].id)) is None


def test_an_update_that_finds_fewer_rows_than_it_changed_fails_the_write(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A changed row another transaction deleted meanwhile is not written silently: the write
    raises, naming the table, and its transaction is rolled back by its caller."""
    import pytest

    d = Driver(pg_ledger, check=False)
    d.admit()
    spares = SparePrompt.__table__
    with pg_ledger.session() as session:
        store = RowStore(session)
        rows = store.load(SpareRow, select(*spares.columns).where(spares.c.run_id == d.run_id).order_by(spares.c.id).limit(2))
        assert len(rows) == 2
        with pg_ledger.session() as other:
            other.execute(spares.delete().where(spares.c.id == rows[1].id))
            other.commit()
        for row in rows:
            row.taken_at = datetime(2026, 12, 6, tzinfo=UTC)
        with pytest.raises(RuntimeError, match="update of spare_prompts matched 1 rows for 2 changed rows"):
            store.write()


def test_a_writes_few_new_rows_go_out_with_its_updates_and_many_as_a_copy_in_table_order(pg_ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A table's new rows up to `PIPELINED_INSERT_ROWS` go out in the round trip of the write's
    UPDATEs; more, as a COPY of their own, after the pending inserts of the tables before it
    (its rows may reference theirs: groups their new attempts)."""
    from refill.models import driver as driver_module
    from refill.models.driver import PIPELINED
    from refill.models.rows import OutboxRow

    d = Driver(pg_ledger, check=False)
    d.admit()
    seen: list[tuple[str, str, bool]] = []

    def listen(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        words = statement.split()
        table = words[2] if words[0] == "INSERT" else words[1]
        seen.append((words[0], table, bool(conn.info.get(PIPELINED))))

    when = datetime(2026, 1, 1, tzinfo=UTC)

    def outbox(step: int, id: int) -> dict[str, object]:
        return {"id": id, "run_id": d.run_id, "kind": "train_step", "step": step, "payload": {"id": id}, "created_at": when, "available_at": when, "send_count": 0}

    def write(limit: int, outbox_rows: int) -> None:
        monkeypatch.setattr(driver_module, "PIPELINED_INSERT_ROWS", limit)
        seen.clear()
        base = 10**9 + 1000 * limit
        with pg_ledger.session() as session:
            store = RowStore(session)
            attempts, _ = _load(store, d.run_id)
            attempts[0].error = f"limit {limit}"
            [new] = [store.new(AttemptRow, values) for values in _new_attempts(d, base)[:1]]
            for n in range(outbox_rows):
                store.new(OutboxRow, outbox(new.step, base + n))
            event.listen(pg_ledger.engine, "before_cursor_execute", listen)
            try:
                assert store.write() == 2 + outbox_rows
            finally:
                event.remove(pg_ledger.engine, "before_cursor_execute", listen)
            session.commit()
        with pg_ledger.session() as session:
            assert session.scalar(select(Attempt.error).where(Attempt.id == attempts[0].id)) == f"limit {limit}"
            assert session.scalars(select(Outbox.step).where(Outbox.id >= base, Outbox.id < base + 1000)).all() == [new.step] * outbox_rows

    write(256, 2)  # a few rows: one round trip for all
    assert seen == [("INSERT", "attempts", False), ("INSERT", "outbox", True), ("UPDATE", "attempts", True)], seen
    write(1, 2)  # the attempt in the round trip before the COPY of the two outbox rows, in table order
    assert seen == [("INSERT", "attempts", False), ("COPY", "outbox", False), ("UPDATE", "attempts", False)], seen
