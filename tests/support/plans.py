"""What a statement costs PostgreSQL as it runs: for tests that pin a query's plan by the buffers
it touches (a plan's shape can vary with the statistics; the work it does may not)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import event

from refill.models.db import Ledger


def is_read(statement: str) -> bool:
    """Whether `statement` is a read: a SELECT, or one that begins with a common table
    expression (a batch's joint read finds its attempts in one, `sql._batch`)."""
    return statement.lstrip().upper().startswith(("SELECT", "WITH"))


#: What a batch's joint read (`models/joint_read.py`) selects: each read's rows as JSON.
JOINT_READ = "SELECT CAST((SELECT coalesce(json_agg"


@contextmanager
def statements_run(ledger: Ledger, keep: Callable[[str, Any], bool] = lambda statement, parameters: True) -> Iterator[list[tuple[str, Any]]]:
    """The statements run on `ledger`'s engine inside the block that `keep` accepts, each as the
    driver received it, with its parameters (to explain them afterwards)."""
    seen: list[tuple[str, Any]] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if keep(statement, parameters):
            seen.append((statement, parameters))

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)


def run_explained(ledger: Ledger, statement: str, parameters: Any) -> tuple[int, int]:
    """Run `statement` (as a driver received it, with its `parameters`) under
    `EXPLAIN (ANALYZE, BUFFERS)` and roll it back; returns its rows and the shared buffers it
    touched (hit or read)."""
    raw = ledger.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, parameters)
        plan = cursor.fetchone()[0]
        raw.rollback()
    finally:
        raw.close()
    return _rows_and_buffers(plan)


def run_explained_generic(ledger: Ledger, statement: str, parameters: dict[str, Any], before: str | None = None) -> tuple[int, int]:
    """`run_explained` under the plan PostgreSQL makes once for any values of the parameters
    (a prepared statement's generic plan, which it uses from the sixth execution on when it
    costs no more than the plans made for each execution's values). `statement` is as the
    driver received it (pyformat, `%(name)s`); `before`, SQL to run first in the same
    transaction (rows made up for the plan to face, rolled back with it)."""
    names: list[str] = []

    def numbered(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", numbered, statement).replace("%%", "%")
    raw = ledger.engine.raw_connection()
    try:
        cursor = raw.cursor()
        if before:
            cursor.execute(before)
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE refill_generic AS {prepared}")
        placeholders = ", ".join(["%s"] * len(names))
        # The values written into the EXECUTE (a client-side cursor): bound, a string's type
        # would be unknown there; written, it takes the prepared parameter's.
        literal = psycopg.ClientCursor(raw.driver_connection)
        literal.execute(
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE refill_generic({placeholders})",
            [parameters[name] for name in names],
        )
        plan = literal.fetchone()[0]
        raw.rollback()
        cursor.execute("DEALLOCATE ALL")
    finally:
        raw.close()
    return _rows_and_buffers(plan)


#: The scans of the last plan explained, heaviest first: for a failing test's message (where a
#: plan's buffers went, which a count alone does not say).
last_scans: list[str] = []


def _rows_and_buffers(plan: Any) -> tuple[int, int]:
    """The top node's rows and the shared buffers it touched (hit or read), from `EXPLAIN`'s JSON."""
    plan = plan if isinstance(plan, list) else json.loads(plan)
    top = plan[0]["Plan"]
    scans: list[tuple[int, str]] = []

    def walk(node: dict[str, Any]) -> None:
        if "Scan" in node["Node Type"]:
            where = node.get("Index Name") or node.get("Relation Name") or ""
            scans.append((_buffers(node), f"{node['Node Type']} {where} x{node.get('Actual Loops')}: {_buffers(node)}"))
        for child in node.get("Plans", []):
            walk(child)

    walk(top)
    last_scans[:] = [text for _, text in sorted(scans, key=lambda scan: -scan[0])]
    return top["Actual Rows"], _buffers(top)


def _buffers(node: dict[str, Any]) -> int:
    return int(node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0))
