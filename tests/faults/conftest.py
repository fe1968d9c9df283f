"""The fault suite's fixtures: its own Redis and PostgreSQL, one ledger and one fleet of real
worker processes, shared by every scenario of tests/faults. A scenario that kills a role leaves
it dead; the `fleet` fixture brings the fleet back to its standard shape before the next
scenario.

The suite flushes and restarts its Redis and restarts its PostgreSQL, so it gets servers of
its own (throwaway servers, on the ports chaos_fleet.FAULT_REDIS and FAULT_POSTGRES name),
whatever REFILL_TEST_REDIS_URL and REFILL_TEST_PG_URL say."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from refill.models.db import Ledger
from refill.models.migrate import upgrade
from tests.support.chaos_fleet import (
    FAULT_POSTGRES,
    FAULT_REDIS,
    VISIBILITY_TIMEOUT_SECONDS,
    ChaosFleet,
)
from tests.support.fleet import purge_prefix

#: The standard fleet: two generation workers (so one can die while the other carries on),
#: one results consumer, one trainer.
SHAPE = {"generate": 2, "consume": 1, "train": 1}


@pytest.fixture(scope="package", autouse=True)
def fault_redis(tmp_path_factory) -> Iterator[str]:
    with FAULT_REDIS.running(tmp_path_factory.mktemp("fault-redis")) as url:
        yield url


@pytest.fixture(scope="package")
def fault_postgres() -> Iterator[str]:
    # Not under pytest's basetemp: as root the server runs as another user, who cannot enter
    # a folder that only root may (pytest-of-root is 0700).
    workdir = Path(tempfile.mkdtemp(prefix="refill-fault-postgres-"))
    try:
        with FAULT_POSTGRES.running(workdir) as url:
            yield url
    finally:
        shutil.rmtree(workdir)


@pytest.fixture(scope="package")
def faults_db(fault_postgres: str) -> Iterator[str]:
    url = FAULT_POSTGRES.database("refill_faults")
    upgrade(url)
    yield url


@pytest.fixture(scope="package")
def chaos_fleet(faults_db: str, fault_redis: str, tmp_path_factory) -> Iterator[ChaosFleet]:
    f = ChaosFleet(
        faults_db,
        tmp_path_factory.mktemp("faults"),
        env={"REFILL_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT_SECONDS)},
    )
    try:
        f.ensure(SHAPE)
        yield f
    finally:
        f.shutdown()
        purge_prefix(f.prefix, f.redis_url)


@pytest.fixture
def fleet(chaos_fleet: ChaosFleet) -> ChaosFleet:
    chaos_fleet.ensure(SHAPE)
    return chaos_fleet


@pytest.fixture
def fault_ledger(faults_db: str) -> Iterator[Ledger]:
    ledger = Ledger(faults_db)
    yield ledger
    ledger.dispose()
