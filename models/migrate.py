"""Schema migrations of the ledger (Alembic), callable from code and from `refill db`."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine

import refill.migrations
from refill.models.db import make_engine

MIGRATIONS = Path(refill.migrations.__file__).resolve().parent


def alembic_config() -> Config:
    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def _run(engine: Engine, fn, *args) -> None:  # type: ignore[no-untyped-def]
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        fn(config, *args)


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    prepare_sqlite_dir(engine)
    _run(engine, command.upgrade, revision)


def downgrade(url_or_engine: str | Engine, revision: str) -> None:
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    _run(engine, command.downgrade, revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def prepare_sqlite_dir(engine: Engine) -> None:
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and database != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(database)), exist_ok=True)
