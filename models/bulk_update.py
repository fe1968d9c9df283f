"""Changed rows written as one `UPDATE ... FROM unnest(...)` per table and set of columns.

A batch of results changes a few thousand slots and attempts. The unit of work writes each
changed row with its own UPDATE (psycopg pipelines them, but the server still plans and runs
one statement per row, and the ORM builds a parameter set per row): most of a batch's flush.
On PostgreSQL, `write_changed_rows` runs before the flush (from the session's `before_flush`
hook) and writes the changed rows of the given tables itself, as

    UPDATE attempts AS t SET state = v.state, ...
    FROM unnest(CAST(:k0 AS BIGINT[]), CAST(:c0 AS VARCHAR(16)[]), ...) AS v(id, state, ...)
    WHERE t.id = v.id

with one array parameter per column (a statement psycopg prepares once), then marks those
objects clean so that the flush has nothing left to write for them. Rows are grouped by the
exact set of columns that changed, as the unit of work groups them: no column is written that
the ORM would not have written.

Left to the unit of work: other dialects (SQLite), rows whose changes include a relationship
or a primary-key column, and rows with an attribute not loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from typing import Any

from sqlalchemy import JSON, bindparam, inspect, text
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import NO_VALUE

#: Fewer changed rows than this in a table are left to the unit of work (one statement either way).
MIN_ROWS = 2


def write_changed_rows(session: Session, classes: Iterable[type]) -> int:
    """Write the pending changes of `classes`' persistent objects in bulk; returns the rows
    written. A no-op on a dialect other than PostgreSQL."""
    if session.get_bind().dialect.name != "postgresql":
        return 0
    wanted = tuple(classes)
    groups: dict[tuple[type, frozenset[str]], list[Any]] = {}
    for obj in session.dirty:
        if type(obj) not in wanted:
            continue
        keys = _changed_columns(obj)
        if keys:
            groups.setdefault((type(obj), keys), []).append(obj)
    written = 0
    # In the order of `classes`, and a table's shapes in a fixed order: every transaction
    # takes the row locks of a table in one statement order.
    for (cls, keys), objs in sorted(groups.items(), key=lambda kv: (wanted.index(kv[0][0]), sorted(kv[0][1]))):
        if len(objs) < MIN_ROWS:
            continue
        with session.no_autoflush:  # the rows not written yet stay pending
            _update(session, cls, sorted(keys), objs)
        identity_map = session.identity_map
        for obj in objs:
            state = inspect(obj)
            state._commit_all(state.dict, identity_map)  # written: nothing left for the flush
        written += len(objs)
    return written


def _changed_columns(obj: Any) -> frozenset[str] | None:
    """The columns the flush would write for `obj`, or None when the unit of work must write
    it (a relationship or a primary-key column changed, or a value is not loaded)."""
    state = inspect(obj)
    plain = _plain_columns(state.mapper)
    loaded = state.dict
    keys = []
    for name, before in state.committed_state.items():
        if name not in plain or name not in loaded:
            return None
        if before is NO_VALUE or before != loaded[name]:
            keys.append(name)
    return frozenset(keys) if keys else None


@cache
def _plain_columns(mapper: Any) -> frozenset[str]:
    """The mapper's column attributes that are not part of the primary key."""
    return frozenset(prop.key for prop in mapper.column_attrs if not prop.columns[0].primary_key)


def _update(session: Session, cls: type, keys: list[str], objs: list[Any]) -> None:
    mapper = inspect(cls)
    table = mapper.local_table
    dialect = session.get_bind().dialect
    primary = [column.key for column in table.primary_key.columns]
    columns = [mapper.column_attrs[key].columns[0] for key in keys]
    names = [*primary, *(column.name for column in columns)]
    arrays: dict[str, list[Any]] = {}
    casts = []
    for i, name in enumerate(primary):
        arrays[f"k{i}"] = [getattr(obj, name) for obj in objs]
        casts.append(f"CAST(:k{i} AS {table.c[name].type.compile(dialect)}[])")
    for i, (key, column) in enumerate(zip(keys, columns, strict=True)):
        values = [obj.__dict__[key] for obj in objs]
        if isinstance(column.type, JSON):
            # As the JSON type writes a value (None included: JSON null, not SQL NULL).
            values = [json.dumps(value) for value in values]
        else:
            process = column.type._cached_bind_processor(dialect)
            if process is not None:
                values = [process(value) for value in values]
        arrays[f"c{i}"] = values
        casts.append(f"CAST(:c{i} AS {column.type.compile(dialect)}[])")
    assignments = ", ".join(f"{column.name} = v.{column.name}" for column in columns)
    match = " AND ".join(f"t.{name} = v.{name}" for name in primary)
    statement = text(
        f"UPDATE {table.name} AS t SET {assignments} "
        f"FROM unnest({', '.join(casts)}) AS v({', '.join(names)}) WHERE {match}"
    ).bindparams(*(bindparam(name) for name in arrays))
    result = session.execute(statement, arrays)
    if result.rowcount != len(objs):
        raise RuntimeError(
            f"bulk update of {table.name} matched {result.rowcount} rows for {len(objs)} changed objects"
        )
