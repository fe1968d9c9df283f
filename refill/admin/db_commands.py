"""`refill db ...`: the ledger's schema."""

from __future__ import annotations

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
    from refill.models.migrate import current_revision, upgrade as run_upgrade

    url = ledger_url(database_url)
    engine = make_engine(url)
    before = current_revision(engine)
    run_upgrade(engine, revision)
    note(f"ledger {redact_url(url)}: schema {before or 'empty'} -> {current_revision(engine)}")


@db_app.command("current")
def current(database_url: DatabaseUrl = None) -> None:
    """Print the ledger's schema revision and the newest one this refill knows."""
    from refill.admin.ledger_access import ledger_url
    from refill.models.db import make_engine
    from refill.models.migrate import current_revision, head_revision

    engine = make_engine(ledger_url(database_url))
    typer.echo(f"{current_revision(engine) or 'none'} (newest: {head_revision()})")
