"""What a statement costs PostgreSQL as it runs: for tests that pin a query's plan by the buffers
it touches (a plan's shape can vary with the statistics; the work it does may not)."""

from __future__ import annotations

import json
from typing import Any

from refill.models.db import Ledger


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
    plan = plan if isinstance(plan, list) else json.loads(plan)
    top = plan[0]["Plan"]
    return top["Actual Rows"], top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
