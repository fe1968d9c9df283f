"""Fixtures of the integration suite.

- Every integration test ends with the ledger's invariants checked on each run it drove
  (`tests/support/invariants.py`).
- The ledgers are the ones of `tests/conftest.py` (`ledger` runs a test on PostgreSQL and on
  SQLite), but kept for the whole session and emptied between tests: a new engine per test
  starts with a cold compiled-statement cache, and TRUNCATE of eleven tables costs PostgreSQL
  more than the test itself. Emptying deletes every row with foreign keys unenforced for the
  duration (the tables hold a slot <-> attempt cycle); a PostgreSQL role that is not a
  superuser cannot unenforce them, and truncates instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text

from refill.models.db import Ledger
from refill.models.tables import Base
from tests.support import driver
from tests.support.invariants import assert_ledger_consistent

TABLES = [t.name for t in reversed(Base.metadata.sorted_tables)]


def _empty_pg(ledger: Ledger, superuser: bool) -> None:
    with ledger.engine.begin() as conn:
        if not superuser:  # session_replication_role is a superuser's setting
            conn.execute(text(f"TRUNCATE {', '.join(TABLES)} CASCADE"))
            return
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        for name in TABLES:
            conn.execute(text(f"DELETE FROM {name}"))


def _empty_sqlite(ledger: Ledger) -> None:
    raw = ledger.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA foreign_keys=OFF")  # only outside a transaction
        cursor.execute("BEGIN IMMEDIATE")
        for name in TABLES:
            cursor.execute(f"DELETE FROM {name}")
        cursor.execute("COMMIT")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()
    finally:
        raw.close()


@pytest.fixture(scope="session")
def _shared_pg_ledger(pg_url: str) -> Iterator[tuple[Ledger, bool]]:
    ledger = Ledger(pg_url)
    with ledger.engine.connect() as conn:
        superuser = bool(
            conn.execute(text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")).scalar()
        )
    yield ledger, superuser
    ledger.dispose()


@pytest.fixture(scope="session")
def _shared_sqlite_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    path = tmp_path_factory.mktemp("ledger") / "ledger.db"
    ledger = Ledger(f"sqlite:///{path}")
    Base.metadata.create_all(ledger.engine)
    yield ledger
    ledger.dispose()


@pytest.fixture
def pg_ledger(_shared_pg_ledger: tuple[Ledger, bool]) -> Ledger:
    ledger, superuser = _shared_pg_ledger
    _empty_pg(ledger, superuser)
    return ledger


@pytest.fixture
def pg_ledger_truncated_after(pg_ledger: Ledger, _shared_pg_ledger: tuple[Ledger, bool]) -> Iterator[Ledger]:
    """`pg_ledger` for a test that fills the tables with a long run's rows or a large step's,
    watches its statements through `auto_explain` and takes statistics (the run-length and
    step-size tests; skipped for a role that is not a superuser, which can neither load
    `auto_explain` nor copy rows with foreign keys unchecked): emptied after it by TRUNCATE, and
    the statistics dropped. Emptied by DELETE (as between other tests), their dead rows stay in
    the tables and indexes (this suite's PostgreSQL runs without autovacuum), and they and the
    statistics planned the next test's queries: `test_query_plans.py` failed after them. Its
    runs' invariants are the test's to check, before this empties them."""
    if not _shared_pg_ledger[1]:
        pytest.skip("loading auto_explain and copying rows with foreign keys unchecked take a superuser")
    yield pg_ledger
    with pg_ledger.engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
        conn.execute(text("DELETE FROM pg_statistic WHERE starelid = ANY(CAST(:tables AS regclass[]))"), {"tables": TABLES})


@pytest.fixture
def sqlite_ledger(_shared_sqlite_ledger: Ledger) -> Ledger:
    _empty_sqlite(_shared_sqlite_ledger)
    return _shared_sqlite_ledger


@pytest.fixture(autouse=True)
def ledger_stays_consistent() -> Iterator[None]:
    driver.DRIVERS.clear()
    yield
    drivers, driver.DRIVERS[:] = list(driver.DRIVERS), []
    for d in drivers:
        if d.check:
            with d.ledger.session() as session:
                assert_ledger_consistent(session, d.run_id)
