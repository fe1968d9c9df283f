"""Output helpers shared by every `refill` command.

Conventions every command follows, so scripts can rely on them:
- results go to stdout (a rich table for people, `print_json` for `--json`); notes, warnings and
  errors go to stderr, so `refill ... --json | jq` always reads clean JSON;
- an error is one line, `error: ...`, and a known exit code (`fail`), never a traceback;
- exit codes: 0 success, 1 the thing checked is wrong (a config, a ledger invariant),
  2 bad input (no such file, run, step or slot; unreadable YAML; usage errors).
- URLs are printed through `redact_url`, so a password never reaches a terminal or a log.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import typer
import yaml
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from refill.config import redact_url

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_INVALID",
    "err_console",
    "fail",
    "note",
    "out_console",
    "print_json",
    "print_problems",
    "print_table",
    "print_yaml",
    "redact_url",
    "show",
    "warn",
]

EXIT_INVALID = 1
EXIT_BAD_INPUT = 2
#: The reader of stdout went away (`refill runs | head -1`): what a shell reports for a tool
#: that SIGPIPE ended (128 + 13), so a script tells it from "checked and wrong".
EXIT_BROKEN_PIPE = 141

# soft_wrap: rich would otherwise break long lines at the terminal width, which splits the
# `key.path: message. Fix: ...` lines that people grep. highlight off: colouring numbers and
# paths inside plain messages reads as noise.
class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's own answer is exit 1, this CLI's "checked and wrong"."""
        try:
            super().on_broken_pipe()
        except SystemExit:
            raise SystemExit(EXIT_BROKEN_PIPE) from None


out_console = _Console(soft_wrap=True, highlight=False)
err_console = _Console(stderr=True, soft_wrap=True, highlight=False)


def print_problems(source: Any, problems: Sequence[Any]) -> None:
    """A config's problems on stderr, each `key.path: message. Fix: ...` on its own line."""
    count = len(problems)
    err_console.print(f"{source}: {count} problem{'s' if count != 1 else ''}:", markup=False)
    for problem in problems:
        err_console.print(str(problem), markup=False)


def print_json(data: Any) -> None:
    """`data` as indented JSON on stdout; plain text, never rich markup, so it always parses."""
    sys.stdout.write(json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def print_yaml(data: Any) -> None:
    """`data` as block YAML on stdout, keys in their given order."""
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True))
    sys.stdout.flush()


def print_table(
    rows: Iterable[Mapping[str, Any]] | Iterable[Sequence[Any]],
    columns: Sequence[str] | None = None,
    *,
    title: str | None = None,
) -> None:
    """A rich table on stdout (`show`). Rows are mappings (columns default to the first row's
    keys) or sequences (then `columns` is required). None prints as an empty cell; numeric
    columns (numbers, or numbers formatted as text) are right-aligned."""
    rows = list(rows)
    if columns is None:
        if rows and not isinstance(rows[0], Mapping):
            raise ValueError("print_table needs columns for rows that are not mappings")
        columns = list(rows[0].keys()) if rows else []
    cells = [
        [row.get(c) for c in columns] if isinstance(row, Mapping) else list(row)
        for row in rows
    ]
    table = Table(title=title, show_lines=False)
    for i, column in enumerate(columns):
        values = [r[i] for r in cells if i < len(r) and r[i] is not None]
        numeric = bool(values) and all(_is_number(v) for v in values)
        table.add_column(column, justify="right" if numeric else "left")
    for row in cells:
        # Text() keeps square brackets in values (slot ids, lists) from being read as markup.
        table.add_row(*(Text("" if v is None else _cell(v)) for v in row))
    show(table)


def show(renderable: RenderableType) -> None:
    """Print a table on stdout: at the terminal's width for people, at its natural width when
    stdout is a pipe or a file (a log, `| less`): rich would otherwise cut every cell to fit 80
    columns, and a run's log would keep `0.5…` where its rewards were."""
    if out_console.is_terminal:
        out_console.print(renderable)
    else:
        _Console(soft_wrap=True, highlight=False, width=4096).print(renderable)


def _is_number(value: Any) -> bool:
    """A number, or a number already formatted (`num`'s fixed decimals): right-aligned."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


def _cell(value: Any) -> str:
    if isinstance(value, float):
        # Four significant figures, but never an exponent for a figure people count in
        # (a run's 12,345 seconds, a step's tokens): `.4g` would print 1.234e+04.
        if 9999.5 <= abs(value) < 1e15:  # from where .4g would round up to 1e+04
            return f"{value:.0f}"
        return f"{value:.4g}"
    return str(value)


def note(message: str) -> None:
    """A line for people on stderr (progress, context), kept out of stdout."""
    err_console.print(message, markup=False)


def warn(message: str) -> None:
    err_console.print(Text("warning: ", style="yellow") + Text(message))


def fail(message: str, code: int = EXIT_INVALID) -> NoReturn:
    """Print `error: message` on stderr and exit with `code`."""
    err_console.print(Text("error: ", style="bold red") + Text(message))
    raise typer.Exit(code)
