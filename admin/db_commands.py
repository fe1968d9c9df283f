"""`refill db ...`: the ledger's schema, and the role people query it with."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from refill.admin.console import EXIT_BAD_INPUT, fail, note, redact_url, warn

db_app = typer.Typer(help="Create and migrate the ledger's schema; create its read-only role.", no_args_is_help=True)

DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="Ledger URL (default: REFILL_DATABASE_URL, else sqlite:///runs/refill.db)."),
]


@db_app.command("upgrade")
def upgrade(database_url: DatabaseUrl = None, revision: str = "head") -> None:
    """Create the ledger, or migrate it to the newest schema."""
    from alembic.util import CommandError
    from sqlalchemy.exc import DBAPIError

    from refill.admin.ledger_access import cannot_reach, ledger_at, ledger_url, schema_revision
    from refill.models.migrate import prepare_sqlite_dir
    from refill.models.migrate import upgrade as run_upgrade

    url = ledger_url(database_url)
    ledger = ledger_at(url)
    try:
        prepare_sqlite_dir(ledger.engine)  # a new embedded ledger's folder
    except OSError as error:
        fail(f"cannot create the ledger at {redact_url(url)}: {error}", EXIT_BAD_INPUT)
    before = schema_revision(ledger)
    try:
        with _migration_progress():
            run_upgrade(ledger.engine, revision)
    except CommandError as error:  # a revision Alembic does not know
        fail(f"--revision {revision}: {error}", EXIT_BAD_INPUT)
    except DBAPIError as error:
        cannot_reach(url, error)
    note(f"ledger {redact_url(url)}: schema {before or 'empty'} -> {schema_revision(ledger)}")


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
    from refill.admin.ledger_access import ledger_at, ledger_url, schema_revision
    from refill.models.migrate import head_revision

    revision = schema_revision(ledger_at(ledger_url(database_url)))
    typer.echo(f"{revision or 'none'} (newest: {head_revision()})")


#: The read-only role's default name: people who query the ledger with SQL (docs/sql.md).
READER_ROLE = "refill_reader"
_ROLE_NAME = re.compile(r"[a-z_][a-z0-9_$]{0,62}")


@db_app.command("roles")
def roles(
    database_url: DatabaseUrl = None,
    reader: Annotated[str, typer.Option("--reader", help="Name of the read-only role.")] = READER_ROLE,
    grant_to: Annotated[
        list[str] | None,
        typer.Option("--grant-to", help="An existing login role to make a member of the read-only role (repeatable)."),
    ] = None,
) -> None:
    """Create the read-only role for people who query the ledger with SQL (idempotent).

    It may SELECT the ledger's tables and views and nothing else: no writes, no new objects.
    It has no login and no password: give people their own login roles (--grant-to NAME), so
    that no one holds the credentials the fleet writes with. Run it as the role that runs
    `refill db upgrade` (tables it creates later are then readable too), on PostgreSQL."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from refill.admin.ledger_access import cannot_reach, ledger_at, ledger_url

    url = ledger_url(database_url)
    ledger = ledger_at(url)
    if ledger.engine.dialect.name != "postgresql":
        fail(
            f"roles need a PostgreSQL ledger, not {redact_url(url)}: an embedded SQLite ledger is a "
            "file; give people a copy, or have them open it read-only (sqlite3 -readonly FILE)",
            EXIT_BAD_INPUT,
        )
    members = list(grant_to or [])
    for name in (reader, *members):
        if not _ROLE_NAME.fullmatch(name):
            fail(f"{name!r} is not a role name refill creates or grants: lower-case letters, digits and _", EXIT_BAD_INPUT)
    engine = ledger.engine
    try:
        with engine.begin() as conn:
            missing = [m for m in members if conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": m}) is None]
            if missing:
                fail(f"no role {', '.join(missing)} on this server: create each login role first (CREATE ROLE NAME LOGIN ...)", EXIT_BAD_INPUT)
            created = conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": reader}) is None
            for statement in reader_statements(reader, members, created=created):
                conn.execute(text(statement))
            # Through PUBLIC, before PostgreSQL 15's default took it away: not refill's to
            # revoke (the fleet's own roles may create through it).
            can_create = conn.scalar(text("SELECT has_schema_privilege(:n, 'public', 'CREATE')"), {"n": reader})
    except OperationalError as error:
        cannot_reach(url, error)
    except ProgrammingError as error:
        fail(f"cannot set up roles on {redact_url(url)}: {str(error.orig).splitlines()[0]}", EXIT_BAD_INPUT)
    finally:
        engine.dispose()
    note(
        f"ledger {redact_url(url)}: role {reader} {'created' if created else 'already there, privileges reset'}: "
        "SELECT on every table and view of schema public, nothing else"
        + (f"; members: {', '.join(members)}" if members else "")
    )
    if can_create:
        warn(
            f"{reader} can still create tables in schema public, through PUBLIC (the default before "
            "PostgreSQL 15): REVOKE CREATE ON SCHEMA public FROM PUBLIC, once the role that runs "
            "`refill db upgrade` owns the schema or has CREATE of its own"
        )


def reader_statements(reader: str, members: list[str], *, created: bool) -> list[str]:
    """The SQL that makes `reader` a read-only role (the same end state however often run)."""
    role = f'"{reader}"'
    return [
        *([f"CREATE ROLE {role} NOLOGIN"] if created else []),
        # Whatever it was granted before, SELECT is all it keeps.
        f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {role}",
        f"REVOKE CREATE ON SCHEMA public FROM {role}",
        f"GRANT USAGE ON SCHEMA public TO {role}",
        f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}",
        # Tables and views that later migrations create, when run by this same role.
        f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {role}",
        *(f'GRANT {role} TO "{member}"' for member in members),
    ]
