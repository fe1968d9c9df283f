"""`refill db ...`: the ledger's schema."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from refill.admin.console import note, redact_url

db_app = typer.Typer(help="Create and migrate the ledger's schema.", no_args_is_help=True)

DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="Ledger URL (default: REFILL_DATABASE_URL, else sqlite:///runs/refill.db)."),
]


@db_app.command("upgrade")
def upgrade(database_url: DatabaseUrl = None, revision: str = "head") -> None:
    """Create the ledger, or migrate it to the newest schema."""
    from refill.admin.ledger_access import ledger_url
    from refill.models.db import make_engine
    from refill.models.migrate import current_revision
    from refill.models.migrate import upgrade as run_upgrade

    url = ledger_url(database_url)
    engine = make_engine(url)
    before = current_revision(engine)
    with _migration_progress():
        run_upgrade(engine, revision)
    note(f"ledger {redact_url(url)}: schema {before or 'empty'} -> {current_revision(engine)}")


class _NoteHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        note(self.format(record))


@contextmanager
def _migration_progress() -> Iterator[None]:
    """Alembic's and the migrations' INFO lines (each revision run, a data migration's
    progress) on stderr while the command runs: converting a large ledger takes a while."""
    logger = logging.getLogger("alembic.runtime.migration")
    handler, level = _NoteHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@db_app.command("current")
def current(database_url: DatabaseUrl = None) -> None:
    """Print the ledger's schema revision and the newest one this refill knows."""
    from refill.admin.ledger_access import ledger_url
    from refill.models.db import make_engine
    from refill.models.migrate import current_revision, head_revision

    engine = make_engine(ledger_url(database_url))
    typer.echo(f"{current_revision(engine) or 'none'} (newest: {head_revision()})")
