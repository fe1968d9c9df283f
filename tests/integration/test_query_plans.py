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
from tests.support.plans import run_explained


def _plan(session, statement, params=None) -> str:  # type: ignore[no-untyped-def]
    sql = str(statement.params(params or {}).compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
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
        raise Looked(_plan(session, *unfinished), _plan(session, earliest_open), [row.step for row in session.execute(*unfinished)])

    with pytest.raises(Looked) as looked:
        pg_ledger.transaction(look)
    unfinished_plan, earliest_plan, steps = looked.value.args
    assert steps and all(step >= 0 for step in steps)
    assert "ix_steps_unfinished" in unfinished_plan, unfinished_plan
    assert "ix_steps_unfinished" in earliest_plan, earliest_plan


def test_a_metered_relay_pass_reads_its_runs_first_rows_whatever_the_statistics_say(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """The controller's relay asks for its run's first due rows of a kind (as many generate
    rows as the run's queue has room for). With statistics from before a burst of 5,000
    waiting rows (the outbox analyzed while empty), it must still read about as many rows as
    it takes, not every waiting row of every run joined to its run and sorted (as through the
    index by `available_at` alone: about 10,000 buffers). Measured by the buffers it touches."""
    from sqlalchemy import event

    from refill.models.outbox import claim_outbox
    from refill.tasks.relay import DEFAULT_QUEUED_PER_SHARE

    d = Driver(pg_ledger)
    with pg_ledger.engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox"))
        conn.execute(text("ANALYZE outbox"))
        conn.execute(
            text(
                "INSERT INTO outbox (run_id, kind, payload, created_at, available_at, send_count) "
                "SELECT :run, 'generate', '{}', now(), now() - interval '1 second', 0 FROM generate_series(1, 5000)"
            ),
            {"run": d.run_id},
        )
    statements: list[tuple[str, dict]] = []  # type: ignore[type-arg]

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "FROM outbox" in statement and "FOR UPDATE" in statement:
            statements.append((statement, parameters))

    def relay_pass(session):  # type: ignore[no-untyped-def]
        now = session.execute(text("SELECT now()")).scalar_one()
        return claim_outbox(
            session, claimer="c", now=now, limit=1000, run_id=d.run_id, queued_per_share=DEFAULT_QUEUED_PER_SHARE,
            claim_seconds=None,
        )

    event.listen(pg_ledger.engine, "before_cursor_execute", record)
    try:
        claimed = pg_ledger.transaction(relay_pass)
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", record)
    # (Rows for no attempt: their messages are moot, marked sent without a message.)
    assert claimed == []
    # The pass asked for the run's train_step rows, then for its generate rows: the second,
    # explained as it runs (then rolled back).
    statement, parameters = statements[-1]
    rows, buffers = run_explained(pg_ledger, statement, parameters)
    assert rows == DEFAULT_QUEUED_PER_SHARE
    assert buffers < 2000, f"a relay pass touched {buffers} buffers for {DEFAULT_QUEUED_PER_SHARE} rows of 5,000"
