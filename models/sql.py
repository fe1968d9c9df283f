"""SQL spellings the ledger's per-batch queries share: how a list of ids or slot keys, or a
value a partial index names, is written into a statement so that PostgreSQL and psycopg serve
it well (each function says why)."""

from __future__ import annotations

from sqlalchemy import and_, bindparam, or_


def literal_in(column, values):  # type: ignore[no-untyped-def]
    """`column IN (...)` with the values (integers, or tuples of them) written into the SQL
    rather than bound one parameter each: psycopg parses a statement with more than 50
    parameters again on every execution (no cache), which costs more than the query."""
    return column.in_(bindparam(None, list(values), expanding=True, literal_execute=True))


def slot_keys_in(step_column, idx_column, keys):  # type: ignore[no-untyped-def]
    """`(step, idx) IN keys`, written per step as `step = s AND idx IN (...)`: PostgreSQL plans
    a row-value IN list as a filter over every row of the step, and the per-step form as an
    index condition."""
    by_step: dict[int, set[int]] = {}
    for step, idx in keys:
        by_step.setdefault(step, set()).add(idx)
    return or_(*(and_(step_column == step, literal_in(idx_column, sorted(idxs))) for step, idxs in sorted(by_step.items())))


def literal(value):  # type: ignore[no-untyped-def]
    """A value written into the SQL: a partial index whose predicate names it (`status =
    'open'`) can serve the query under a generic (prepared) plan, where a bound parameter could
    be any value."""
    return bindparam(None, value, literal_execute=True)
