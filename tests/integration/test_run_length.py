"""No statement of a step's cycle grows with the length of the run.

Two runs play the same moves (admission, the relay, leases and their expiry, results with
filtered, borrowed and failed groups, over-dispatch, pre-rollout skipping across epochs,
release, the trainer's claim and its end, a controller's restart, and the reads that watch a
run: its progress, `refill tail`'s metrics, the exporter's): a few steps, whose rows are then copied as the
history of a long run under steps and ids of their own (300 copies for the first run, 3,000 for
the second), then two more steps. PostgreSQL's `auto_explain` reports every statement the
ledger runs in those two steps with the rows its scans looked at: a read that walks the run's
history looks at about ten times more beside 3,000 copies than beside 300, one served by its
indexes at the same rows. The moves depend only on each run's own
ids, so both runs send the same statements with the same numbers of rows. Two reads
that walked the history were found so (a step's release scanning every attempt for its first attempts; the loader
reading every scored attempt of each prompt), and one plan that walked the trained steps
(`sql._step_is_open`); this keeps the rest honest.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from refill.models.tables import Attempt, AttemptState
from tests.support.long_run import Recorder, mean, played_beside

#: Copies of the template beside the first run and beside the second: a read that walks the
#: history looks at about ten times more beside the second.
SHORT, LONG = 300, 3000
#: Rows a statement's scans may look at beside the long history, against the short one. Both
#: runs play alike on tables that hold only their own rows, so a statement served by its indexes
#: looks at the same rows beside either whatever its plan, give or take the plan: the statistics
#: differ with the history's size, and a slot's live attempts are read through the partial
#: index of the step's live attempts or through the slots' index (run, step, slot), which also
#: passes the finished attempts of those slots in that step: 83 against 150 rows in CI once, 62
#: against 170 twice at stop 41 (2.7 times; neither index reaches another step, so neither walks
#: the history). A read of the history looks at about ten times more beside 3,000 copies than
#: beside 300. Room for the plans, none for the history.
GROWTH, SLACK = 4, 10


# `in_order` places an extra's group in the slots waiting on a replacement; the others in any
# open slot, which a batch reads otherwise.
@pytest.mark.parametrize("sampler", ["in_order", "ready_first"])
def test_no_statement_of_a_step_touches_more_of_a_long_runs_history(pg_ledger_truncated_after, sampler) -> None:  # type: ignore[no-untyped-def]
    pg_ledger = pg_ledger_truncated_after
    recorder = Recorder(pg_ledger)
    _, short = played_beside(pg_ledger, recorder, SHORT, sampler)
    d, long = played_beside(pg_ledger, recorder, LONG, sampler)
    assert len(long) > 40, "auto_explain reported too few statements: is it loaded?"
    assert {shape: len(b) for shape, b in short.items()} == {shape: len(b) for shape, b in long.items()}, "the two runs did not play alike"
    failures = d.query(
        lambda s: dict(
            s.execute(
                select(Attempt.error, func.count())
                .where(Attempt.run_id == d.run_id, Attempt.id < 1_000_000, Attempt.state == AttemptState.FAILED.value)
                .group_by(Attempt.error)
            ).all()
        )
    )
    assert failures.get("engine crashed") and any("lease" in (error or "") for error in failures), failures
    grown = {
        f"{statement[:80]} ... {statement[-400:]}": (mean(short[statement]), mean(rows))
        for statement, rows in long.items()
        if mean(rows) > GROWTH * mean(short[statement]) + SLACK
    }
    assert not grown, f"statements that touch more of the run's history as it grows (rows looked at beside {SHORT} copies, {LONG}): {grown}"
