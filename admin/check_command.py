"""`refill check RUN`: prove the ledger's invariants (SPEC §8) for one run.

Exit 0 when every check holds, 1 naming each violation (check, run, step, slot, attempt), 2
for an unknown run or ledger. The checks are `refill.admin.invariants`; they run on one snapshot
of the ledger, so a running run can be checked too.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from refill.admin.console import EXIT_BAD_INPUT, EXIT_INVALID, fail, out_console, print_json
from refill.admin.inspect_common import AsJson, DatabaseUrl, RunId, ledger_for


def check(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    only: Annotated[
        list[str] | None, typer.Option("--only", help="Run only this check (repeatable).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Prove the run's ledger invariants; exit 1 naming each violation.

    No slot committed twice, budgets never exceeded, no zero-variance group trained under
    dynamic sampling, staleness bound held, each released step full, weight versions
    contiguous, one live attempt per open slot, and the ledger's own bookkeeping. Each
    violation names its run, step, slot and attempt."""
    from refill.admin.invariants import CHECKS, run_checks
    from refill.admin.snapshot import read_snapshot

    names = [c.name for c in CHECKS]
    unknown = [n for n in only or [] if n not in names]
    if unknown:
        fail(f"no check named {', '.join(unknown)}; the checks are: {', '.join(names)}", EXIT_BAD_INPUT)
    with ledger_for(database_url) as ledger, read_snapshot(ledger) as session:
        try:
            report = run_checks(session, run_id, only=only)
        except LookupError as error:
            fail(str(error), EXIT_BAD_INPUT)
    if as_json:
        print_json(report.as_dict())
    else:
        for result in report.results:
            mark = Text("ok  ", style="green") if result.ok else Text("FAIL", style="bold red")
            out_console.print(mark + Text(f" {result.name}: {result.description}"))
            for violation in result.violations:
                out_console.print(Text(f"     {violation.where}: {violation.message}"))
        count = len(report.violations)
        if count:
            out_console.print(
                f"run {run_id}: {count} violation{'s' if count != 1 else ''} in "
                f"{sum(not r.ok for r in report.results)} of {len(report.results)} checks",
                markup=False,
            )
        else:
            out_console.print(f"run {run_id}: all {len(report.results)} checks hold", markup=False)
    if not report.ok:
        raise typer.Exit(EXIT_INVALID)
