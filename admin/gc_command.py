"""`refill gc RUN`: what a finished run's bulky rows weigh, and (with --yes) remove them.

A dry run by default: it prints what would go. What goes and why the views and `refill check`
do not miss it: `refill.admin.retention`. Exit 2 for an unknown run, or one that is not
finished for good (it could still train, or be resumed).
"""

from __future__ import annotations

from typing import Annotated

import typer

from refill.admin.console import EXIT_BAD_INPUT, fail, note, out_console, print_json
from refill.admin.inspect_common import AsJson, DatabaseUrl, RunId, ledger_for


def gc(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    yes: Annotated[bool, typer.Option("--yes", help="Remove them (without it: print what would go).")] = False,
    as_json: AsJson = False,
) -> None:
    """Remove a finished run's payloads, rejected results and relayed outbox rows.

    Without --yes, print what would go and how much it weighs. The rows the SQL views and
    `refill check` read (runs, steps, slots, attempts, groups' rewards, metrics) stay."""
    from refill.admin.retention import NotFinished, collect, measure

    with ledger_for(database_url) as ledger:
        try:
            garbage = collect(ledger, run_id) if yes else ledger.transaction(lambda s: measure(s, run_id))
        except (LookupError, NotFinished) as error:
            fail(str(error), EXIT_BAD_INPUT)
        dialect = ledger.dialect
    if as_json:
        print_json({"run_id": run_id, "removed" if yes else "would_remove": [g.as_dict() for g in garbage]})
        return
    verb = "removed" if yes else "would remove"
    for item in garbage:
        out_console.print(f"{verb} {item.rows} {item.kind} (about {_size(item.bytes)})", markup=False)
    if not yes:
        note(f"a dry run: `refill gc {run_id} --yes` removes them")
    elif dialect == "postgresql":
        note("PostgreSQL reuses the space (autovacuum); VACUUM FULL on groups gives it back to the disk")
    else:
        note("SQLite reuses the space; VACUUM gives it back to the disk")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
