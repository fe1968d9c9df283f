"""The fault suite's fixtures: one PostgreSQL ledger and one fleet of real worker processes,
shared by every scenario of tests/faults. A scenario that kills a role leaves it dead; the
`fleet` fixture brings the fleet back to its standard shape before the next scenario."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refill.models.db import Ledger
from refill.models.migrate import upgrade
from tests.support.chaos_fleet import VISIBILITY_TIMEOUT_SECONDS, ChaosFleet
from tests.support.databases import temporary_pg_database
from tests.support.fleet import purge_prefix

#: The standard fleet: two generation workers (so one can die while the other carries on),
#: one results consumer, one trainer.
SHAPE = {"generate": 2, "consume": 1, "train": 1}


@pytest.fixture(scope="package")
def faults_db() -> Iterator[str]:
    with temporary_pg_database("refill_faults") as url:
        upgrade(url)
        yield url


@pytest.fixture(scope="package")
def chaos_fleet(faults_db: str, tmp_path_factory) -> Iterator[ChaosFleet]:
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
        purge_prefix(f.prefix)


@pytest.fixture
def fleet(chaos_fleet: ChaosFleet) -> ChaosFleet:
    chaos_fleet.ensure(SHAPE)
    return chaos_fleet


@pytest.fixture
def fault_ledger(faults_db: str) -> Iterator[Ledger]:
    ledger = Ledger(faults_db)
    yield ledger
    ledger.dispose()
