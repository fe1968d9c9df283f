from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from refill.models.db import Ledger
from refill.models.tables import Base
from tests.support.databases import temporary_pg_database, truncate_all

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database of this test session, with the ledger schema."""
    with temporary_pg_database() as url:
        ledger = Ledger(url)
        Base.metadata.create_all(ledger.engine)
        ledger.dispose()
        yield url


@pytest.fixture
def pg_ledger(pg_url: str) -> Iterator[Ledger]:
    truncate_all(pg_url)
    ledger = Ledger(pg_url)
    yield ledger
    ledger.dispose()


@pytest.fixture
def sqlite_ledger(tmp_path) -> Iterator[Ledger]:
    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    Base.metadata.create_all(ledger.engine)
    yield ledger
    ledger.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def ledger(request) -> Ledger:
    """The integration suite runs on both ledgers."""
    return request.getfixturevalue("pg_ledger" if request.param == "postgresql" else "sqlite_ledger")
