"""Several reads of the ledger in one statement (PostgreSQL): what `RowStore.load_all` runs
(and its `late` reads in a second one, in the same round trip).

A batch of results reads eight prefixes of the run's state before it decides (its attempts
and their slots, over-dispatch's counts, the caches' first loads: `RunContext.read_ahead`),
and each read alone is a round trip, whose latency a ledger on another host pays on every
batch (`bench overhead --rtt-ms`; on one machine the JSON costs about what the round trips
saved, bench/README.md). Here they are one statement, each read's rows aggregated into a JSON
array in its own order. JSON carries timestamps as text and whole numbers of float columns as
integers; each table's columns are read back to the types a plain query returns
(`_json_readers`). The reads of one statement see one snapshot; a late read sees too what was
committed before it ran, which under the run's lock changes nothing a batch reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache, lru_cache, partial
from typing import Any, TypeVar

from sqlalchemy import Float, Text, case, cast, func, literal_column, select
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement, Select

from refill.models import driver, sql
from refill.models.column_types import UTCDateTime, read_json

T = TypeVar("T")


@dataclass(frozen=True)
class Read:
    """One read of `RowStore.load_all`: `statement` (a `sql.Query`, or a plain statement)
    selects every column of `cls`'s table (a `rows.Row` class), in the table's order, then the
    columns named in `extra`; with no `cls`, just those. With `when` (a condition over the
    parameters of the reads it runs with), the read runs only where it holds, and returns None
    where it does not: a read a batch may not need costs the database nothing then."""

    cls: Any
    statement: Select | sql.Query
    extra: tuple[str, ...] = ()
    when: ColumnElement[bool] | None = None
    #: read in a second statement, which the server runs while this process reads the first's
    #: rows (`fetch`): for a read whose cost is the server's, not its few rows' (a count)
    late: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (*column_keys(self.cls), *self.extra)

    @property
    def query(self) -> sql.Query:
        return as_query(self.statement)


#: Whether to run a read: always, never, or where a condition (SQL) holds (`Read.when`).
When = bool | ColumnElement[bool]


def condition(flag: When) -> ColumnElement[bool] | None:
    """A `When` that says to run a read, as `Read.when` takes it."""
    if flag is False:
        raise ValueError("a read that never runs has no condition: leave it out")
    return None if flag is True else flag


def as_query(statement: Select | sql.Query) -> sql.Query:
    return statement if isinstance(statement, sql.Query) else sql.Query(statement, {})


@cache
def column_keys(cls: Any) -> tuple[str, ...]:
    """The columns of row class `cls`'s table, in the table's order (none for None)."""
    return tuple(cls.table.columns.keys()) if cls is not None else ()


def fetch(session: Session, reads: Sequence[Read], use: Callable[[Read, list[list[Any]] | None], T]) -> list[T]:
    """Run `reads` as one statement, and return `use` of each read and its rows (lists of values
    in `Read.names` order, of the types a plain query of them returns; None for a read whose
    `when` did not hold).

    The `late` reads go out as a second statement in the same round trip, once the first's row
    is in (`driver.rows_then`): the server runs them while this process reads and `use`s the
    others' rows (`use` must run no SQL). Where every read is late there is nothing to do
    meanwhile, and they are one statement."""
    params: dict[str, Any] = {}
    for read in reads:
        for name, value in read.query.params.items():
            if params.setdefault(name, value) != value:
                raise ValueError(f"load_all: two reads give parameter {name} different values")
    early = [read for read in reads if not read.late]
    late = [read for read in reads if read.late] if early else []
    early = early or list(reads)

    def used(part: list[Read], found: list[Any]) -> dict[int, T]:
        [row] = found
        return {id(read): use(read, _values(read, value_rows)) for read, value_rows in zip(part, row, strict=True)}

    if not late:
        out = used(early, driver.rows(session, _statement(early), params))
    else:
        out, found = driver.rows_then(session, (_statement(early), params), (_statement(late), params), partial(used, early))
        out.update(used(late, found))
    return [out[id(read)] for read in reads]


def _statement(reads: list[Read]) -> Select:
    return _together(tuple((read.cls, read.extra, read.query.statement, read.when) for read in reads))


def _values(read: Read, value_rows: str | None) -> list[list[Any]] | None:
    """A read's JSON array (text) as its rows' values, read back to a plain query's types."""
    if value_rows is None:  # its `when` did not hold
        return None
    rows = read_json(value_rows)
    width = len(read.names) - len(read.extra)
    for position, reader in _json_readers(read.cls, width):
        for values in rows:
            value = values[position]
            if value is not None:
                values[position] = reader(value)
    return rows


@lru_cache(maxsize=8192)
def _json_timestamp(value: str) -> datetime:
    # Cached: a batch's rows carry a few distinct times (every row a transaction writes has
    # its clock), each parsed once rather than once per row.
    return datetime.fromisoformat(value).astimezone(UTC)


@cache
def _json_readers(cls: Any, width: int) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
    """Where a read of `cls` needs its JSON values read back to what a plain query returns:
    (position, function) for its timestamps (text in JSON) and floats (1.0 comes back as 1,
    NaN as "NaN"). The extra columns past `width` are integers, read as they are."""
    if cls is None:
        return ()
    readers = []
    for position, column in enumerate(cls.table.columns):
        if isinstance(column.type, UTCDateTime):
            readers.append((position, _json_timestamp))
        elif isinstance(column.type, Float):
            readers.append((position, float))
    return tuple(r for r in readers if r[0] < width)


@lru_cache(maxsize=256)
def _json_row(alias: str, names: tuple[str, ...]) -> str:
    return f"json_build_array({', '.join(f'{alias}.{name}' for name in names)})"


@lru_cache(maxsize=256)
def _together(reads: tuple[tuple[Any, tuple[str, ...], Select, ColumnElement[bool] | None], ...]) -> Select:
    """The statement `fetch` runs for reads of these classes, extra columns, statements and
    conditions: each read's rows aggregated into a JSON array in its own order (NULL where its
    condition does not hold: a CASE, whose branch not taken PostgreSQL never runs). Built once
    for each combination of the statements `models/sql.py` builds once, so that its cache key
    is computed once too (a batch's reads come in a few combinations)."""
    arrays = []
    for i, (cls, extra, statement, when) in enumerate(reads):
        order = statement._order_by_clauses
        if order:
            # The row's place in the read's order, numbered before its LIMIT applies: the
            # aggregate is ordered by it (a subquery's order does not bind an aggregate).
            statement = statement.add_columns(func.row_number().over(order_by=order).label("refill_n"))
        alias = f"refill_read_{i}"
        row = literal_column(_json_row(alias, (*column_keys(cls), *extra)))
        agg = func.json_agg(aggregate_order_by(row, literal_column(f"{alias}.refill_n"))) if order else func.json_agg(row)
        array = select(func.coalesce(agg, literal_column("'[]'::json"))).select_from(statement.subquery(alias)).scalar_subquery()
        # As text, read by orjson in `fetch` (`read_json`): the ledger's own columns, which it
        # reads exactly, where psycopg's loader of JSON is the standard library's (user data).
        arrays.append(cast(array if when is None else case((when, array)), Text))
    return select(*arrays)
