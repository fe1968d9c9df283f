"""The trainer's lease is taken and renewed on the database's clock, as every other lease is: a
trainer whose own clock runs minutes fast neither keeps its step past the lease nor loses it
early (SPEC §8; the fault suite's clock scenario covers the generation side)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from refill.models.clock import set_clock_offset
from refill.models.tables import Step
from refill.models.training import claim_training, extend_training_lease
from tests.support.driver import Driver


@pytest.fixture
def fast_clock() -> Iterator[None]:
    set_clock_offset(300.0)
    yield
    set_clock_offset(0.0)


def test_the_trainers_lease_runs_on_the_databases_clock(pg_ledger, fast_clock) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger, {"infra": {"trainer_lease_seconds": 30}})
    d.admit()
    d.fill_step(0)
    assert d.ledger.transaction(lambda s: claim_training(s, d.run_id, 0, "t1")) is not None

    def lease_left(s) -> timedelta:  # type: ignore[no-untyped-def]
        until = s.scalar(select(Step.trainer_lease_until).where(Step.run_id == d.run_id, Step.step == 0))
        return until - s.scalar(select(func.now()))

    claimed = d.ledger.transaction(lease_left)
    assert timedelta(seconds=25) < claimed <= timedelta(seconds=30), claimed
    assert d.ledger.transaction(lambda s: extend_training_lease(s, d.run_id, 0, "t1", 30.0))
    renewed = d.ledger.transaction(lease_left)
    assert timedelta(seconds=25) < renewed <= timedelta(seconds=30), renewed
