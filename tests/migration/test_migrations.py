"""The migrated schema is the models' schema, and migrations run both ways, on both ledgers."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from refill.models.db import make_engine
from refill.models.migrate import current_revision, downgrade, head_revision, upgrade
from refill.models.tables import Base
from tests.support.databases import temporary_pg_database


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/migrate.db"
    else:
        with temporary_pg_database("refill_migrate") as url:
            yield url


def _differences(engine) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return compare_metadata(context, Base.metadata)


def test_upgrade_creates_the_models_schema(empty_url: str) -> None:
    engine = make_engine(empty_url)
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    tables = set(inspect(engine).get_table_names())
    assert {t.name for t in Base.metadata.sorted_tables} <= tables
    assert _differences(engine) == []
    engine.dispose()


def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    engine = make_engine(empty_url)
    upgrade(engine)
    downgrade(engine, "base")
    leftover = set(inspect(engine).get_table_names()) - {"alembic_version"}
    assert leftover == set()
    upgrade(engine)
    assert _differences(engine) == []
    engine.dispose()
