"""The per-batch reads that would otherwise grow with the length of a run are served by their
indexes. Asserted on PostgreSQL's plans, with statistics taken (a plan, unlike a time, does
not vary from run to run)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.dialects import postgresql

from refill.models import sql
from refill.models.tables import Step, StepStatus
from tests.support.driver import Driver


def _plan(session, statement) -> str:  # type: ignore[no-untyped-def]
    sql = str(statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    return "\n".join(row[0] for row in session.execute(text("EXPLAIN " + sql)))


class Looked(Exception):
    """Carries what a transaction saw out of it, rolling back the rows it made up."""


def test_a_long_runs_unfinished_steps_are_read_without_its_trained_ones(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger)
    d.admit()

    def look(session):  # type: ignore[no-untyped-def]
        # A run 5,000 steps in: its trained steps (numbered below its real ones, which stay as
        # they are; made up, and rolled back with the transaction) and a few open ones, as the
        # primary key alone would have to walk.
        session.execute(
            text(
                "INSERT INTO steps (run_id, step, status, num_slots, committed, shrunk, dropped_shrunk, admitted_at, train_claims) "
                "SELECT :run, -g, 'trained', 1, 1, 0, 0, now(), 1 FROM generate_series(1, 5000) g"
            ),
            {"run": d.run_id},
        )
        session.execute(text("ANALYZE steps"))
        unfinished = sql.unfinished_steps(d.run_id)  # what a batch reads
        earliest_open = select(func.min(Step.step)).where(Step.run_id == d.run_id, Step.status == StepStatus.OPEN.value)
        raise Looked(_plan(session, unfinished), _plan(session, earliest_open), [row.step for row in session.execute(unfinished)])

    with pytest.raises(Looked) as looked:
        pg_ledger.transaction(look)
    unfinished_plan, earliest_plan, steps = looked.value.args
    assert steps and all(step >= 0 for step in steps)
    assert "ix_steps_unfinished" in unfinished_plan, unfinished_plan
    assert "ix_steps_unfinished" in earliest_plan, earliest_plan
