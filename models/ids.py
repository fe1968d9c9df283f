"""Primary keys for the rows a transaction creates by the thousand, taken from PostgreSQL's
sequences in blocks.

Why: the unit of work needs the id of every attempt, outbox row and spare prompt it inserts.
Without one it inserts them with `RETURNING id`, which SQLAlchemy sends as a few very large
multi-row `INSERT ... VALUES (...), (...)` statements; psycopg parses a statement of that size
anew on every execution (its cache stops at 4 KB), and that parsing was a third of admitting a
4096-group step (`python -m bench overhead --profile admission`). With the ids known up front
the unit of work sends all the rows in one short statement (`driver.insert_rows`: a COPY on
PostgreSQL).

A block is drawn with one query, and the next one is twice as large (up to `MAX_BLOCK`), so a
transaction that creates a handful of rows one at a time asks once, and one that creates
thousands asks about a dozen times; `insert`, which knows how many it needs, asks once. Ids a transaction drew and did not use are never used: a sequence only moves
forward, so ids have gaps, as they do after any rolled-back insert. Ids still grow in the
order one transaction creates its rows, which is the order the ledger reads some of them back
in (the spare pool, oldest first).

On SQLite (the embedded ledger, one writer at a time) the database assigns ids as before.

`insert` writes many rows of one table at once without ORM objects (admission's first
attempts: thousands of objects for a large step) and returns
their ids, drawn here on PostgreSQL and read back with `RETURNING` on SQLite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from sqlalchemy import Select, Table, bindparam, cast, func, insert, select
from sqlalchemy.dialects.postgresql import REGCLASS
from sqlalchemy.orm import Session

from refill.models.driver import insert_rows
from refill.models.joint_read import Read
from refill.models.sql import Query

FIRST_BLOCK = 16
MAX_BLOCK = 1024

#: (database URL, table) -> the sequence behind the table's id column
_SEQUENCES: dict[tuple[Any, str], str] = {}


def _sequence(session: Session, table: str) -> str:
    # The URL object, not its text: rendering it each time was a tenth of a batch's id draws.
    key = (session.get_bind().url, table)
    name = _SEQUENCES.get(key)
    if name is None:
        name = session.scalar(select(func.pg_get_serial_sequence(table, "id")))
        if name is None:
            raise RuntimeError(
                f"table {table!r} has no sequence behind its id column; run `refill db upgrade` "
                "to bring the ledger's schema up to date"
            )
        _SEQUENCES[key] = name
    return name


@dataclass
class IdBlocks:
    """Ids drawn for one transaction, by table."""

    session: Session
    enabled: bool
    _free: dict[str, list[int]] = field(default_factory=dict)
    _next_size: dict[str, int] = field(default_factory=dict)
    #: table -> the first block to draw for it, drawn with the others' in one query (`expect`)
    _expected: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_session(cls, session: Session) -> IdBlocks:
        return cls(session, session.get_bind().dialect.name == "postgresql")

    def ids(self, table: str) -> dict[str, int]:
        """`{"id": <unused id>}` for a new row of `table` (keyword arguments for its
        constructor), or `{}` where the database assigns it."""
        return {"id": self.next(table)} if self.enabled else {}

    def expect(self, counts: dict[str, int]) -> None:
        """Say about how many rows of each table this transaction will make: the first draw
        for any of them then draws a block of that size for each, all in one query. (A batch
        of results draws its attempts' first block with its reads, `expected_read`; drawn in
        blocks that start small, they took two or three queries a batch.)"""
        if self.enabled:
            self._expected.update((table, count) for table, count in counts.items() if count > 0)

    def next(self, table: str) -> int:
        """An unused id for a new row of `table` (PostgreSQL only)."""
        free = self._free.get(table)
        if not free and table in self._expected:
            self._draw_expected()
            free = self._free[table]
        if not free:
            size = self._next_size.get(table, FIRST_BLOCK)
            self._next_size[table] = min(MAX_BLOCK, size * 2)
            # Popped from the end: reversed so that rows get ids in the order they are made.
            free = self._free[table] = self._draw(table, size)[::-1]
        return free.pop()

    def expected_read(self) -> Read | None:
        """The draw `expect` set up, as a read that joins a batch's first read-ahead
        (`RunContext.read_ahead`: the draw's round trip saved), or None where nothing is
        expected. Its one row goes to `adopt_expected`."""
        if not self._expected:
            return None
        return Read(None, self._expected_query(), extra=tuple(f"ids{i}" for i in range(len(self._expected))))

    def adopt_expected(self, found: list[tuple[list[int], ...]]) -> None:
        """Take the blocks `expected_read` drew (its row, as `RowStore.load_all` returns it)."""
        expected, self._expected = self._expected, {}
        [drawn] = found
        for table, ids in zip(expected, drawn, strict=True):
            # After the ids still free (the list is popped from its end).
            self._free[table] = sorted(ids, reverse=True) + self._free.get(table, [])
            self._next_size[table] = min(MAX_BLOCK, max(self._next_size.get(table, FIRST_BLOCK), 2 * expected[table]))

    def _expected_query(self) -> Query:
        params: dict[str, Any] = {}
        for i, (table, count) in enumerate(self._expected.items()):
            params[f"ids_sequence{i}"] = _sequence(self.session, table)
            params[f"ids_count{i}"] = count
        return Query(_drawing(len(self._expected)), params)

    def _draw_expected(self) -> None:
        self.adopt_expected([tuple(self.session.execute(*self._expected_query()).one())])

    def _draw(self, table: str, count: int) -> list[int]:
        """`count` fresh ids of `table`, ascending, in one query."""
        ids = self.session.scalar(_drawing(1), {"ids_sequence0": _sequence(self.session, table), "ids_count0": count})
        return sorted(ids)

    def insert(self, table: Table, rows: list[dict[str, Any]]) -> list[int]:
        """Insert `rows` into `table` (one statement, `driver.insert_rows`) and return their ids,
        in order."""
        if not rows:
            return []
        if self.enabled:
            # What is left of the current block, then the rest in one query (not block by
            # block: admission asks for thousands at once).
            free = self._free.get(table.name) or []
            taken = free[::-1][: len(rows)]
            del free[len(free) - len(taken) :]
            ids = taken + (self._draw(table.name, len(rows) - len(taken)) if len(rows) > len(taken) else [])
            for row, new_id in zip(rows, ids, strict=True):
                row["id"] = new_id
            insert_rows(self.session, table, rows)
            return ids
        returned = self.session.execute(insert(table).returning(table.c.id, sort_by_parameter_order=True), rows)
        return [int(i) for i in returned.scalars()]


@cache
def _drawing(tables: int) -> Select[Any]:
    """A block of ids from each of `tables` sequences in one query (`ids_sequenceI`,
    `ids_countI`; columns `idsI`), built once per number of tables (`sql.Query`)."""
    return select(
        *(
            select(func.array_agg(func.nextval(cast(bindparam(f"ids_sequence{i}"), REGCLASS))))
            .select_from(func.generate_series(1, bindparam(f"ids_count{i}")))
            .scalar_subquery()
            .label(f"ids{i}")
            for i in range(tables)
        )
    )
