"""What the commands that read the ledger share: the `--database-url`, `--json` and RUN
arguments, one snapshot read with NotFound as a one-line error, and how they print JSON and
timestamps (tables: `refill.admin.console.print_table` and `show`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import typer

from refill.admin.console import EXIT_BAD_INPUT, fail

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
#: The largest id or count a ledger column holds (PostgreSQL's `integer`): a larger argument names
#: nothing, and PostgreSQL refuses to compare with it ("integer out of range").
LEDGER_INT_MAX = 2**31 - 1
RunId = Annotated[
    int,
    typer.Argument(metavar="RUN", help="Run id (see `refill runs`).", show_default=False, min=1, max=LEDGER_INT_MAX),
]


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
