"""Scenario 1 of issue 20: the ledger's own PostgreSQL restarts mid-run (a failover, a
minor-version upgrade). It is stopped with every connection dropped, stays down for longer
than a generation lease, and starts again.

Every role reconnects on its own (the same worker processes, and the controller in this
process); the run completes with nothing lost and nothing trained twice; and no lease is
judged expired because of the outage itself: nobody could renew one while the database was
down, so the reaper gives each holder a whole lease after its return (models/leases.py).
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError

from refill.models.tables import Attempt
from refill.tasks.outage import RETRY_SECONDS, PatientLedger, is_outage
from tests.support.chaos_fleet import (
    FAULT_RUN,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
    restart_postgres,
    weight_version_at_least,
)
from tests.support.fleet import merged
from tests.support.services import HOST, free_port

pytestmark = pytest.mark.faults

LEASE_SECONDS = 3
DOWN_SECONDS = 6  # longer than a lease, and than the unit of work's own retries at first


def test_restart_postgresql_mid_run(fleet, fault_ledger) -> None:
    run_id = fleet.create_run(
        fault_ledger,
        merged(FAULT_RUN, {
            "grpo": {"max_num_steps": 6},
            "generation": {
                "lease_seconds": LEASE_SECONDS,
                # Attempts are in flight on every worker when the database goes away.
                "sim": {"latency": {"distribution": "constant", "mean_seconds": 0.3}},
            },
        }),
    )
    pids = {name: process.pid for name, process in fleet.workers.items()}
    logs_before = {name: len(fleet.log(name)) for name in pids}

    def restart() -> float:
        return restart_postgres(DOWN_SECONDS)

    result = drive_with_fault(fleet, fault_ledger, run_id, when=weight_version_at_least(run_id, 2), fault=restart)
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        errors = list(session.scalars(select(Attempt.error).where(Attempt.run_id == run_id, Attempt.failure_kind == "infra")))
    waited = {name: "the ledger's database is back" in fleet.log(name)[logs_before[name]:] for name in pids}
    print(facts.line(
        "restart-postgresql", result.seconds, down_seconds=round(result.injected, 1), lease_seconds=LEASE_SECONDS,
        roles_that_waited=sum(waited.values()),
    ))
    assert_nothing_lost(facts, steps=6)
    assert result.injected >= DOWN_SECONDS > LEASE_SECONDS
    # No lease was judged on the outage: every attempt in flight was recorded from its result.
    assert facts.reaped_running == 0 and facts.reaped_queued == 0, errors
    # The same processes carried on: they waited for the database rather than died.
    assert all(fleet.alive(name) for name in pids), {name: fleet.alive(name) for name in pids}


def test_a_fleet_process_waits_for_an_unreachable_database() -> None:
    """A fleet process's transaction keeps trying while nothing answers on the database's
    port (an outage), for as long as its patience; a conflict is no outage to wait out."""
    ledger = PatientLedger(f"postgresql+psycopg://postgres@{HOST}:{free_port()}/refill")
    ledger.patience_seconds = 1.5
    started = time.monotonic()
    try:
        with pytest.raises(OperationalError) as refused:
            ledger.transaction(lambda s: s.execute(text("SELECT 1")), attempts=1)
    finally:
        ledger.dispose()
    assert time.monotonic() - started >= 1.5
    assert is_outage(refused.value)
    assert not is_outage(ValueError("not a database error"))


def test_a_fleet_process_tries_again_at_least_every_half_second(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """While the database is unreachable, a fleet process's transaction pauses at most
    RETRY_SECONDS between tries, from the first failure on. A lease is judged a whole lease after
    the database's return (models/leases.py), so a live worker must renew it sooner: in the unit
    of work's own backoff the pauses grew to 4 s, and a worker asleep in one when PostgreSQL came
    back lost its 3 s leases (test_restart_postgresql_mid_run, once in a CI run)."""
    pauses: list[float] = []
    sleep, caller = time.sleep, threading.get_ident()

    def recorded(seconds: float) -> None:
        if threading.get_ident() == caller:
            pauses.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    ledger = PatientLedger(f"postgresql+psycopg://postgres@{HOST}:{free_port()}/refill")
    ledger.patience_seconds = 3.0
    try:
        with pytest.raises(OperationalError):
            ledger.transaction(lambda s: s.execute(text("SELECT 1")))
    finally:
        ledger.dispose()
    assert len(pauses) >= 7  # the unit of work's tries, then the patient ones
    assert max(pauses) <= RETRY_SECONDS, pauses
