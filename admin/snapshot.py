"""The read side's common ground: one consistent snapshot of the ledger, the lookups that turn
an unknown run, step or slot into `NotFound`, and the small helpers every question uses.

Each question of the read side (`run_queries`, `slot_queries`, `budget_queries`,
`fleet_queries`, `progress_queries`) answers with plain data (dicts of JSON-able values,
datetimes aside) so that the CLI can print it as a table or as JSON. An unknown run, step or
slot is a `NotFound` (a LookupError) whose message is the one line the CLI prints. They read
the tables, never the views of migration 0002, so they also work on a ledger built with
`create_all`; the views answer the same questions in SQL (docs/sql.md) and the acceptance
tests hold the two to the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from refill.models.db import Ledger
from refill.models.tables import AttemptState, Run, RunStatus, Slot, Step

LIVE_STATES = tuple(s.value for s in AttemptState.live())
FINISHED_RUN_STATES = (RunStatus.COMPLETED.value, RunStatus.FAILED.value, RunStatus.STOPPED.value)


@contextmanager
def read_snapshot(ledger: Ledger) -> Iterator[Session]:
    """A read-only session on one snapshot of the ledger (REPEATABLE READ, READ ONLY on
    PostgreSQL; SQLite reads in one transaction anyway), so that the several queries of one
    answer agree with each other while a run is writing."""
    with ledger.engine.connect() as connection:
        if ledger.engine.dialect.name == "postgresql":
            connection = connection.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        with Session(bind=connection) as session:
            if ledger.engine.dialect.name == "postgresql":
                # A long answer may think between its queries for longer than the fleet's
                # transactions may sit idle (`models/db.py`); it holds no locks.
                session.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
            try:
                yield session
            finally:
                session.rollback()


class NotFound(LookupError):
    """No such run, step or slot; str() is a one-line message for people."""


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"there is no run {run_id}")
    return run


def get_step(session: Session, run_id: int, step: int) -> Step:
    get_run(session, run_id)
    row = session.get(Step, (run_id, step))
    if row is None:
        last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id))
        known = "it has no steps yet" if last is None else f"its steps are 0..{last}"
        raise NotFound(f"run {run_id} has no step {step} ({known})")
    return row


def get_slot(session: Session, run_id: int, step: int, idx: int) -> Slot:
    row = get_step(session, run_id, step)
    slot = session.get(Slot, (run_id, step, idx))
    if slot is None:
        raise NotFound(f"step {step} of run {run_id} has no slot {idx} (its slots are 0..{row.num_slots - 1})")
    return slot


def count_by(session: Session, column: Any, *where: Any) -> dict[str, int]:
    return {
        str(key): int(n)
        for key, n in session.execute(select(column, func.count()).where(*where).group_by(column)).all()
    }


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()
