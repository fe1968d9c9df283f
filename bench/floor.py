"""The floor of `python -m bench overhead`: the rows the measured step wrote, written again by
the simplest bulk SQL, with no decisions.

`ChangeLog` reads back, after each of the step's transactions has committed (outside the
timers), every row that transaction wrote: a row whose `xmin` is at or past the next
transaction id noted after the previous transaction. Compared with the rows it read before,
each is an insert, an update (of the columns whose values differ) or, when a table's count
falls short, a delete. Rows rewritten with the values they had are counted, not replayed: a
write with nothing to say is the controller's cost, not the floor's.

`replay` writes those changes into a scratch database with the same schema (the same
migrations, so the same indexes and constraints), one transaction for each of the step's, in
the step's order: deletes, then per table (parents first) its new rows in one statement, then
per table and set of changed columns one `UPDATE ... FROM unnest(...)` with one array parameter
per column, the transaction's UPDATEs sent together. Rows go in and change as the ledger writes
them, with the ledger's own `refill.models.driver.send_changes` (which `RowStore.write` calls: a
table's few new rows as `refill.models.driver.unnest_insert` in the round trip of the UPDATEs,
thousands as `refill.models.driver.insert_rows`, a COPY; `refill.models.driver.unnest_update`, the
arrays spelled as text, all sent by `refill.models.driver.execute_pipelined`): the floor is
what writing the rows costs, so it writes them no slower than the ledger does (until stop 37
its UPDATEs went one round trip each, their arrays spelled by psycopg element by element, about
a fifth of the floor; until stop 42 every insert was a COPY of its own; until stop 43 it had its
own copy of the ledger's choice between the two).
The setup, the workers' lease handshakes and the trainer's claim are replayed too (so every row
is as the step found it), timed under their own names; only admission, relay and record are the
floor.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import JSON, Engine, Table, delete, func, null, select, text, tuple_

from bench.machine import process_cpu
from refill.models.driver import send_changes


@dataclass
class Change:
    """What one committed transaction of the step wrote."""

    phase: str
    inserts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: table -> (changed columns) -> rows holding the primary key and those columns
    updates: dict[str, dict[tuple[str, ...], list[dict[str, Any]]]] = field(default_factory=dict)
    deletes: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    #: rows written again with the values they had (not replayed)
    rewritten: dict[str, int] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.inserts or self.updates or self.deletes)


class ChangeLog:
    """The step's transactions as change sets, read from the measured database."""

    def __init__(self, engine: Engine) -> None:
        from refill.models.tables import Base

        self.engine = engine
        self.tables: list[Table] = list(Base.metadata.sorted_tables)
        self.rows: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {
            t.name: {} for t in self.tables
        }
        self.changes: list[Change] = []
        self.seconds = 0.0  # spent reading changes back (outside the timers)
        self.mark = "0"
        self.capture("before")  # what the migrations wrote, if anything: not replayed
        self.changes.clear()

    def capture(self, phase: str) -> Change:
        """Read back what was written since the last capture, as one transaction of `phase`."""
        started = time.perf_counter()
        change = Change(phase)
        with self.engine.connect() as conn:
            # A read-only transaction has no id of its own: the next one is the first the
            # following capture must see.
            mark = str(
                conn.execute(
                    text(
                        "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint % 4294967296"
                    )
                ).scalar_one()
            )
            written = text("age(xmin) <= age(CAST(:mark AS xid))").bindparams(mark=self.mark)
            counts = conn.execute(
                select(
                    *(select(func.count()).select_from(t).scalar_subquery() for t in self.tables)
                )
            ).one()
            for table, count in zip(self.tables, counts, strict=True):
                known = self.rows[table.name]
                key_columns = [c.name for c in table.primary_key.columns]
                inserted: list[dict[str, Any]] = []
                updated: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
                rewritten = 0
                for row in conn.execute(select(table).where(written)).mappings():
                    row = dict(row)
                    key = tuple(row[c] for c in key_columns)
                    before = known.get(key)
                    known[key] = row
                    if before is None:
                        inserted.append(row)
                        continue
                    columns = tuple(
                        c for c in row if c not in key_columns and not _same(before[c], row[c])
                    )
                    if columns:
                        updated[columns].append({c: row[c] for c in (*key_columns, *columns)})
                    else:
                        rewritten += 1
                if len(known) != count:  # rows deleted: find which
                    present = set(conn.execute(select(*table.primary_key.columns)).tuples())
                    gone = [key for key in known if key not in present]
                    for key in gone:
                        del known[key]
                    change.deletes[table.name] = gone
                if inserted:
                    change.inserts[table.name] = inserted
                if updated:
                    change.updates[table.name] = dict(updated)
                if rewritten:
                    change.rewritten[table.name] = rewritten
            self.mark = mark
        self.changes.append(change)
        self.seconds += time.perf_counter() - started
        return change


def _same(a: Any, b: Any) -> bool:
    return a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    )


@dataclass
class Floor:
    """The replay's cost per phase, and what it wrote."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    db_cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    transactions: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    statements: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: phase -> table -> {"+": inserted, "~": updated, "-": deleted, "=": rewritten unchanged}
    rows: dict[str, dict[str, dict[str, int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    )


def replay(url: str, changes: list[Change]) -> Floor:
    """Write `changes` into the fresh, migrated database at `url`, timing each transaction."""
    from refill.models.db import make_engine
    from refill.models.tables import Base

    tables = list(Base.metadata.sorted_tables)
    floor = Floor()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            backend = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        for change in changes:
            counts = floor.rows[change.phase]
            for name, rows in change.inserts.items():
                counts[name]["+"] += len(rows)
            for name, shapes in change.updates.items():
                counts[name]["~"] += sum(len(rows) for rows in shapes.values())
            for name, keys in change.deletes.items():
                counts[name]["-"] += len(keys)
            for name, number in change.rewritten.items():
                counts[name]["="] += number
            if change.empty():
                continue
            db_started = process_cpu(backend)
            cpu_started = time.process_time()
            started = time.perf_counter()
            with engine.begin() as conn:
                floor.statements[change.phase] += _write(conn, tables, change)
            floor.seconds[change.phase] += time.perf_counter() - started
            floor.cpu[change.phase] += time.process_time() - cpu_started
            floor.db_cpu[change.phase] += process_cpu(backend) - db_started
            floor.transactions[change.phase] += 1
    finally:
        engine.dispose()
    return floor


def _write(conn: Any, tables: list[Table], change: Change) -> int:
    statements = 0
    for table in reversed(tables):
        keys = change.deletes.get(table.name)
        if keys:
            conn.execute(delete(table).where(tuple_(*table.primary_key.columns).in_(keys)))
            statements += 1
    # As the ledger writes them (`RowStore.write`): `send_changes` sends a table's few new
    # rows with the UPDATEs in one round trip, thousands as a COPY of their own, in table order.
    inserts = [(table, _json_nulls(table, change.inserts[table.name])) for table in tables if change.inserts.get(table.name)]
    updates = [
        (table, list(columns), _json_nulls(table, rows))
        for table in tables
        for columns, rows in sorted(change.updates.get(table.name, {}).items())
    ]
    send_changes(conn, inserts, updates)
    return statements + len(inserts) + len(updates)


def _json_nulls(table: Table, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` where None in a JSON column is SQL NULL (as it was read), not JSON null."""
    columns = [c.name for c in table.columns if isinstance(c.type, JSON)]
    if not columns:
        return rows
    return [{**row, **{c: null() for c in columns if row.get(c) is None}} for row in rows]


def describe(rows: dict[str, dict[str, int]]) -> str:
    """`attempts +4812 ~6272, slots ~4096, ...`: rows inserted (+), updated (~), deleted (-),
    and written again unchanged (=, not replayed)."""
    parts = []
    for name, counts in rows.items():
        marks = " ".join(f"{mark}{counts[mark]}" for mark in "+~-=" if counts.get(mark))
        if marks:
            parts.append(f"{name} {marks}")
    return ", ".join(parts) or "nothing"
