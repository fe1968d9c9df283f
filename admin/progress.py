"""Live progress of a run for people: a progress bar over trained steps, the steps filling
now, and a table of the last steps' metrics (the figures SPEC §6 says to watch)."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from refill.admin.progress_queries import RunProgress

COLUMNS = [
    ("step", "step", "{}"),
    ("reward", "reward", "{:.3f}"),
    ("unfiltered_reward", "unfilt", "{:.3f}"),
    ("first_attempt_reward", "1st-try", "{:.3f}"),
    ("zero_variance_fraction", "zero-var", "{:.2f}"),
    ("filtered_groups", "filt", "{}"),
    ("replaced_prompt_groups", "repl", "{}"),
    ("promoted_prompt_groups", "borr", "{}"),
    ("rollouts_per_trained_group", "gen/grp", "{:.2f}"),
    ("skipped_prompts", "skip", "{}"),
    ("step_fill_seconds", "fill s", "{:.2f}"),
    ("loss", "loss", "{:.4f}"),
]


def _fmt(value: Any, pattern: str) -> str:
    if value is None:
        return "-"
    try:
        return pattern.format(value)
    except (TypeError, ValueError):
        return str(value)


def metrics_table(rows: list[dict[str, Any]], title: str | None = None) -> Table:
    table = Table(title=title, show_edge=False, pad_edge=False)
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(key), pattern) for key, _, pattern in COLUMNS))
    return table


class RunDisplay:
    """Feed it `RunProgress` snapshots (the controller's `on_progress`)."""

    def __init__(self, console: Console, *, recent: int = 8, enabled: bool = True) -> None:
        self.console = console
        self.recent = recent
        self.enabled = enabled
        self.rows: dict[int, dict[str, Any]] = {}
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("steps", total=None, detail="")
        self.live = Live(console=console, refresh_per_second=4, transient=False) if enabled else None
        self.started = time.monotonic()

    def __enter__(self) -> RunDisplay:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, snapshot: RunProgress, history: list[dict[str, Any]] | None = None) -> None:
        for row in [*(history or []), *snapshot.recent_metrics]:
            self.rows[row["step"]] = row
        # The table shows the newest `recent` steps: a long run's older rows need not stay.
        for step in sorted(self.rows)[: -self.recent]:
            del self.rows[step]
        filling = ", ".join(f"step {s.step}: {s.committed}/{s.target} {s.status}" for s in snapshot.open_steps[:3])
        self.progress.update(
            self.task,
            total=snapshot.max_num_steps,
            completed=snapshot.trained_steps,
            detail=filling or snapshot.status,
        )
        if self.live is not None:
            self.live.update(Group(self.progress, metrics_table([self.rows[k] for k in sorted(self.rows)])))


class StepLines:
    """A line per trained step, for a log (`refill run start` off a terminal, or `-q`), from
    the controller's progress snapshots: each step once and in order, however many trained
    between two snapshots."""

    def __init__(self) -> None:
        self.last: int | None = None  # the newest step given a line

    def lines(self, snapshot: RunProgress) -> list[str]:
        out: list[str] = []
        for metrics in snapshot.recent_metrics:
            step = metrics["step"]
            if self.last is not None and step <= self.last:
                continue
            if self.last is not None and step > self.last + 1:
                # More steps trained between two snapshots than one carries: say so, rather
                # than leave a log that looks whole.
                out.append(
                    f"steps {self.last + 1}-{step - 1}: trained (`refill metrics {snapshot.run_id}` has their metrics)"
                )
            out.append(step_line(metrics))
            self.last = step
        return out


def step_line(row: dict[str, Any]) -> str:
    """One trained step's metrics on a line, for a log (`refill run start` and `refill tail` off
    a terminal); a figure the step has not got prints as `-`."""

    def f(key: str, digits: int = 3) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    def count(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else str(value)

    return (
        f"step {row['step']}: reward {f('reward')} (unfiltered {f('unfiltered_reward')}, first-attempt "
        f"{f('first_attempt_reward')}, zero-var {f('zero_variance_fraction', 2)}, filtered "
        f"{count('filtered_groups')}, fill {f('step_fill_seconds', 2)}s, rollouts/group "
        f"{f('rollouts_per_trained_group', 2)}, tokens/group {f('generated_tokens_per_trained_group', 0)}, "
        f"skipped {count('skipped_prompts')})"
    )


def write_metrics(rows: list[dict[str, Any]], run_dir: str) -> Path:
    """`metrics.csv` (and `metrics.json`) in the run directory; returns the CSV path."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "metrics.csv"
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    (directory / "metrics.json").write_text(json.dumps(rows, indent=1, default=str))
    return path
