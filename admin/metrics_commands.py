"""`refill metrics RUN` (table, `--csv`, `--json`) and `refill plot RUN -o FILE.png`.

The metrics are the per-step rows of SPEC §6 as the ledger stores them (`step_metrics`,
written at release and completed by the trainer). The plot shows whether learning happens when
the trained reward looks flat: trained reward (after the filter), unfiltered reward (every
finished attempt) and first-attempt reward (what a run without dynamic sampling would see)
together; the zero-variance fraction (does the filter have work?); and the step fill time next
to the trainer's idle time; and what each trained group cost in rollouts and tokens, beside
the prompts pre-rollout skipping passed over.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from refill.admin.console import EXIT_BAD_INPUT, fail, note, out_console, print_json, show
from refill.admin.inspect_common import AsJson, DatabaseUrl, RunId, jsonable, read

#: The plot's panels: (y label, metric names). Each metric's legend label is its name.
PANELS: list[tuple[str, list[str]]] = [
    ("mean reward", ["reward", "unfiltered_reward", "first_attempt_reward"]),
    ("fraction", ["zero_variance_fraction"]),
    ("seconds", ["step_fill_seconds", "trainer_idle_seconds"]),
    # What a trained group cost (about 1 / (1 - p) generations under dynamic sampling), and
    # what pre-rollout skipping passed over instead (data.prompt_skipping).
    ("rollouts / group", ["rollouts_per_trained_group"]),
    ("tokens / group", ["generated_tokens_per_trained_group"]),
    ("prompts", ["skipped_prompts"]),
]
#: `refill metrics --trainer`: the trainer's figures per step (key, header, format). Most are
#: extras (the step_metrics row's `extra` JSON): what the updates of a step did to the ratio,
#: the clip on each side, and the behaviour->proximal importance weights.
TRAINER_COLUMNS: list[tuple[str, str, str]] = [
    ("step", "step", "{}"),
    ("loss", "loss", "{:.4f}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("updates", "upd", "{:.0f}"),
    ("ratio_mean", "ratio", "{:.4f}"),
    ("clip_fraction_lower", "clip lo", "{:.4f}"),
    ("clip_fraction_upper", "clip hi", "{:.4f}"),
    ("importance_weight_mean", "iw", "{:.4f}"),
    ("importance_weight_truncated_fraction", "iw cut", "{:.4f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
]
#: PNG text chunk that lists the legend labels drawn, in order (comma-separated).
SERIES_KEY = "refill.series"


def _rows(database_url: str | None, run_id: int) -> list[dict[str, Any]]:
    from refill.admin.progress_queries import step_metrics
    from refill.admin.snapshot import get_run

    def question(session: Any) -> list[dict[str, Any]]:
        get_run(session, run_id)
        return step_metrics(session, run_id)

    return read(database_url, question)


def metrics(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    as_csv: Annotated[bool, typer.Option("--csv", help="Every metric as CSV on stdout.")] = False,
    as_json: AsJson = False,
    trainer: Annotated[
        bool,
        typer.Option(
            "--trainer",
            help="The table shows the trainer's figures: loss, updates, ratio, clip per side, "
            "importance weights.",
        ),
    ] = False,
) -> None:
    """Show the run's per-step metrics (table, --csv or --json).

    The table shows the headline metrics of SPEC §6 (--trainer: the trainer's, clip fractions
    per side and importance weights included); CSV and JSON carry every column."""
    if as_csv and as_json:
        fail("choose one of --csv and --json", EXIT_BAD_INPUT)
    rows = _rows(database_url, run_id)
    if as_json:
        print_json(jsonable(rows))
        return
    if as_csv:
        from refill.admin.progress_queries import METRIC_COLUMNS

        # The ledger's columns first (a header even before the first step), then the trainer's
        # extras as the rows have them.
        keys: list[str] = list(METRIC_COLUMNS)
        for row in rows:
            keys.extend(k for k in row if k not in keys)
        writer = csv.DictWriter(sys.stdout, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        sys.stdout.flush()
        if not rows:
            note(f"run {run_id} has released no step yet")
        return
    if not rows:
        note(f"run {run_id} has released no step yet")
        return
    if trainer:
        show(trainer_table(rows, title=f"run {run_id}: the trainer per step"))
        note("every column: --csv or --json")
        return
    from refill.admin.progress import metrics_table

    show(metrics_table(rows, title=f"run {run_id}: metrics per step"))
    note("every column: --csv or --json")


def trainer_table(rows: list[dict[str, Any]], title: str | None = None) -> Table:
    """The trainer's columns of `rows` (step_metrics rows with their extras merged); a step
    not trained yet, or a figure the trainer did not report (kl without a KL term), is "-"."""
    table = Table(title=title, show_edge=False, pad_edge=False)
    for _, header, _ in TRAINER_COLUMNS:
        table.add_column(header, justify="right")
    for row in rows:
        cells = []
        for key, _, pattern in TRAINER_COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None else pattern.format(value))
        table.add_row(*cells)
    return table


def plot(
    run_id: RunId,
    output: Annotated[Path, typer.Option("-o", "--output", help="The PNG file to write.", show_default=False)],
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Plot the run's rewards, zero-variance fraction, timings and costs into a PNG.

    Panels per step: reward, unfiltered_reward and first_attempt_reward together;
    zero_variance_fraction; step_fill_seconds and trainer_idle_seconds;
    rollouts_per_trained_group; generated_tokens_per_trained_group; skipped_prompts."""
    if output.suffix.lower() != ".png":
        fail(f"{output}: the plot is a PNG; name the file *.png", EXIT_BAD_INPUT)
    if output.parent and not output.parent.exists():
        fail(f"{output.parent}: no such directory", EXIT_BAD_INPUT)
    from refill.admin.snapshot import get_run

    name = read(database_url, lambda s: get_run(s, run_id).name)
    rows = _rows(database_url, run_id)
    if not rows:
        fail(f"run {run_id} has released no step yet: nothing to plot", EXIT_BAD_INPUT)
    labels = render(rows, output, title=f"refill run {run_id} ({name})", run_id=run_id)
    if as_json:
        print_json({"path": str(output), "run_id": run_id, "steps": len(rows), "series": labels})
        return
    out_console.print(f"{output}: {len(rows)} steps; {', '.join(labels)}", markup=False)


def render(rows: list[dict[str, Any]], output: Path, *, title: str, run_id: int) -> list[str]:
    """Draw the panels into `output`; returns the legend labels drawn, which are also
    stored in the PNG's `refill.series` text chunk."""
    # The object API with an explicit Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(9, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    steps = [row["step"] for row in rows]
    for ax, (ylabel, keys) in zip(axes, PANELS, strict=True):
        for key in keys:
            values = [float("nan") if row.get(key) is None else float(row[key]) for row in rows]
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.5, label=key)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    labels = [text.get_text() for ax in axes for text in ax.get_legend().get_texts()]
    figure.savefig(
        output,
        format="png",
        metadata={
            "Title": title,
            SERIES_KEY: ",".join(labels),
            "refill.run": str(run_id),
            "refill.steps": json.dumps(steps),
        },
    )
    return labels
