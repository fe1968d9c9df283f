"""The test session's servers and ledgers.

The session starts a throwaway PostgreSQL and Redis for whichever of REFILL_TEST_PG_URL and
REFILL_TEST_REDIS_URL is not set (tests/support/services.py), before anything is collected, and
removes them when it ends; the fault suite starts a Redis of its own (tests/faults/conftest.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from refill.models.db import Ledger
from refill.models.tables import Base
from tests.support import driver
from tests.support.databases import temporary_pg_database, truncate_all
from tests.support.services import (
    PG_ENV,
    REDIS_ENV,
    MissingBinaries,
    SessionServices,
    install_line,
    missing_binaries,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SERVICES = pytest.StashKey[SessionServices]()


def pytest_sessionstart(session: pytest.Session) -> None:
    option = session.config.option
    if option.collectonly or getattr(option, "showfixtures", False):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A pytest-xdist worker (`-n`): the controlling session started the servers (or was
        # given them) before it started the workers, whose environment names them.
        _own_redis_database(os.environ["PYTEST_XDIST_WORKER"])
        return
    # Before anything starts: a machine without the binaries gets one line, not an error per
    # test. (A UsageError is the one way out of a session that pytest prints once, as one line.)
    missing = missing_binaries(postgresql=not os.environ.get(PG_ENV), redis=not os.environ.get(REDIS_ENV))
    if missing:
        raise pytest.UsageError(install_line(missing))
    services = SessionServices()
    try:
        services.start()
    except MissingBinaries as error:
        raise pytest.UsageError(str(error)) from error
    except Exception as error:  # noqa: BLE001 - the session cannot run without its servers
        raise pytest.UsageError(f"the test servers did not start: {error}") from error
    session.config.stash[SERVICES] = services


def _own_redis_database(worker: str) -> None:
    """Point this xdist worker at a Redis database of its own (gw0 -> 1, gw1 -> 2, ...): its
    fleets' queues, results and worker events must not meet another worker's. Each worker
    makes its own PostgreSQL database already (tests/support/databases.py)."""
    url = urlsplit(os.environ[REDIS_ENV])
    index = int(worker.removeprefix("gw")) + 1
    if index > 15:
        raise pytest.UsageError(f"at most 15 test workers share one Redis (16 databases); {worker} is one too many: lower -n")
    os.environ[REDIS_ENV] = urlunsplit(url._replace(path=f"/{index}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under `-n`, the fault scenarios that share the package's fleet of worker processes
    # (tests/faults/conftest.py) run on one xdist worker, one after the other, as they do
    # without it (`--dist loadgroup`); everything else spreads over the workers.
    for item in items:
        if "chaos_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("fault-fleet"))


def pytest_report_header(config: pytest.Config) -> list[str]:
    services = config.stash.get(SERVICES, None)
    return [f"refill test services: {line}" for line in services.lines] if services else []


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("faults") for item in session.items) and missing_binaries(
        postgresql=False, redis=True
    ):
        raise pytest.UsageError(
            "the fault suite starts a Redis of its own, whatever REFILL_TEST_REDIS_URL says: "
            "install redis-server, or leave the suite out with -m 'not faults'"
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    services = session.config.stash.get(SERVICES, None)
    if services is not None:
        del session.config.stash[SERVICES]
        services.stop()


@pytest.fixture(autouse=True)
def _drivers_leave_no_run_directories() -> Iterator[None]:
    """A `tests.support.driver.Driver` makes its run a directory under the system's temporary
    folder (claim-check payloads land there); it goes when its test ends, after the integration
    suite's check of the ledger. Only the integration suite removed them before: the unit and
    migration tests' Drivers left about 50 empty directories in /tmp a run."""
    yield
    made, driver.OUTPUT_DIRS[:] = list(driver.OUTPUT_DIRS), []
    for path in made:
        if os.path.isdir(path):
            shutil.rmtree(path)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database of this test session, with the ledger schema."""
    with temporary_pg_database() as url:
        ledger = Ledger(url)
        Base.metadata.create_all(ledger.engine)
        ledger.dispose()
        yield url


@pytest.fixture(scope="module")
def migrated_url() -> Iterator[str]:
    """A PostgreSQL database of this test module, migrated as `refill db upgrade` does (its
    views too): the CLI refuses a ledger whose schema Alembic did not make."""
    from refill.models.migrate import upgrade

    with temporary_pg_database("refill_migrated") as url:
        upgrade(url)
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
