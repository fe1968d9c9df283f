"""Scenarios 7 and 8 of issue 6: the consumer's ledger connections are cut under it, and
every result arrives twice. Neither changes what the run trains."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from refill.models.tables import Attempt, RejectedResult, Run
from refill.tasks.chaos import DUPLICATE_RESULTS
from tests.support.chaos_fleet import (
    FAULT_RUN,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
    terminate_backends,
)

pytestmark = pytest.mark.faults


def test_pg_terminate_backend_on_the_consumer(fleet, fault_ledger) -> None:
    """7. Its connections die mid-run (some inside a transaction); it reconnects, the unit of
    work runs the batch again, and nothing is lost."""
    consumer = fleet.names("consume")[0]
    run_id = fleet.create_run(fault_ledger, FAULT_RUN)
    log_before = len(fleet.log(consumer))

    def halfway(session) -> bool:
        return session.scalar(select(Run.weight_version).where(Run.id == run_id)) >= 2

    def terminate() -> int:
        # Every 0.2 s for 3 s: idle pooled connections and ones inside a batch's transaction.
        killed, until = 0, time.monotonic() + 3
        while time.monotonic() < until:
            killed += terminate_backends(f"refill:{consumer}")
            time.sleep(0.2)
        return killed

    result = drive_with_fault(fleet, fault_ledger, run_id, when=halfway, fault=terminate)
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
    log = fleet.log(consumer)[log_before:]
    retried = log.count("record results failed")
    print(facts.line("pg-terminate-consumer", result.seconds, connections_terminated=result.injected, transactions_retried=retried))
    assert_nothing_lost(facts, steps=8)
    assert result.injected >= 1
    assert fleet.alive(consumer)


def test_every_result_delivered_twice(fleet, fault_ledger) -> None:
    """8. A generation worker sends each result twice: the second copy changes nothing and is
    recorded in rejected_results."""
    for name in fleet.names("generate"):
        fleet.stop(name)
    doubler = fleet.fresh_name("generate-twice")
    fleet.start("generate", name=doubler, env={DUPLICATE_RESULTS: "1"})
    run_id = fleet.create_run(fault_ledger, {**FAULT_RUN, "grpo": {"max_num_steps": 6}})
    started = time.monotonic()
    try:
        assert fleet.drive(fault_ledger, run_id) == "completed"
    finally:
        fleet.stop(doubler)
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        recorded = list(
            session.scalars(
                select(Attempt.id).where(
                    Attempt.run_id == run_id,
                    (Attempt.state.in_(["committed", "filtered"])) | (Attempt.failure_kind == "data"),
                )
            )
        )
        duplicates = dict(
            session.execute(
                select(RejectedResult.attempt_id, func.count())
                .where(RejectedResult.run_id == run_id, RejectedResult.reason == "duplicate")
                .group_by(RejectedResult.attempt_id)
            ).all()
        )
    print(facts.line("duplicate-results", time.monotonic() - started, results_recorded=len(recorded)))
    assert_nothing_lost(facts, steps=6)
    # Each result the ledger took came a second time, and that copy was refused.
    assert set(duplicates) == set(recorded)
    assert set(duplicates.values()) == {1}
    assert "REFILL_CHAOS_DUPLICATE_RESULTS=1 is set" in fleet.log(doubler)
