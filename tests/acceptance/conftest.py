from __future__ import annotations

from collections.abc import Iterator

import pytest

from refill.models.db import Ledger
from refill.models.migrate import upgrade
from tests.support.databases import temporary_pg_database
from tests.support.fleet import Fleet, fleet


@pytest.fixture(scope="module")
def fleet_db() -> Iterator[str]:
    """A PostgreSQL ledger for the module's fleet, created by `refill db upgrade`'s code."""
    with temporary_pg_database("refill_fleet") as url:
        upgrade(url)
        yield url


@pytest.fixture(scope="module")
def running_fleet(fleet_db: str, tmp_path_factory) -> Iterator[Fleet]:
    with fleet(fleet_db, tmp_path_factory.mktemp("fleet")) as f:
        yield f


@pytest.fixture
def fleet_ledger(fleet_db: str) -> Iterator[Ledger]:
    ledger = Ledger(fleet_db)
    yield ledger
    ledger.dispose()
