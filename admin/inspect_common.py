"""What the commands that read the ledger share: the `--database-url`, `--json` and RUN
arguments, one snapshot read with NotFound as a one-line error, and how they print tables,
JSON and timestamps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from refill.admin.console import EXIT_BAD_INPUT, fail, out_console

T = TypeVar("T")

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        help="Ledger URL (default: REFILL_DATABASE_URL, else sqlite:///runs/refill.db).",
        show_default=False,
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
RunId = Annotated[int, typer.Argument(metavar="RUN", help="Run id (see `refill runs`).", show_default=False)]


@contextmanager
def ledger_for(database_url: str | None) -> Iterator[Any]:
    """The ledger of `--database-url` (a one-line error and exit 2 when there is none),
    disposed of afterwards so that a long-lived caller leaks no connections."""
    from refill.admin.ledger_access import open_ledger

    ledger = open_ledger(database_url)
    try:
        yield ledger
    finally:
        ledger.dispose()


def read(database_url: str | None, question: Callable[[Any], T]) -> T:
    """Answer `question(session)` on one snapshot; NotFound becomes `error: ...`, exit 2."""
    from refill.admin.snapshot import read_snapshot

    with ledger_for(database_url) as ledger, read_snapshot(ledger) as session:
        try:
            return question(session)
        except LookupError as error:
            fail(str(error.args[0] if error.args else error), EXIT_BAD_INPUT)


def show(renderable: RenderableType) -> None:
    """Print a table on stdout: at the terminal's width for people, at its natural width when
    stdout is a pipe or a file (rich would otherwise cut every cell to fit 80 columns)."""
    if out_console.is_terminal:
        out_console.print(renderable)
    else:
        Console(soft_wrap=True, highlight=False, width=4096).print(renderable)


def print_table(rows: list[Any], columns: list[str] | None = None, *, title: str | None = None) -> None:
    """Rows (mappings, or sequences with `columns`) as a table; None prints as an empty cell,
    numeric columns are right-aligned (as `refill.admin.console.print_table`)."""
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    cells = [[row.get(c) for c in columns] if isinstance(row, dict) else list(row) for row in rows]
    table = Table(title=title)
    for i, column in enumerate(columns):
        values = [r[i] for r in cells if r[i] is not None]
        numeric = bool(values) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        table.add_column(column, justify="right" if numeric else "left")
    for row in cells:
        table.add_row(*(Text("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)) for v in row))
    show(table)


def jsonable(value: Any) -> Any:
    """Datetimes as ISO 8601 (UTC), containers recursively; everything else as it is."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def when(value: datetime | None) -> str | None:
    """A timestamp for a table cell: UTC, to the second."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value is not None else None


def clock(value: datetime | None) -> str | None:
    return value.astimezone(UTC).strftime("%H:%M:%S") if value is not None else None


def ago(value: datetime | None, now: datetime) -> str | None:
    if value is None:
        return None
    seconds = (now - value).total_seconds()
    if seconds < 0:
        return f"in {-seconds:.0f}s"
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def num(value: float | None, digits: int = 3) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def first_line(text: str | None, width: int = 60) -> str | None:
    if not text:
        return None
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"
