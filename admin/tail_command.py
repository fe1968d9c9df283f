"""`refill tail RUN`: follow a run's progress in the ledger until it ends (the live display
of `refill run start` on a terminal, one line per change otherwise)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from refill.admin.console import (
    EXIT_BAD_INPUT,
    EXIT_INVALID,
    err_console,
    fail,
    note,
    out_console,
    show,
)
from refill.admin.inspect_common import DatabaseUrl, RunId, ledger_for

#: The newest steps' metrics each poll reads: far more than a poll interval can release, and
#: the first poll's lines (as `tail` starts with the last lines of a file). Reading every step's,
#: once a second, cost a long run's whole history each time.
TAIL_STEPS = 64


def tail(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    interval: Annotated[float, typer.Option(help="Seconds between reads of the ledger.", min=0.05, max=3600)] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print the current progress and exit.")] = False,
) -> None:
    """Follow a run's progress until it ends (Ctrl-C stops following).

    The steps filling now and the metrics of each trained step (from the last 64). On a terminal it is the live display of `refill run start`; otherwise one line per change.
    Exit 0 when the run completes (or stops), 1 when it fails."""
    from refill.admin.progress import step_line
    from refill.admin.progress_queries import RunProgress, run_progress, step_metrics
    from refill.admin.snapshot import read_snapshot

    with ledger_for(database_url) as ledger:

        def poll() -> tuple[RunProgress, list[dict[str, Any]]]:
            with read_snapshot(ledger) as session:
                try:
                    return run_progress(session, run_id), step_metrics(session, run_id, last=TAIL_STEPS)
                except LookupError as error:
                    fail(str(error), EXIT_BAD_INPUT)

        progress, history = poll()
        if once:
            _print_progress(progress, history)
            return
        printed: set[int] = set()
        last_open: str | None = None  # the first read always prints where the run stands
        if progress.status == "created":
            note(
                f"run {run_id} has not started: no controller has taken it yet (a --detach run waits "
                "for a control worker: `refill workers` lists them)"
            )
        try:
            if err_console.is_terminal:
                from refill.admin.progress import RunDisplay

                with RunDisplay(err_console) as display:
                    while True:
                        display.update(progress, history)
                        if _ended(progress):
                            break
                        time.sleep(interval)
                        progress, history = poll()
            else:
                while True:
                    for row in history:
                        if row.get("reward") is not None and row["step"] not in printed:
                            printed.add(row["step"])
                            out_console.print(step_line(row), markup=False)
                    opened = ", ".join(f"step {s.step} {s.committed}/{s.target} {s.status}" for s in progress.open_steps)
                    if opened != last_open and not _ended(progress):
                        last_open = opened
                        out_console.print(f"filling: {opened or '-'}", markup=False)
                    if _ended(progress):
                        break
                    time.sleep(interval)
                    progress, history = poll()
        except KeyboardInterrupt:
            note(f"stopped following run {run_id}; the run itself goes on (`refill tail {run_id}` to follow again)")
            raise typer.Exit(130) from None
    out_console.print(
        f"run {run_id} {progress.status} ({progress.end_reason or '-'}): {progress.trained_steps} of "
        f"{progress.max_num_steps} steps trained, weights v{progress.weight_version}",
        markup=False,
    )
    if progress.status == "failed":
        err_console.print(progress.error or "", markup=False)
        raise typer.Exit(EXIT_INVALID)


def _ended(progress: Any) -> bool:
    from refill.admin.snapshot import FINISHED_RUN_STATES

    return progress.status in FINISHED_RUN_STATES


def _print_progress(progress: Any, history: list[dict[str, Any]]) -> None:
    from refill.admin.progress import metrics_table

    out_console.print(
        f"run {progress.run_id} ({progress.name}) {progress.status}: {progress.trained_steps} of "
        f"{progress.max_num_steps} steps trained, weights v{progress.weight_version}, spare pool "
        f"{progress.spare_pool}",
        markup=False,
    )
    for s in progress.open_steps:
        out_console.print(f"step {s.step}: {s.committed}/{s.target} {s.status}", markup=False)
    trained = [r for r in history if r.get("reward") is not None]
    if trained:
        show(metrics_table(trained[-8:], title="last steps"))
