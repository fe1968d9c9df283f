"""The ledger's per-batch reads and the SQL spellings they share (how a list of ids or slot
keys, or a value a partial index names, is written into a statement so that PostgreSQL and
psycopg serve it well; each function says why). Bulk writes run on the driver
(models/driver.py).

The reads are built here and run by `RunContext` (models/context.py), which keeps what they
return for the rest of its transaction; a batch of results runs several of them in one round
trip (`RunContext.read_ahead`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Boolean,
    String,
    Text,
    and_,
    bindparam,
    cast,
    exists,
    func,
    not_,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ColumnElement, Select, Update
from sqlalchemy.sql.selectable import CTE, ScalarSelect
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import NullType, TypeDecorator

from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    Group,
    Slot,
    SlotStatus,
    SparePrompt,
    Step,
    StepStatus,
)

#: The columns read into rows. A group's payload columns are left out: a group is moved and
#: lent by its other columns, and only the trainer's claim reads its payload.
STEP_COLUMNS = tuple(Step.__table__.c)
SLOT_COLUMNS = tuple(Slot.__table__.c)
ATTEMPT_COLUMNS = tuple(Attempt.__table__.c)
GROUP_COLUMNS = tuple(c for c in Group.__table__.c if c.key not in ("rollout", "completion_texts"))
SPARE_COLUMNS = tuple(SparePrompt.__table__.c)
# The tables, not the ORM classes, in the queries of the hot paths: a statement that names an
# ORM attribute is compiled and its result set up by the ORM's machinery, even for columns.
_attempts, _slots, _groups = Attempt.__table__, Slot.__table__, Group.__table__
_steps, _spares = Step.__table__, SparePrompt.__table__
# Enum members' .value is a property call; plain strings in the statements.
_SLOT_OPEN, _SLOT_COMMITTED = SlotStatus.OPEN.value, SlotStatus.COMMITTED.value
_STEP_OPEN, _STEP_TRAINED = StepStatus.OPEN.value, StepStatus.TRAINED.value
_LIVE = tuple(s.value for s in AttemptState.live())


def literal_in(column, values):  # type: ignore[no-untyped-def]
    """`column IN (...)` with the values (integers, or tuples of them) written into the SQL
    rather than bound one parameter each: psycopg parses a statement with more than 50
    parameters again on every execution (no cache), which costs more than the query.

    Written out, the statement's text differs with every list, so psycopg never prepares it
    and PostgreSQL plans each execution with the values: the per-batch reads need that (a
    plan made once for any list, on a run's statistics from before its rows were written,
    read a whole step's slots to find a batch's few). Also for the values a partial index's
    predicate names (`state IN ('pending', ...)`). See `ids_in` for lists found by a key."""
    return column.in_(bindparam(None, list(values), expanding=True, literal_execute=True))


class _IdList(TypeDecorator[list[int]]):
    """A list of integers bound as one parameter: on PostgreSQL the text of an array, which
    the statement casts to an array of the column's own type (`_ids_in_postgresql`); a JSON
    array on SQLite (read back there by `json_each`).

    The text, not the list: psycopg spells a list element by element in Python (440 against
    56 us for a relay pass's 256 ids). The column's own type, not always `bigint[]`:
    `integer_column = ANY(bigint[])` is a cross-type comparison, which PostgreSQL neither uses
    as an index condition (it read a whole step's slots and filtered them) nor hashes
    (admission's 8,192 positions were compared one by one against each prompt row: half a
    second)."""

    impl = String
    cache_ok = True

    def __init__(self, big: bool) -> None:
        super().__init__()
        self.big = big

    def load_dialect_impl(self, dialect):  # type: ignore[no-untyped-def]
        # No cast of its own on PostgreSQL (psycopg's dialect writes `::VARCHAR` after a
        # string): the text goes as an untyped literal, which the statement's cast makes the
        # array itself when it is parsed, a constant the planner sees; cast from varchar
        # instead, it was an expression, and the relay's plans read whole tables.
        return NullType() if dialect.name == "postgresql" else dialect.type_descriptor(String())

    def process_bind_param(self, value, dialect):  # type: ignore[no-untyped-def]
        if dialect.name == "postgresql":
            return "{" + ",".join(map(str, map(int, value))) + "}"
        return json.dumps(list(value))


class _IdsIn(ColumnElement[bool]):
    """`column` is one of a list of integers, the list bound as one parameter (see `ids_in`)."""

    __visit_name__ = "refill_ids_in"
    type = Boolean()
    _is_implicitly_boolean = True  # a comparison: not `(... IN ...) = 1` on SQLite
    inherit_cache = True
    _traverse_internals = [
        ("column", InternalTraversal.dp_clauseelement),
        ("ids", InternalTraversal.dp_clauseelement),
    ]

    def __init__(self, column, ids) -> None:  # type: ignore[no-untyped-def]
        self.column = column
        self.ids = ids


@compiles(_IdsIn, "postgresql")
def _ids_in_postgresql(element, compiler, **kw):  # type: ignore[no-untyped-def]
    array = "BIGINT[]" if element.ids.type.big else "INTEGER[]"
    return f"{compiler.process(element.column, **kw)} = ANY(CAST({compiler.process(element.ids, **kw)} AS {array}))"


@compiles(_IdsIn)
def _ids_in_json(element, compiler, **kw):  # type: ignore[no-untyped-def]
    return f"{compiler.process(element.column, **kw)} IN (SELECT value FROM json_each({compiler.process(element.ids, **kw)}))"


def ids_in(column, ids):  # type: ignore[no-untyped-def]
    """`column IN ids` for a list of integer ids matched against the table's own key, the
    list bound as one array parameter (`= ANY(...)`; a JSON array on SQLite). Nothing renders
    the ids into SQL text, and the text is the same for every list, so psycopg prepares it
    (from its fifth execution on a connection) and PostgreSQL parses it once: a relay pass's id
    lists (hundreds of rows) cost more to render and parse than to look up.

    Only for lists found by a primary key (the relay's outbox rows, attempts and runs), which
    any plan serves by that key. A prepared statement is planned once for any values after a
    few runs; a read whose plan depends on the list's length and on a run's fresh statistics
    keeps `literal_in` (under such a plan a batch's read of its slots scanned the whole step)."""
    return _IdsIn(column, bindparam(None, list(ids), type_=_IdList(isinstance(column.type, BigInteger))))


def ids_param(column, name: str):  # type: ignore[no-untyped-def]
    """`ids_in` with the list given at execution, as the parameter `name`: for a statement
    built once (see `Query`)."""
    return _IdsIn(column, bindparam(name, type_=_IdList(isinstance(column.type, BigInteger))))


def literal(value):  # type: ignore[no-untyped-def]
    """A value written into the SQL: a partial index whose predicate names it (`status =
    'open'`) can serve the query under a generic (prepared) plan, where a bound parameter could
    be any value."""
    return bindparam(None, value, literal_execute=True)


# --- the reads ---------------------------------------------------------------------------
#
# Each read is a statement built once per shape (`functools.cache`), with named parameters,
# and the values of those parameters for one execution (`Query`). SQLAlchemy memoizes a
# statement's cache key on the statement object: a statement built anew for every batch is
# walked whole to compute its key again (with building it, about 1.3 ms of Python for a
# batch's first read-ahead), while one built once is looked up. Lists whose values the plan
# must see (`literal_in`) stay written into the SQL at execution (`_literal_list`); lists found
# by a primary key are bound (`ids_param`).


class Query(NamedTuple):
    """A read (or `hand_over`'s UPDATE): a statement built once for its shape and the values of
    its named parameters. `session.execute(*query)` runs it."""

    statement: Select[Any] | Update
    params: dict[str, Any]


def _literal_list(name: str) -> Any:
    """A list parameter written into the SQL when the statement runs, as `literal_in` writes
    its values, but given with the execution's parameters: `column.in_(_literal_list("ids"))`."""
    return bindparam(name, expanding=True, literal_execute=True)


def _slot_keys_clause(step_column: Any, idx_column: Any, steps: int, prefix: str) -> ColumnElement[bool]:
    """`(step, idx) IN keys` for keys of `steps` steps, written per step as `step = s AND idx IN
    (...)`: PostgreSQL plans a row-value IN list as a filter over every row of the step, and
    the per-step form as an index condition. The values are named after `prefix` (so that two
    such clauses can share a statement): `prefix_step_i` and the list `prefix_idx_i`
    (`_slot_key_params`)."""
    return or_(
        *(
            and_(step_column == bindparam(f"{prefix}_step_{i}"), idx_column.in_(_literal_list(f"{prefix}_idx_{i}")))
            for i in range(steps)
        )
    )


def _slot_key_params(keys: Iterable[tuple[int, int]], prefix: str) -> tuple[int, dict[str, Any]]:
    """The number of steps among `keys` and the parameters of `_slot_keys_clause` for them."""
    by_step: dict[int, set[int]] = {}
    for step, idx in keys:
        by_step.setdefault(step, set()).add(idx)
    params: dict[str, Any] = {}
    for i, (step, idxs) in enumerate(sorted(by_step.items())):
        params[f"{prefix}_step_{i}"] = step
        params[f"{prefix}_idx_{i}"] = sorted(idxs)
    return len(by_step), params


@cache
def _unfinished_steps() -> Select[Any]:
    return select(*STEP_COLUMNS).where(_steps.c.run_id == bindparam("run_id"), _steps.c.status != literal(_STEP_TRAINED)).order_by(_steps.c.step)


def unfinished_steps(run_id: int) -> Query:
    """The run's steps not trained yet, in step order: through the partial index of those
    (`ix_steps_unfinished`, whose predicate names 'trained'), not the primary key, which walks
    every step the run ever trained."""
    return Query(_unfinished_steps(), {"run_id": run_id})


@cache
def _steps_numbered() -> Select[Any]:
    return select(*STEP_COLUMNS).where(_steps.c.run_id == bindparam("run_id"), _steps.c.step.in_(_literal_list("step_numbers")))


def steps(run_id: int, numbers: list[int]) -> Query:
    """The steps numbered `numbers`."""
    return Query(_steps_numbered(), {"run_id": run_id, "step_numbers": list(numbers)})


def _step_is_open() -> tuple[ColumnElement[bool], ...]:
    """`steps.status = 'open'`, spelled so that the partial index of the unfinished steps
    (`ix_steps_unfinished`, 'not trained') can find a run's open steps under a generic plan: a
    bound 'open' could be 'trained' for all that plan knows, and the primary key then walks
    every step the run ever trained (5,000 steps in: 80 buffers against 2 a read,
    tests/integration/test_query_plans.py)."""
    return _steps.c.status != literal(_STEP_TRAINED), _steps.c.status == literal(_STEP_OPEN)


@cache
def _open_slots(waiting: bool) -> Select[Any]:
    conditions = [_slots.c.needs_replacement.is_(True)] if waiting else []
    return (
        select(*SLOT_COLUMNS)
        .join(_steps, (_steps.c.run_id == _slots.c.run_id) & (_steps.c.step == _slots.c.step))
        .where(_slots.c.run_id == bindparam("run_id"), _slots.c.status == literal(_SLOT_OPEN), *_step_is_open(), *conditions)
        .order_by(_slots.c.step, _slots.c.idx)
        .limit(bindparam("waiting_limit" if waiting else "open_limit"))
    )


def open_slots(run_id: int, *, limit: int, waiting: bool = False) -> Query:
    """The first `limit` open slots of open steps in (step, index) order; with `waiting`, only
    those waiting on a replacement (their own prompt was filtered or dropped)."""
    return Query(_open_slots(waiting), {"run_id": run_id, "waiting_limit" if waiting else "open_limit": limit})


@cache
def _slots_at(steps: int) -> Select[Any]:
    where = _slot_keys_clause(_slots.c.step, _slots.c.idx, steps, "slot")
    return select(*SLOT_COLUMNS).where(_slots.c.run_id == bindparam("run_id"), where)


def slots_at(run_id: int, keys: Iterable[tuple[int, int]]) -> Query:
    """The slots at `keys` ((step, index) pairs), read by primary key (`_slot_keys_clause`)."""
    steps, params = _slot_key_params(keys, "slot")
    return Query(_slots_at(steps), {"run_id": run_id, **params})


@cache
def _batch() -> CTE:
    """The run's attempts among the bound `attempt_ids`: a batch of results' attempts, which
    four reads of its joint read look at (the attempts, their slots, and two conditions of
    them). As one common table expression the joint read finds them once, not once per read
    (under the plans of a run's first steps, a sequential scan of the attempts each: 2 ms a
    batch, bench/HISTORY.md, stop 44); a read run alone inlines it.

    `run_id + 0`: found by primary key, the run checked on the rows. A plain `run_id = x` lets
    the planner read the run's every attempt by the run_id index and filter them by id, which
    it did whenever the table's statistics predate the run (3 ms a batch at 8,000 attempts in
    `bench overhead`). The ids bound as one array (`ids_param`), not written into the SQL: a
    batch's first read-ahead then has the same text every time, so psycopg prepares it and
    PostgreSQL plans it once rather than on every batch (about 1 ms; test_query_plans.py checks
    that plan)."""
    return (
        select(*ATTEMPT_COLUMNS)
        .where(ids_param(_attempts.c.id, "attempt_ids"), _attempts.c.run_id + 0 == bindparam("run_id"))
        .cte("batch_attempts")
    )


@cache
def _attempts_by_id() -> Select[Any]:
    return select(*_batch().c)


def attempts_by_id(run_id: int, ids: Iterable[int]) -> Query:
    """The run's attempts among `ids`."""
    return Query(_attempts_by_id(), {"run_id": run_id, "attempt_ids": list(ids)})


@cache
def _slots_of_attempts(lateral: bool) -> Select[Any]:
    # Each slot by its primary key, from its attempt's row; the attempts those of
    # `attempts_by_id` (`_batch`, with the same parameters, so the two share a statement). As
    # keys written into the SQL (`step = s AND idx IN (...)`, a second round trip after the
    # attempts), the planner with no statistics on the step's slots took the run and step as
    # the index condition and filtered the step's every slot by index (4,096 rows, about 1 ms).
    # On PostgreSQL the slot is a LATERAL subquery behind OFFSET 0, which the planner cannot
    # turn into a join to reorder: as a plain join, a generic plan under statistics a background
    # analyze had left (in CI) walked every slot and probed the attempts for each (20,000
    # slots of another run: 80,000 buffers).
    batch = _batch()
    on = (_slots.c.run_id == batch.c.run_id, _slots.c.step == batch.c.step, _slots.c.idx == batch.c.slot_idx)
    if not lateral:
        return select(*SLOT_COLUMNS).select_from(batch.join(_slots, and_(*on)))
    slot = select(*SLOT_COLUMNS).where(*on).offset(0).lateral("slot")
    return select(*slot.c).select_from(batch.join(slot, true()))


def slots_of_attempts(run_id: int, ids: Iterable[int], *, postgres: bool) -> Query:
    """The slots that the run's attempts among `ids` are aimed at (an extra's, none); on
    `postgres`, each probed by its key (SQLite has no LATERAL)."""
    return Query(_slots_of_attempts(postgres), {"run_id": run_id, "attempt_ids": list(ids)})


@cache
def batch_places_elsewhere() -> ColumnElement[bool]:
    """Whether a batch of results may place a group outside its own slot under the `in_order`
    sampler: one of its attempts (the bound `attempt_ids` of `attempts_by_id`, with its
    parameters) is an extra, or serves a step later than the run's first open one (whose
    groups may fill slots of the earlier step waiting on a replacement). Where neither holds,
    the batch never looks at the slots waiting (`RunContext.read_ahead`)."""
    batch = _batch()
    return exists().where(or_(batch.c.slot_idx.is_(None), batch.c.step > first_open_step()))


def first_open_step() -> ScalarSelect[Any]:
    """The run's (`run_id`, bound) first open step, as a scalar subquery."""
    return (
        select(func.min(_steps.c.step))
        .where(_steps.c.run_id == bindparam("run_id"), *_step_is_open())
        .scalar_subquery()
    )


@cache
def batch_has_extra() -> ColumnElement[bool]:
    """Whether one of a batch's attempts (`attempts_by_id`'s, with its parameters) is an
    extra: under `in_order` only an extra's group may take an open slot that is not waiting."""
    return exists().where(_batch().c.slot_idx.is_(None))


@cache
def _live_attempts(steps: int) -> Select[Any]:
    where = _slot_keys_clause(_attempts.c.step, _attempts.c.slot_idx, steps, "live")
    return (
        select(*ATTEMPT_COLUMNS)
        .where(_attempts.c.run_id == bindparam("run_id"), where, literal_in(_attempts.c.state, _LIVE))
        .order_by(_attempts.c.id)
        .with_for_update(key_share=True, skip_locked=True)
    )


def live_attempts(run_id: int, keys: Iterable[tuple[int, int]]) -> Query:
    """The live attempts aimed at the slots at `keys`, in id order, locked `FOR NO KEY UPDATE`,
    skipping those another transaction holds (`RunContext.live_attempt` says why; a hand-over
    reads none, `hand_over`)."""
    steps, params = _slot_key_params(keys, "live")
    return Query(_live_attempts(steps), {"run_id": run_id, **params})


def attempts_locked_by_id(name: str, *where: ColumnElement[bool]) -> CTE:
    """The ids of the attempts `where` holds for, locked `FOR NO KEY UPDATE` in id order: what an
    UPDATE of several attempts found otherwise than by id joins (`WHERE attempts.id = cte.id`).

    Every statement that locks several attempts locks them in id order (a worker's heartbeat, a
    lease handshake, the batch's UPDATEs by key), so two of them that meet wait for each other
    rather than deadlock. Found by slot or by step, the rows would be locked in the index's
    order: a batch could hold one attempt while waiting for another that a heartbeat holds, the
    heartbeat waiting in turn for the first (tests/integration/test_concurrency.py)."""
    return (
        select(_attempts.c.id)
        .where(*where)
        .order_by(_attempts.c.id)
        .with_for_update(key_share=True)
        .cte(name)
        .prefix_with("MATERIALIZED")
    )


@cache
def _hand_over(steps: int) -> Update:
    handed = attempts_locked_by_id(
        "handed",
        # Not `run_id`: an UPDATE's parameters may not be named for its columns.
        _attempts.c.run_id == bindparam("handed_run"),
        _slot_keys_clause(_attempts.c.step, _attempts.c.slot_idx, steps, "handed"),
        literal_in(_attempts.c.state, _LIVE),
        not_(ids_param(_attempts.c.id, "handed_made")),
    )
    return update(_attempts).where(_attempts.c.id == handed.c.id).values(slot_idx=None, reason=AttemptReason.EXTRA.value)


def hand_over(run_id: int, keys: Iterable[tuple[int, int]], made: Iterable[int]) -> Query:
    """The live attempts aimed at the slots at `keys` serve their steps as extras: an UPDATE by
    slot, for attempts a batch has not read (`RunContext.hand_over`), its rows locked first in
    id order (`attempts_locked_by_id`). Not the attempts `made` by the transaction: a slot
    handed over may open again (its group lent) and take a new attempt before the write."""
    steps, params = _slot_key_params(keys, "handed")
    return Query(_hand_over(steps), {"handed_run": run_id, "handed_made": list(made), **params})


@cache
def _step_groups() -> Select[Any]:
    return (
        select(
            _groups.c.attempt_id,
            _groups.c.rollout,
            _groups.c.completion_texts,
            # As text, for `column_types.read_json` (orjson): the standard library's reading of a
            # step's reward lists (psycopg's for JSONB) was a third of the trainer's claim.
            cast(_groups.c.rewards, Text).label("rewards"),
            _groups.c.weight_version,
            _groups.c.payload_ref,
            _groups.c.payload_bytes,
            _groups.c.payload_checksum,
            _groups.c.num_tokens,
        )
        .join(_slots, _slots.c.group_attempt_id == _groups.c.attempt_id)
        .where(_slots.c.run_id == bindparam("run_id"), _slots.c.step == bindparam("step"), _slots.c.status == literal(_SLOT_COMMITTED))
        .order_by(_slots.c.idx)
    )


def step_groups(run_id: int, step: int) -> Query:
    """The groups committed to step `step`'s slots, in slot order, with their payloads (or
    where they are stored) and their rewards as JSON text: what the trainer's claim reads."""
    return Query(_step_groups(), {"run_id": run_id, "step": step})


@cache
def _spares_after() -> Select[Any]:
    return (
        select(*SPARE_COLUMNS)
        .where(_spares.c.run_id == bindparam("run_id"), _spares.c.taken_at.is_(None), _spares.c.id > bindparam("spares_after"))
        .order_by(_spares.c.id)
        .limit(bindparam("spares_limit"))
    )


def spares(run_id: int, after_id: int, limit: int) -> Query:
    """The oldest `limit` untaken spare prompts with ids above `after_id`."""
    return Query(_spares_after(), {"run_id": run_id, "spares_after": after_id, "spares_limit": limit})


@cache
def _lendable() -> tuple[Select[Any], Select[Any]]:
    run_id = bindparam("run_id")
    earliest_open = first_open_step()
    committed = (
        select(*SLOT_COLUMNS, _groups.c.weight_version.label("lender_version"))
        .join(_groups, _groups.c.attempt_id == _slots.c.group_attempt_id)
        .join(_steps, (_steps.c.run_id == _slots.c.run_id) & (_steps.c.step == _slots.c.step))
        .where(
            _slots.c.run_id == run_id,
            _slots.c.status == _SLOT_COMMITTED,
            *_step_is_open(),
            _slots.c.step > earliest_open,
        )
        .order_by(_slots.c.step.desc(), _slots.c.group_attempt_id.desc())
        .limit(bindparam("lenders_limit"))
    )
    # Two columns, not the groups: only the group a slot borrows is loaded (when it moves). A
    # parked group too stale for the earliest open step can serve none (it stays parked,
    # unused, for good): left out, or the oldest-first prefix would fill up with them as a run
    # goes on and hide every group still lendable.
    parked = (
        select(_groups.c.attempt_id, _groups.c.weight_version)
        .where(
            _groups.c.run_id == run_id,
            _groups.c.parked.is_(True),
            _groups.c.weight_version >= earliest_open - bindparam("max_lookahead"),
        )
        .order_by(_groups.c.weight_version, _groups.c.attempt_id)
        .limit(bindparam("lenders_limit"))
    )
    return committed, parked


def lendable(run_id: int, max_lookahead_versions: int, limit: int) -> tuple[Query, Query]:
    """The groups a slot may borrow, as two reads of at most `limit` rows: the slots of open
    steps that hold a committed group (with the group's weight version, `lender_version`),
    latest step and then latest attempt first, and parked groups (attempt id and weight
    version), oldest weights first. Groups of the earliest open step are left out: only an
    earlier step may borrow, and none is open."""
    committed, parked = _lendable()
    params = {"run_id": run_id, "lenders_limit": limit, "max_lookahead": max_lookahead_versions}
    return Query(committed, params), Query(parked, params)


@cache
def _dispatch_counts() -> Select[Any]:
    run_id = bindparam("run_id")
    live = select(func.count()).where(
        _attempts.c.run_id == run_id, literal_in(_attempts.c.state, _LIVE), _attempts.c.step == bindparam("newest_step")
    )
    parked = select(func.count()).where(
        _groups.c.run_id == run_id, _groups.c.parked.is_(True), _groups.c.weight_version >= bindparam("parked_bound")
    )
    return select(live.scalar_subquery().label("live"), parked.scalar_subquery().label("parked"))


def dispatch_counts(run_id: int, step: int, bound: int) -> Query:
    """Over-dispatch's two counts (`overdispatch.top_up`), one row: the live attempts of step
    `step`, and the parked groups generated with weights `bound` or newer."""
    return Query(_dispatch_counts(), {"run_id": run_id, "newest_step": step, "parked_bound": bound})
