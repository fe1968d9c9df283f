"""Statements the ledger runs on psycopg directly, past SQLAlchemy's execution (PostgreSQL;
elsewhere each falls back to SQLAlchemy): the reads that run every batch or relay pass
(`rows`), new rows as one `COPY` (`insert_rows`) or, a few, as arrays (`unnest_insert`), a
change set's writes in one round trip (`send_changes`, `execute_pipelined`), and the spellings they need
(`driver_values`, `array_text`). Each keeps what SQLAlchemy's execution gives its callers: the
engine's cursor listeners see the statement, and a driver error comes out as SQLAlchemy's (so
that `Ledger.transaction` retries what it would retry)."""

from __future__ import annotations

import re
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from enum import Enum
from functools import lru_cache, partial
from types import NoneType
from typing import Any, TypeVar

from psycopg import RawCursor
from sqlalchemy import JSON, Boolean, Float, Integer, String, Table, insert
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import Null

from refill.models.column_types import UTCDateTime, json_text

T = TypeVar("T")


def rows(session: Session, statement: Executable, params: dict[str, Any]) -> list[Any]:
    """The rows `statement` (a read built once, as `sql.Query` keeps them) returns for
    `params`, as SQLAlchemy's `session.execute(statement, params).all()` returns them: tuples
    whose columns are attributes too, each value through its column type's result processor.

    On PostgreSQL the statement is compiled once and run on psycopg's cursor: SQLAlchemy's
    execution of a built statement still costs 0.3 to 0.7 ms of Python each time (the execution
    context, parameters and result set up anew), about a tenth of a batch of results' own
    Python in `bench overhead` over the joint read, the run's lock and the relay's reads
    (bench/HISTORY.md, stop 40). The session's transaction is the one it runs in; a session
    that autoflushes is flushed first, as `execute` would."""
    connection = _connection(session)
    dialect = connection.dialect
    if dialect.name != "postgresql":
        return list(session.execute(statement, params).all())
    shape, sql_text, values = _bound(dialect, statement, params)
    with _on_driver(connection, sql_text, values, executemany=False) as raw, _sent(raw, shape, sql_text, values) as cursor:
        found = cursor.fetchall()
        readers = shape.readers(dialect, cursor)
    return _made(shape, found, readers)


def _sent(raw: Any, shape: _Shape, sql_text: str, values: dict[str, Any]) -> Any:
    """A cursor of psycopg's connection `raw` that has executed the bound statement (to close
    after its rows are read: use it as a context manager)."""
    if shape.numbered is None:
        cursor = raw.cursor()
        cursor.execute(sql_text, values)
    else:
        cursor = RawCursor(raw)
        cursor.execute(shape.numbered, [values[name] for name in shape.order])
    return cursor


def _made(shape: _Shape, found: list[Any], readers: list[tuple[int, Callable[[Any], Any]]]) -> list[Any]:
    """Rows as `rows` returns them, from psycopg's value tuples."""
    make = shape.row
    if not readers:
        return [make(*values) for values in found]
    out = []
    for values in found:
        row = list(values)
        for i, read in readers:
            row[i] = read(row[i])
        out.append(make(*row))
    return out


def rows_then(
    session: Session,
    first: tuple[Executable, dict[str, Any]],
    then: tuple[Executable, dict[str, Any]],
    meanwhile: Callable[[list[Any]], T],
) -> tuple[T, list[Any]]:
    """`meanwhile` of the rows `first` returns, and the rows `then` returns, as `rows` returns
    them: on PostgreSQL `then` goes out as soon as `first`'s rows are in, in the same round
    trip's pipeline, and the server runs it while this process runs `meanwhile` (which must
    run no SQL: the connection is still in `then`'s round trip). For a read whose work is
    the server's (a count over thousands of index entries) after one whose work is this
    process's (rows to parse and adopt).

    `then` sees what `first` saw, and what other transactions committed in between: for reads
    under the run's lock, the same."""
    connection = _connection(session)
    dialect = connection.dialect
    if dialect.name != "postgresql":
        got = meanwhile(list(session.execute(*first).all()))
        return got, list(session.execute(*then).all())
    statements = [_bound(dialect, statement, params) for statement, params in (first, then)]
    for i, (_, sql_text, values) in enumerate(statements):
        _announce(connection, sql_text, values, pipelined=i > 0)
    raw = connection.connection.driver_connection
    (shape, sql_text, values), (then_shape, then_text, then_values) = statements
    try:
        with raw.pipeline():
            # `then` goes out only once `first`'s rows are in: psycopg's fetch of a pipeline's
            # results waits for every statement sent before it, so `then` sent with `first`
            # would have to finish before `meanwhile` could start (tried: record 7% slower).
            with _sent(raw, shape, sql_text, values) as cursor:
                rows_of_first = _made(shape, cursor.fetchall(), shape.readers(dialect, cursor))
            with _sent(raw, then_shape, then_text, then_values) as cursor:
                got = meanwhile(rows_of_first)
                found = _made(then_shape, cursor.fetchall(), then_shape.readers(dialect, cursor))
    except dialect.loaded_dbapi.Error as error:
        raise _as_sqlalchemy_error(connection, f"{sql_text}; {then_text}", error) from error
    for _, sql_text, values in statements:
        connection.dispatch.after_cursor_execute(connection, None, sql_text, values, None, False)
    return got, found


def execute(session: Session, statements: list[tuple[Executable, dict[str, Any]]]) -> list[int]:
    """Run `statements` (writes built once, each with its parameters) in order, in one round
    trip on PostgreSQL (`execute_pipelined`, compiled once as for `rows`); returns each one's
    row count."""
    connection = _connection(session)
    dialect = connection.dialect
    if dialect.name != "postgresql":
        return [session.execute(statement, params).rowcount for statement, params in statements]
    return execute_pipelined(session, [bound(dialect, statement, params) for statement, params in statements])


def _connection(session: Session) -> Connection:
    """The session's connection, in its transaction; pending objects flushed first where the
    session autoflushes (as its `execute` would)."""
    if session.autoflush and (session.new or session.dirty or session.deleted):
        session.flush()
    return session.connection()


@contextmanager
def _on_driver(connection: Connection, statement: str, parameters: Any, *, executemany: bool) -> Iterator[Any]:
    """psycopg's connection under `connection`, for one statement sent past SQLAlchemy: the
    engine's cursor listeners see it before and after (statement counts, `bench overhead
    --rtt-ms`, tests; a no-op when none listens), and a driver error comes out as SQLAlchemy's."""
    connection.dispatch.before_cursor_execute(connection, None, statement, parameters, None, executemany)
    try:
        yield connection.connection.driver_connection
    except connection.dialect.loaded_dbapi.Error as error:
        raise _as_sqlalchemy_error(connection, statement, error) from error
    connection.dispatch.after_cursor_execute(connection, None, statement, parameters, None, executemany)


def bound(dialect: Dialect, statement: Executable, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`statement` (built once) with `params`, as `execute_pipelined` takes it."""
    return _bound(dialect, statement, params)[1:]


def _bound(dialect: Dialect, statement: Executable, params: dict[str, Any]) -> tuple[_Shape, str, dict[str, Any]]:
    """`statement`'s compiled form, SQL text and parameter values, as psycopg takes them, for
    `params`."""
    shape = _compiled(statement, dialect)
    if shape.fixed is not None:
        sql_text, values, processors = shape.fixed, shape.compiled.construct_params(params), shape.bind_processors
    else:
        expanded = shape.compiled.construct_expanded_state(params)
        sql_text, values = expanded.statement, dict(expanded.parameters)
        processors = {**shape.bind_processors, **expanded.processors}
    for name, process in processors.items():
        if name in values:
            values[name] = process(values[name])
    return shape, sql_text, values


class _Shape:
    """A statement compiled for `rows`, with what reading its rows takes."""

    __slots__ = ("compiled", "fixed", "numbered", "order", "bind_processors", "row", "types", "_readers")

    def __init__(self, compiled: SQLCompiler) -> None:
        self.compiled = compiled
        #: the SQL of every execution, where no value is written into it per execution; else None
        self.fixed: str | None = None
        #: each parameter's type's bind processor, as an execution through SQLAlchemy applies it
        #: (an id list's array text, a timestamp's check): the compiled statement's own, and
        #: those of the values written in at execution
        self.bind_processors: Mapping[str, Callable[[Any], Any]] = compiled._bind_processors
        late = [*compiled.literal_execute_params, *compiled.post_compile_params]
        if all(param.key.startswith("%(") for param in late):
            # Every value written into the SQL at execution is an anonymous one, given when
            # the statement was built (`sql.literal`, `sql.literal_in` of a constant): written
            # in once here, not on every execution (SQLAlchemy scans the statement's text for
            # them each time: 14 KB for a batch's joint read). A named one (`sql._literal_list`)
            # is the caller's, per execution. The parameters a caller gives stay placeholders,
            # whatever value stands in for them here.
            given = {name: None for param, name in compiled.bind_names.items() if param.required}
            expanded = compiled.construct_expanded_state(given)
            self.fixed = expanded.statement
            self.bind_processors = {**compiled._bind_processors, **expanded.processors}
        #: `fixed` with PostgreSQL's own placeholders, and the names of its parameters in their
        #: order (`_numbered`); None where the SQL is written anew per execution
        self.numbered: bytes | None = None
        self.order: tuple[str, ...] = ()
        if self.fixed is not None:
            self.numbered, self.order = _numbered(self.fixed)
        columns = compiled._result_columns
        #: a tuple class with the statement's column names, as SQLAlchemy's rows have them
        self.row: Callable[..., Any] = namedtuple("Row", [column.keyname for column in columns], rename=True)  # type: ignore[misc]
        self.types = [column.type for column in columns]
        #: (position, result processor) of each column that has one; None until the first
        #: execution, whose cursor says the database's type of each column (a processor may
        #: depend on it: a float column read from a numeric)
        self._readers: list[tuple[int, Callable[[Any], Any]]] | None = None

    def readers(self, dialect: Dialect, cursor: Any) -> list[tuple[int, Callable[[Any], Any]]]:
        if self._readers is None:
            # Asked only here: psycopg builds `description` anew on every access (py-spy: 2% of
            # a batch of results' samples and 5% of a relay pass's when every execution asked).
            found = (kind._cached_result_processor(dialect, column.type_code) for kind, column in zip(self.types, cursor.description, strict=True))
            self._readers = [(i, read) for i, read in enumerate(found) if read is not None]
        return self._readers


#: A placeholder of psycopg's `%(name)s` style, or its escaped percent sign.
_PLACEHOLDER = re.compile(r"%\(([^)]+)\)s|%%")


def _numbered(statement: str) -> tuple[bytes, tuple[str, ...]]:
    """`statement` with PostgreSQL's `$n` placeholders for psycopg's `%(name)s` (one number
    per name), as psycopg's `RawCursor` takes it, and the names in number order.

    psycopg rewrites a statement's placeholders on every execution, and keeps the rewriting
    only for statements under 4 KB and 50 parameters: a batch's joint read (14 KB) was
    rewritten each time, about half a millisecond (py-spy, bench/HISTORY.md stop 44). A
    statement built once is rewritten once here."""
    numbers: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        return "%" if name is None else f"${numbers.setdefault(name, len(numbers) + 1)}"

    return _PLACEHOLDER.sub(number, statement).encode(), tuple(numbers)


@lru_cache(maxsize=512)
def _compiled(statement: Executable, dialect: Dialect) -> _Shape:
    """`statement` compiled for `dialect`, once: the statements `rows` runs are built once, so
    the object is its key (as it is SQLAlchemy's cache key's)."""
    compiled = statement.compile(dialect=dialect)
    assert isinstance(compiled, SQLCompiler)
    return _Shape(compiled)


def insert_rows(executor: Session | Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Insert `rows` (dicts with the same keys) into `table`, as a Core `insert(table)` of
    them would: a column they leave out takes its default, a JSON column's None is JSON null,
    SQLAlchemy's `null()` SQL NULL.

    On PostgreSQL with `COPY ... FROM STDIN`: a batch of results inserts about 90 rows into
    three tables, which an executemany sends as one INSERT per row (pipelined, but each parsed,
    planned and run by the server on its own: a fifth of the batch's time in `bench overhead`)
    and `INSERT ... SELECT FROM unnest(...)` as arrays that psycopg spells element by element
    in Python; COPY's rows are formatted in psycopg's C code and read by the server in one
    pass (4.4 and 3.1 ms against 1.6 ms for 90 new attempts, bench/HISTORY.md, stop 31; since stop 42
    `array_text` spells the arrays, and a batch's few rows go out as `unnest_insert` with its
    UPDATEs). The engine's `before_cursor_execute` and `after_cursor_execute` listeners see it
    as one executemany of `rows`; a driver error comes out as SQLAlchemy's, as from
    `session.execute`, so that `Ledger.transaction` retries what it would retry. Elsewhere
    (SQLite) an executemany."""
    if not rows:
        return
    connection = executor.connection() if isinstance(executor, Session) else executor
    dialect = connection.dialect
    if dialect.name != "postgresql":
        connection.execute(insert(table), rows)
        return
    names, columns = _insert_columns(dialect, table, rows)
    statement = f"COPY {table.name} ({', '.join(names)}) FROM STDIN"
    # Listeners see the COPY as the executemany of `rows` they would have seen.
    with _on_driver(connection, statement, rows, executemany=True) as raw, raw.cursor() as cursor, cursor.copy(statement) as copy:
        for values in zip(*columns, strict=True):
            copy.write_row(values)


def unnest_insert(dialect: Dialect, table: Table, rows: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """`INSERT INTO table (...) SELECT * FROM unnest(...)` of `rows` (dicts with the same keys,
    as `insert_rows` takes them), one array parameter per column, as psycopg takes it
    (`execute_pipelined`), with its values: PostgreSQL only.

    A COPY is a round trip of its own, and two waits (its start, then its end), which no other
    statement can share: a batch of results inserting into three tables waited six times
    before its UPDATEs went out. This statement goes out in the same round trip as the UPDATEs
    (`RowStore.write`), and the server runs it while the next one is spelled. For a few dozen
    rows that is quicker than COPY; for thousands (a step's admission) COPY's own format is."""
    names, columns = _insert_columns(dialect, table, rows)
    return _insert_statement(dialect, table, tuple(names)), {f"c{i}": array_text(values) for i, values in enumerate(columns)}


@lru_cache(maxsize=256)
def _insert_statement(dialect: Dialect, table: Table, names: tuple[str, ...]) -> str:
    casts = ", ".join(f"CAST(%(c{i})s AS {table.c[name].type.compile(dialect)}[])" for i, name in enumerate(names))
    return f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({casts})"


def unnest_update(dialect: Any, table: Table, keys: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """`UPDATE table AS t SET c = v.c ... FROM unnest(...) AS v(...) WHERE t.pk = v.pk` of
    `rows` (the primary key and `keys` of each), one array parameter per column (a statement
    psycopg prepares once, whatever the row count), as psycopg takes it (`execute_pipelined`),
    with its values. `bench overhead`'s floor writes its updates with it too."""
    primary = tuple(column.key for column in table.primary_key.columns)
    arrays: dict[str, Any] = {}
    for i, name in enumerate(primary):
        arrays[f"k{i}"] = array_text(driver_values(dialect, table.c[name], [row[name] for row in rows]))
    for i, key in enumerate(keys):
        # As a per-row update writes each value: a JSON None is JSON null, an int in a float
        # column a float (psycopg refuses an array of mixed types).
        arrays[f"c{i}"] = array_text(driver_values(dialect, table.c[key], [row[key] for row in rows]))
    return _unnest_statement(dialect, table, primary, tuple(keys)), arrays


@lru_cache(maxsize=512)
def _unnest_statement(dialect: Any, table: Table, primary: tuple[str, ...], keys: tuple[str, ...]) -> str:
    """The SQL of `unnest_update`, built once per table and set of columns."""
    casts = [f"CAST(%(k{i})s AS {table.c[name].type.compile(dialect)}[])" for i, name in enumerate(primary)]
    casts += [f"CAST(%(c{i})s AS {table.c[key].type.compile(dialect)}[])" for i, key in enumerate(keys)]
    assignments = ", ".join(f"{key} = v.{key}" for key in keys)
    match = " AND ".join(f"t.{name} = v.{name}" for name in primary)
    names = [*primary, *keys]
    return (
        f"UPDATE {table.name} AS t SET {assignments} "
        f"FROM unnest({', '.join(casts)}) AS v({', '.join(names)}) WHERE {match}"
    )


def _insert_columns(dialect: Dialect, table: Table, rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The columns an insert of `rows` writes and each one's values as the driver takes them
    (`driver_values`), as a Core `insert(table)` of them would write: a column the rows leave
    out takes its scalar default (a computed one must be given), or the server's."""
    names = list(rows[0])
    columns = [driver_values(dialect, table.c[name], [row[name] for row in rows]) for name in names]
    for column in table.columns:
        if column.key not in rows[0] and column.default is not None:
            if not column.default.is_scalar:
                raise ValueError(f"insert_rows: give {table.name}.{column.key} a value (its default is computed)")
            names.append(column.key)
            columns.append(driver_values(dialect, column, [column.default.arg] * len(rows)))
    return names, columns


#: True in `Connection.info` while the engine's `before_cursor_execute` listeners see a
#: statement that goes out in the round trip of the one before it (`execute_pipelined`): a
#: listener that stands for the network's latency (`bench overhead --rtt-ms`) charges one.
PIPELINED = "refill.pipelined"


def execute_pipelined(executor: Session | Connection, statements: Iterable[tuple[str, dict[str, Any]]]) -> list[int]:
    """Run `statements` (each SQL as psycopg takes it, with `%(name)s` parameters, and their
    values) in order in one round trip, PostgreSQL only: psycopg's pipeline mode sends each
    without waiting for the one before. Returns each one's row count.

    A batch's changed rows go out as up to eight `UPDATE ... FROM unnest` statements, which
    through SQLAlchemy would each wait for the one before. `statements` may be built as they are
    taken (a generator): each goes out before the next is built, so the server runs one while
    this process builds the next. The engine's listeners see each statement as it goes out, as
    they see an executed one; an error comes out as SQLAlchemy's, as from `session.execute`."""
    connection = executor.connection() if isinstance(executor, Session) else executor
    dialect = connection.dialect
    raw = connection.connection.driver_connection
    sent: list[tuple[str, dict[str, Any]]] = []
    cursors = []
    try:
        with raw.pipeline():
            for statement, parameters in statements:
                _announce(connection, statement, parameters, pipelined=bool(sent))
                sent.append((statement, parameters))
                cursors.append(cursor := raw.cursor())
                cursor.execute(statement, parameters)
        counts = [cursor.rowcount for cursor in cursors]
    except dialect.loaded_dbapi.Error as error:
        raise _as_sqlalchemy_error(connection, "; ".join(statement for statement, _ in sent), error) from error
    finally:
        for cursor in cursors:
            cursor.close()
    for statement, parameters in sent:
        connection.dispatch.after_cursor_execute(connection, None, statement, parameters, None, False)
    return counts


def _announce(connection: Connection, statement: str, parameters: dict[str, Any], *, pipelined: bool) -> None:
    """The engine's `before_cursor_execute` listeners see a statement about to go out, told
    (`PIPELINED`) whether it shares the round trip of the one before it."""
    connection.info[PIPELINED] = pipelined
    try:
        connection.dispatch.before_cursor_execute(connection, None, statement, parameters, None, False)
    finally:
        connection.info.pop(PIPELINED, None)


def _as_sqlalchemy_error(connection: Connection, statement: str, error: Exception) -> DBAPIError:
    """A driver's error as SQLAlchemy raises it from `execute` (so `Ledger.transaction` retries
    what it would retry), the connection invalidated when the error says it is gone."""
    dialect = connection.dialect
    invalidated = dialect.is_disconnect(error, connection.connection.driver_connection, None)
    if invalidated:
        connection.invalidate(error)
    return DBAPIError.instance(
        statement, None, error, dialect.loaded_dbapi.Error, connection_invalidated=invalidated, dialect=dialect
    )


#: The Python type each column type's values are written as. COPY takes the driver's text
#: of each value as it is, where a Core insert casts its parameter to the column's type: a bool
#: in an integer column would be 't', not 1. An array parameter (`UPDATE ... FROM unnest`)
#: must hold one type: psycopg refuses an int beside floats.
_ITEM_TYPE: tuple[tuple[type, type], ...] = ((Boolean, bool), (Float, float), (Integer, int), (String, str))


def driver_values(dialect: Any, column: Any, values: list[Any]) -> list[Any]:
    """`column`'s values as the driver must get them for COPY or one array parameter: through
    the column type's bind processor, a JSON value as its text, each value of the column's own
    Python type (psycopg refuses a list of mixed types, such as an int beside floats)."""
    kind = column.type
    if isinstance(kind, JSON):
        return [None if isinstance(value, Null) else json_text(value) for value in values]
    process = kind._cached_bind_processor(dialect)
    if process is not None and isinstance(kind, UTCDateTime):
        # A batch's timestamps are a few values (every row a transaction writes has its
        # clock): each is processed once, not once per row (32,000 calls a step).
        done = {value: process(value) for value in set(values)}
        values = [done[value] for value in values]
    elif process is not None:
        values = [process(value) for value in values]
    item = next((item for base, item in _ITEM_TYPE if isinstance(kind, base)), None)
    if item is not None and not {type(value) for value in values} <= {item, NoneType}:
        values = [None if value is None else item(value.value if isinstance(value, Enum) else value) for value in values]
    return values


def _timestamp_text(value: datetime) -> str:
    return '"' + value.isoformat(" ") + '"'


@lru_cache(maxsize=256)
def _quoted(value: str) -> str:
    # Cached: an array's strings are mostly a few states and kinds, over and over. Small: an
    # error text may be 4,000 characters, and a consumer lives for months.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: How `array_text` writes a value of each Python type an array parameter holds (a timestamp:
#: `_timestamp_text`, once per distinct value).
_ELEMENT_TEXT: dict[type, Any] = {
    int: str,
    float: repr,  # the shortest exact form; 'nan', 'inf' and '-inf' are PostgreSQL's too
    bool: lambda value: "t" if value else "f",
    str: _quoted,
}


def array_text(values: list[Any]) -> str | list[Any]:
    """`values` (one Python type and None, as `driver_values` returns them) as the text of a
    PostgreSQL array, `{1,NULL,3}`, for a parameter the statement casts to the array's type;
    the list itself for a type not written here (psycopg then spells it).

    psycopg spells a list parameter element by element in Python, about 1 µs a number or a
    string and 6 µs a timestamp: a batch's `UPDATE ... FROM unnest` sends a couple of thousand
    values, about a tenth of its Python (bench/README.md). Joined here it is a tenth of that."""
    kinds = {type(value) for value in values}
    nulls = NoneType in kinds
    kinds.discard(NoneType)
    if len(kinds) > 1:
        return values
    kind = kinds.pop() if kinds else NoneType
    if kind is datetime:
        # A step's timestamps are few values (`bench overhead`: 3,074 among 82,941): each is
        # spelled once (`isoformat` for every value was 3% of a batch's Python). Equal aware
        # timestamps are one instant, which is what a timestamptz stores.
        spelled = {value: "NULL" if value is None else _timestamp_text(value) for value in set(values)}
        return "{" + ",".join([spelled[value] for value in values]) + "}"
    text = str if kind is NoneType else _ELEMENT_TEXT.get(kind)
    if text is None:
        return values
    if not nulls:  # most arrays: ids, counters, states
        return "{" + ",".join(map(text, values)) + "}"
    return "{" + ",".join(["NULL" if value is None else text(value) for value in values]) + "}"


#: Up to how many new rows of a table `send_changes` inserts with an `INSERT ... SELECT FROM
#: unnest` in the round trip of the UPDATEs (`unnest_insert`), not a COPY of their own:
#: a batch of results makes a few dozen a table, a step's admission thousands (bench/HISTORY.md,
#: stop 42).
PIPELINED_INSERT_ROWS = 256


def send_changes(
    executor: Session | Connection,
    inserts: Sequence[tuple[Table, list[dict[str, Any]]]],
    updates: Sequence[tuple[Table, Sequence[str], Sequence[Mapping[str, Any]]]],
    handed: Sequence[tuple[Any, int]] = (),
) -> None:
    """PostgreSQL: insert each table's new rows (`inserts`, in table order, as `insert_rows`
    takes them), then update each table's changed ones (`updates`: the columns set and the rows,
    primary key included, each an `UPDATE ... FROM unnest`), then run the `handed` (a built-once
    `sql.hand_over` and the most rows it may change), checking every statement's count.

    A table's few new rows (up to `PIPELINED_INSERT_ROWS`) and the UPDATEs go out together in
    one round trip (`execute_pipelined`); more go out as a COPY of their own, after the
    pending inserts of the tables before it (its rows may reference theirs). `RowStore.write`
    writes a batch's changes with it, and `bench overhead`'s floor the same rows."""
    dialect = executor.get_bind().dialect if isinstance(executor, Session) else executor.dialect
    # Each statement is built as the pipeline takes it: the server runs one while the next is
    # built (its arrays spelled as text, a sixth of a batch's CPU).
    pending: list[tuple[str, Table, int, Callable[[], tuple[str, dict[str, Any]]]]] = []
    for table, values in inserts:
        if len(values) <= PIPELINED_INSERT_ROWS:
            pending.append(("insert", table, len(values), partial(unnest_insert, dialect, table, values)))
        else:
            _send_pipelined(executor, pending)
            pending = []
            insert_rows(executor, table, values)
    for table, keys, rows in updates:
        pending.append(("update", table, len(rows), partial(unnest_update, dialect, table, keys, rows)))
    for (statement, params), most in handed:
        pending.append(("hand-over", statement.table, most, partial(bound, dialect, statement, params)))
    _send_pipelined(executor, pending)


def _send_pipelined(executor: Session | Connection, pending: list[tuple[str, Table, int, Callable[[], tuple[str, dict[str, Any]]]]]) -> None:
    if not pending:
        return
    counts = execute_pipelined(executor, (build() for *_, build in pending))
    for (what, table, rows, _), count in zip(pending, counts, strict=True):
        check_count(what, table, count, rows)


def check_count(what: str, table: Table, count: int, rows: int) -> None:
    # A hand-over matches the one live attempt of each slot, or none (an open slot may have none).
    if count not in (rows, -1) and not (what == "hand-over" and 0 <= count < rows):
        kind = {"update": "changed rows", "hand-over": "slots"}.get(what, "new rows")
        raise RuntimeError(f"{what} of {table.name} matched {count} rows for {rows} {kind}")
