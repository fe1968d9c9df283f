"""The rows one ledger operation works on: plain objects, read and written with Core.

A `RunContext` (models/context.py) decides over the run's row, its steps, slots, attempts,
groups and spare prompts while it holds the run's lock. It keeps them here as `Row`s, plain
Python objects with one attribute per column (the ORM's names: `slot.filtered += 1` reads the
same), and writes what changed when the operation flushes:

1. **new rows** as one statement per table (a step, attempts, then the groups that reference
   them, and outbox rows), with their ids drawn up front (`models/ids.py`): on PostgreSQL a
   table's few rows as `INSERT ... SELECT FROM unnest(...)` (`driver.unnest_insert`), its
   thousands as a `COPY` (`driver.insert_rows`);
2. **changed rows** as one `UPDATE` per table and set of changed columns: on PostgreSQL
   `UPDATE t SET c = v.c FROM unnest(:ids, :c...) AS v(...)` with one array parameter per
   column, a write's every UPDATE sent in one round trip with its few new rows
   (`driver.send_changes`, which `bench overhead`'s floor writes with too), elsewhere an
   executemany. A row's changes are found by comparing the columns set since it was read or
   last written with the values they held then (`Row._set`, kept by the row as each column is
   first set), among the rows set since the last write (a row lists itself in its store's
   `_setting` at its first set: a batch reads hundreds of rows and sets a few dozen), so a
   column nobody set is never written back:
   a worker's heartbeat or lease handshake, committed meanwhile to other columns of the same
   attempt, survives.

Why not the ORM: for a batch of 64 results the unit of work's own Python (instrumented
attributes, identity map, building a parameter set per row) cost more than the decisions and
the database together (bench/README.md, `bench overhead`). The store is a dictionary per table
keyed by primary key, so a row read twice in one operation is one object, as in the ORM's
identity map; a row another statement changed in the database is patched here (`patched`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache, lru_cache
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

from sqlalchemy import (
    JSON,
    Table,
    and_,
    bindparam,
    insert,
    null,
    update,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

from refill.models import driver, joint_read, sql
from refill.models.joint_read import Read, as_query
from refill.models.tables import Attempt, Group, Outbox, Run, Slot, SparePrompt, Step

_MISSING = object()
#: `Row._set` of a row not inserted yet: its insert writes it whole, so nothing is kept.
_NEW: Mapping[str, Any] = MappingProxyType({})


class Row:
    """A table row as a plain object: one attribute per column read (or set).

    Its `__dict__` holds the row's values and nothing else: it is what a write compares and
    sends. `_set`, a slot outside it, maps each column set since the row was last read or
    written to the value it held then (what the database holds), so that a write compares
    those rather than every column of every row it holds, and no row is copied to be compared
    later; None when none was set, `_NEW` for a row not inserted yet."""

    __slots__ = ("__dict__", "_set", "_setting")
    table: ClassVar[Table]

    def __init__(self, values: dict[str, Any], setting: list[Row], new: bool = False) -> None:
        # The row's own dict: loaded rows build one per row anyway.
        object.__setattr__(self, "__dict__", values)
        object.__setattr__(self, "_set", _NEW if new else None)
        # Its store's list of the rows set since its last write (`RowStore._setting`): a
        # write looks at those, not at every row the operation read.
        object.__setattr__(self, "_setting", setting)

    def __setattr__(self, name: str, value: Any) -> None:
        values = self.__dict__
        touched = self._set
        if touched is None:
            object.__setattr__(self, "_set", {name: values.get(name, _MISSING)})
            self._setting.append(self)
        elif touched is not _NEW and name not in touched:
            touched[name] = values.get(name, _MISSING)
        values[name] = value

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if k in _REPR.get(type(self), ()))
        return f"{type(self).__name__}({shown})"


class RunRow(Row):
    table = Run.__table__


class StepRow(Row):
    table = Step.__table__


class SlotRow(Row):
    table = Slot.__table__


class AttemptRow(Row):
    table = Attempt.__table__


class GroupRow(Row):
    table = Group.__table__


class SpareRow(Row):
    table = SparePrompt.__table__


class OutboxRow(Row):
    table = Outbox.__table__


def _written(row: Row) -> None:
    """`row` holds what the database holds (read, or just written)."""
    object.__setattr__(row, "_set", None)


def _saved_values(row: Row) -> dict[str, Any] | None:
    """`row`'s columns as the database holds them (those read or written); None for a row not
    inserted yet."""
    touched = row._set
    if touched is _NEW:
        return None
    if not touched:
        return row.__dict__
    saved = dict(row.__dict__)
    for name, before in touched.items():
        if before is _MISSING:
            del saved[name]  # set here, never read: not known here
        else:
            saved[name] = before
    return saved


_REPR: dict[type, tuple[str, ...]] = {
    RunRow: ("id", "name", "status", "next_step", "weight_version"),
    StepRow: ("step", "status", "num_slots", "committed", "shrunk"),
    SlotRow: ("step", "idx", "status", "group_attempt_id", "needs_replacement"),
    AttemptRow: ("id", "step", "slot_idx", "state", "reason"),
    GroupRow: ("attempt_id", "weight_version", "parked"),
    SpareRow: ("id", "prompt_id", "taken_at"),
    OutboxRow: ("id", "kind", "step"),
}

#: Tables in the order their new rows are inserted (a step before what references it; groups
#: reference attempts) and their changed rows are written (the run, whose row
#: the transaction locked first, then its steps and slots: every transaction takes them in
#: that order, one lock order).
_INSERT_ORDER: tuple[type[Row], ...] = (StepRow, AttemptRow, GroupRow, OutboxRow)
_UPDATE_ORDER: tuple[type[Row], ...] = (RunRow, StepRow, SlotRow, AttemptRow, GroupRow, SpareRow)
_UPDATED = frozenset(_UPDATE_ORDER)

#: Columns a table's UPDATE may write for a row although they did not change in it: a batch's
#: rows change in a dozen different ways, and one statement per way costs a round trip each;
#: when a table's rows changed in more than one way, each is written with the union of these.
#: Only columns that no transaction without the run's lock writes are listed (a worker's lease
#: handshake and heartbeats write other columns of an attempt), so writing back a value read
#: under the lock is writing the current one.
_UNIFORM_COLUMNS: dict[type[Row], frozenset[str]] = {
    SlotRow: frozenset(
        (
            "status", "group_attempt_id", "shrink_reason", "needs_replacement", "filtered",
            "filter_replacements", "infra_failures", "data_failures", "drops", "drop_replacements",
            "borrowed_in", "lent_out", "attempts", "settled_at",
        )
    ),
    AttemptRow: frozenset(
        (
            "state", "failure_kind", "error", "finished_at", "weight_version", "generation_seconds",
            "rewards", "reward_mean", "reward_min", "reward_max", "zero_variance", "num_tokens",
        )
    ),
}


def _key_of(cls: type[Row]):  # type: ignore[no-untyped-def]
    if cls is StepRow:
        return lambda values: values["step"]
    if cls is SlotRow:
        return lambda values: (values["step"], values["idx"])
    if cls is GroupRow:
        return lambda values: values["attempt_id"]
    return lambda values: values["id"]


_KEYS = {cls: _key_of(cls) for cls in (RunRow, StepRow, SlotRow, AttemptRow, GroupRow, SpareRow, OutboxRow)}


class RowStore:
    """The rows of one run that an operation has read or made, by table and primary key."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.postgres = session.get_bind().dialect.name == "postgresql"
        self.runs: dict[int, RunRow] = {}
        #: the run's steps by number (a store holds one run's rows)
        self.steps: dict[int, StepRow] = {}
        self.slots: dict[tuple[int, int], SlotRow] = {}
        self.attempts: dict[int, AttemptRow] = {}
        self.groups: dict[int, GroupRow] = {}
        self.spares: dict[int, SpareRow] = {}
        self._maps: dict[type[Row], dict[Any, Any]] = {
            RunRow: self.runs,
            StepRow: self.steps,
            SlotRow: self.slots,
            AttemptRow: self.attempts,
            GroupRow: self.groups,
            SpareRow: self.spares,
        }
        self._new: dict[type[Row], list[Row]] = {cls: [] for cls in _INSERT_ORDER}
        #: the rows read here that were set since they were read or last written (each
        #: appends itself at its first set): what a write compares, without walking every row
        #: the operation read
        self._setting: list[Row] = []
        #: how many times rows were written to the database: a count read before a write is
        #: not the database's count after it (see `unwritten_change`)
        self.writes = 0
        #: run id -> slots whose live attempts, not read here, serve their steps as extras from
        #: the next write on (`RunContext.hand_over`): one UPDATE by slot, after the others,
        #: which leaves alone the attempts made here (`made_attempts`)
        self.handed_over: dict[int, list[tuple[int, int]]] = {}
        self.made_attempts: list[int] = []

    # --- reading -------------------------------------------------------------------------

    def load(self, cls: type[Row], statement: Select | sql.Query, *, refresh: bool = False) -> list[Any]:
        """The rows `statement` selects (columns of `cls.table`, the primary key among them),
        in its order. A row already here is returned as it is here: this operation's changes
        are newer than what the database holds until they are written. With `refresh` (a read
        that locks the rows), the columns this operation did not change take the values read:
        another transaction may have written them since the row was first read."""
        if isinstance(statement, sql.Query):
            # Built once for its shape: compiled once, run on the driver.
            found = driver.rows(self.session, *statement)
            return self.adopt(cls, found[0]._fields if found else (), found, refresh=refresh)
        result = self.session.execute(statement)
        # All at once: iterating a result fetches it from the cursor a row at a time.
        return self.adopt(cls, tuple(result.keys()), result.all(), refresh=refresh)

    def adopt(self, cls: type[Row], names: Sequence[str], value_rows: Iterable[Sequence[Any]], *, refresh: bool = False) -> list[Any]:
        """Rows of `cls` from values read elsewhere (`names` their columns), as `load` makes them."""
        rows = []
        found = self._maps[cls]
        key_of = _KEYS[cls]
        for values in value_rows:
            own = dict(zip(names, values, strict=True))
            key = key_of(own)
            row = found.get(key)
            if row is None:
                row = found[key] = cls(own, self._setting)
            elif refresh:
                self._refresh(row, own)
            rows.append(row)
        return rows

    def load_all(self, reads: Sequence[Read]) -> list[Any]:
        """Several reads in one round trip: for each `Read`, what `load` (or `load_with`, or
        for a read of no row class the plain value tuples) would return, or None for a read
        whose `when` did not hold.

        On PostgreSQL they are one statement (`models/joint_read.py`: why, and how the rows
        come back as JSON). Elsewhere (SQLite, in process) one query each, every one run: a
        read's `when` only spares the database work, so reading anyway is never wrong."""
        if not self.postgres:
            out: list[list[Any]] = []
            for read in reads:
                if read.cls is None:
                    out.append([tuple(row) for row in self.session.execute(*read.query).all()])
                elif read.extra:
                    out.append(self.load_with(read.cls, read.statement))
                else:
                    out.append(self.load(read.cls, read.statement))
            return out
        return joint_read.fetch(self.session, reads, self._adopted)

    def _adopted(self, read: Read, value_rows: list[list[Any]] | None) -> Any:
        """What `load_all` returns for `read`, from its rows' values (`joint_read.fetch`)."""
        if value_rows is None:
            return None
        if read.cls is None:
            return [tuple(values) for values in value_rows]
        names = read.names
        if read.extra:
            width = len(names) - len(read.extra)
            adopted = self.adopt(read.cls, names[:width], (values[:width] for values in value_rows))
            return [(row, tuple(values[width:])) for row, values in zip(adopted, value_rows, strict=True)]
        return self.adopt(read.cls, names, value_rows)

    def _refresh(self, row: Row, read: dict[str, Any]) -> None:
        touched = row._set
        if touched is _NEW:
            return
        current = row.__dict__
        for name, value in read.items():
            if touched is None or name not in touched:
                current[name] = value  # not set here: what the database holds now
            elif current.get(name, _MISSING) == touched[name]:
                current[name] = value  # set back to what it held: as not set
                touched[name] = value

    def load_with(self, cls: type[Row], statement: Select | sql.Query) -> list[tuple[Any, tuple[Any, ...]]]:
        """`load` for a statement that selects more than the table's columns: each row with
        the values of the columns after them."""
        result = self.session.execute(*as_query(statement))
        names = list(result.keys())
        width = sum(1 for name in names if name in cls.table.c)
        if names[:width] != [name for name in names if name in cls.table.c]:
            raise ValueError("select the table's columns first, then the others")
        value_rows = result.all()
        adopted = self.adopt(cls, names[:width], (values[:width] for values in value_rows))
        return [(row, tuple(values[width:])) for row, values in zip(adopted, value_rows, strict=True)]

    def get(self, cls: type[Row], key: Any) -> Any:
        return self._maps[cls].get(key)

    def rows(self, cls: type[Row]) -> Iterable[Any]:
        return self._maps[cls].values()

    def saved(self, row: Row, column: str) -> Any:
        """`column` of `row` as the database holds it (None for a row not written yet)."""
        touched = row._set
        if touched is _NEW:
            return None
        if touched and column in touched:
            before = touched[column]
            return None if before is _MISSING else before
        return row.__dict__.get(column)

    def changed(self, row: Row) -> bool:
        """Whether `row` holds anything the database does not (a new row, or a changed one)."""
        touched = row._set
        if touched is _NEW:
            return True
        current = row.__dict__
        return bool(touched) and any(current.get(name, _MISSING) != before for name, before in touched.items())

    def unwritten_change(self, cls: type[Row], counts: Callable[[dict[str, Any]], bool]) -> int:
        """How many more rows of `cls` here `counts` would count once written than as the
        database holds them now: a count read from the database plus this is the count after
        the next `write`, without writing first (a new row counts from nothing)."""
        change = 0
        for row in (*self._new.get(cls, ()), *self._setting):
            if type(row) is not cls or row._set is None:
                continue  # another table's, or as the database holds it
            saved = _saved_values(row)
            change += counts(row.__dict__) - (saved is not None and counts(saved))
        return change

    # --- making --------------------------------------------------------------------------

    def new(self, cls: type[Row], values: Mapping[str, Any]) -> Any:
        """A new row of `cls` (every column not in `values` None, as a new ORM object reads),
        inserted at the next `write`. A table keyed by `id` must get its id in `values`
        (`IdBlocks`) on PostgreSQL; elsewhere (SQLite) the row is inserted at once and the
        database numbers it."""
        shape = _insert_shape(cls.table)
        row = cls({**shape.blank, **values}, self._setting, new=True)
        if len(row.__dict__) != len(shape.blank):  # a name that is no column among `values`
            _check_columns(cls.table, row)
        if shape.has_id and row.id is None:
            table = cls.table
            row.id = self.session.execute(insert(table).values(_insert_values(table, [row])[0]).returning(table.c.id)).scalar_one()
            self.writes += 1
            _written(row)
        else:
            self._new[cls].append(row)
        found = self._maps.get(cls)
        if found is not None:
            found[_KEYS[cls](row.__dict__)] = row
        if cls is AttemptRow:
            self.made_attempts.append(row.id)
        return row

    def patched(self, cls: type[Row], key: Any, **values: Any) -> None:
        """Another statement wrote `values` to a row in the database: the row here (if read)
        takes them, as written."""
        row = self._maps[cls].get(key)
        if row is None:
            return
        row.__dict__.update(values)
        touched = row._set
        if touched and touched is not _NEW:
            # What the database holds now: a column set here to one of these is no change.
            for name in touched.keys() & values.keys():
                touched[name] = values[name]

    # --- writing -------------------------------------------------------------------------

    def write(self) -> int:
        """Write every new and changed row; returns the rows written."""
        written = 0
        inserts: list[tuple[Table, list[dict[str, Any]]]] = []  # in table order
        for cls in _INSERT_ORDER:
            new = self._new[cls]
            if not new:
                continue
            self._new[cls] = []
            inserts.append((cls.table, _insert_values(cls.table, new)))
            for row in new:
                _written(row)
            written += len(new)
        updates: list[tuple[Table, list[str], list[Row]]] = []
        setting: dict[type[Row], list[Row]] = {}
        for row in self._setting:
            setting.setdefault(type(row), []).append(row)
        self._setting.clear()
        if not setting.keys() <= _UPDATED:
            # Never silently dropped: the store writes changes to the tables it reads.
            tables = sorted(cls.table.name for cls in setting.keys() - _UPDATED)
            updated = sorted(cls.table.name for cls in _UPDATED)
            raise TypeError(f"rows of {tables} changed after their insert; a RowStore updates rows of {updated} only")
        for cls in _UPDATE_ORDER:
            if cls in setting:
                written += self._changes(cls, setting[cls], updates)
        # After the UPDATEs by key: one of them may move or finish an attempt this matches.
        handed = [(sql.hand_over(run_id, keys, self.made_attempts), len(keys)) for run_id, keys in self.handed_over.items()]
        written += sum(most for _, most in handed)
        self.handed_over = {}
        if self.postgres:
            driver.send_changes(self.session, inserts, [(table, keys, [row.__dict__ for row in rows]) for table, keys, rows in updates], handed)
        else:
            for table, values in inserts:
                driver.insert_rows(self.session, table, values)
            self._update_each(updates)
            for query, most in handed:
                driver.check_count("hand-over", query.statement.table, self.session.execute(*query).rowcount, most)
        self.writes += bool(written)
        return written

    def _changes(self, cls: type[Row], setting: list[Row], updates: list[tuple[Table, list[str], list[Row]]]) -> int:
        """Add to `updates` the UPDATEs of `cls`'s changed rows among `setting` (those set since
        the last write) as (table, columns, rows), and take the rows as written; returns how
        many rows they write."""
        shapes: dict[frozenset[str], list[Row]] = {}
        for row in setting:
            touched = row._set
            if not touched:
                continue  # none set (None), or not inserted yet (`_NEW`: its insert writes it whole)
            current = row.__dict__
            keys = frozenset([k for k, before in touched.items() if current[k] != before])
            if keys:
                shapes.setdefault(keys, []).append(row)
            else:
                _written(row)  # set back to what the database holds
        if not shapes:
            return 0
        uniform = _UNIFORM_COLUMNS.get(cls)
        if uniform is not None and len(shapes) > 1:
            union = frozenset().union(*shapes)
            if union <= uniform:
                rows = [row for group in shapes.values() for row in group]
                if all(union <= row.__dict__.keys() for row in rows):
                    shapes = {union: rows}
        key_of = _KEYS[cls]
        for keys, rows in sorted(shapes.items(), key=lambda item: sorted(item[0])):
            # In primary-key order: the statement then locks its rows in that order (as the
            # relay's and the workers' updates of attempts do), so two of them that meet on
            # the same rows wait for each other rather than deadlock.
            updates.append((cls.table, sorted(keys), sorted(rows, key=lambda row: key_of(row.__dict__))))
            for row in rows:
                _written(row)
        return sum(len(rows) for rows in shapes.values())

    def _update_each(self, updates: list[tuple[Table, list[str], list[Row]]]) -> None:
        """Elsewhere (SQLite): `updates` in their order, each an executemany."""
        for table, keys, rows in updates:
            primary = [column.key for column in table.primary_key.columns]
            statement = _row_update(table, tuple(primary), tuple(keys))
            params = [
                {**{f"k_{name}": row.__dict__[name] for name in primary}, **{f"v_{key}": row.__dict__[key] for key in keys}}
                for row in rows
            ]
            count = self.session.execute(statement, params).rowcount
            driver.check_count("update", table, count, len(rows))


class _InsertShape(NamedTuple):
    keys: tuple[str, ...]
    blank: dict[str, None]  # every column None, as a new ORM object reads
    defaults: tuple[tuple[str, Any], ...]  # scalar Python-side defaults
    json_columns: tuple[str, ...]
    server_defaults: tuple[str, ...]
    has_id: bool


@cache
def _insert_shape(table: Table) -> _InsertShape:
    """What a new row and an insert need of `table`, once (`ColumnCollection.keys()` builds a list
    each call: asked per row, it was a tenth of a batch's write)."""
    columns = table.columns
    return _InsertShape(
        tuple(columns.keys()),
        dict.fromkeys(columns.keys()),
        tuple((c.key, c.default.arg) for c in columns if c.default is not None and c.default.is_scalar),
        tuple(c.key for c in columns if isinstance(c.type, JSON)),
        tuple(c.key for c in columns if c.server_default is not None),
        "id" in table.c,
    )


def _insert_values(table: Table, rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as parameter sets of one INSERT: every column, a column's default where the
    row left it None (as the ORM fills in a column nobody set)."""
    shape = _insert_shape(table)
    keys, defaults, json_columns = shape.keys, shape.defaults, shape.json_columns
    values = []
    for row in rows:
        # Every column (`new` made the dict so): a name set since that is no column is refused.
        item = dict(row.__dict__)
        if len(item) != len(keys):
            _check_columns(table, row)
            item = {key: item.get(key) for key in keys}  # a column deleted from the row: None
        for key, default in defaults:
            if item[key] is None:
                item[key] = default
        # A JSON column's None is SQL NULL here, as for a column an ORM object never set (the
        # JSON type writes a Python None as JSON null).
        for key in json_columns:
            if item[key] is None:
                item[key] = null()
        values.append(item)
    # A column with a server default that no row sets is left to the server.
    unset = [key for key in shape.server_defaults if all(item[key] is None for item in values)]
    for item in values:
        for key in unset:
            del item[key]
    # No id on a dialect where the database numbers the rows (SQLite).
    if shape.has_id and all(item.get("id") is None for item in values):
        for item in values:
            del item["id"]
    return values


def _check_columns(table: Table, row: Row) -> None:
    """Refuse a new row that holds values for names `table` has no column for (a misspelt
    column would otherwise never reach the database)."""
    unknown = sorted(row.__dict__.keys() - _insert_shape(table).blank.keys())
    if unknown:
        raise ValueError(f"a new row of {table.name} has values for {unknown}, which are not columns of {table.name}")


@lru_cache(maxsize=512)
def _row_update(table: Table, primary: tuple[str, ...], keys: tuple[str, ...]) -> Any:
    """`UPDATE table SET key = :v_key ... WHERE pk = :k_pk`, built once per table and set of
    columns (a statement built once has its cache key computed once)."""
    return (
        update(table)
        .where(and_(*(table.c[name] == bindparam(f"k_{name}") for name in primary)))
        .values({key: bindparam(f"v_{key}") for key in keys})
    )
