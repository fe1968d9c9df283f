"""No statement of a step's cycle does more than its share of work as the steps grow.

A run's statements either serve a batch (a few dozen results, whatever the step's size) or a
step (admission, its release and metrics, the trainer's claim, a restart's repair), and a
step's statement may do work in proportion to the step's rows: four times the step, at most
about four times the work. One that does more is quadratic somewhere, which a test with small
steps passes and a real step of thousands of slots pays for.

Two runs play the same moves in proportion (`tests/support/long_run.py`: over-dispatch,
filtered, borrowed and failed groups, crashes, expiring leases, a controller's restart, the
watching reads), one of 16 prompts a step and one of 64 (each move starting four times the
attempts), each beside a copied history of 300 copies of its first steps. PostgreSQL's
`auto_explain` reports what each statement's plan did, counted as the rows its nodes handled
(joins too: `long_run.handled`), and a statement that handles more than `SIZE * GROWTH` times
as many rows an execution in the larger run (plus `SLACK`) fails. It found a restart's repair
of the open slots walking the step's live attempts once for each open slot
(`runs.repair_open_slots`), and the relay's read of its attempts' prompts scanning the whole
data set for each attempt where the ledger held a few hundred prompts (so the ledger here holds
other runs' data sets: `long_run.LEDGER_PROMPTS`).

What it cannot see: a plan PostgreSQL picks only at larger sizes. Stop 38's first form of the
first-attempt reward handled its rows linearly here and took 11.9 s at the release of a
4096-slot step; `test_a_large_steps_statements_handle_rows_in_proportion` below plays such a
step.
"""

from __future__ import annotations

import pytest

from refill.models.leases import start_attempts
from refill.models.tables import StepStatus
from tests.support.driver import FLAT, SPREAD, Driver
from tests.support.invariants import assert_ledger_consistent
from tests.support.long_run import Recorder, handled, mean, played_beside, shape_any_length, watch

#: The larger run's steps, against the smaller's.
SMALL, SIZE = 16, 4
#: Copies of each run's template as its history: as many steps beside either (of their sizes).
COPIES = 300
#: Rows a statement's plan may handle in the larger run, against the smaller, beyond `SIZE`
#: times as many: the moves of the two runs are alike, not the same (more of the larger's
#: batches come mid-step), and a plan may change with the statistics. A product of the step's
#: rows with themselves is `SIZE` times more again.
GROWTH, SLACK = 1.75, 50


@pytest.mark.parametrize("sampler", ["in_order", "ready_first"])
def test_no_statement_of_a_step_does_more_than_linear_work_in_its_size(pg_ledger_truncated_after, sampler) -> None:  # type: ignore[no-untyped-def]
    pg_ledger = pg_ledger_truncated_after
    recorder = Recorder(pg_ledger, measure=handled, key=shape_any_length)
    _, small = played_beside(pg_ledger, recorder, COPIES, sampler, prompts_per_step=SMALL)
    d, large = played_beside(pg_ledger, recorder, COPIES, sampler, prompts_per_step=SMALL * SIZE)
    assert d.step(0).num_slots == SMALL * SIZE
    both = small.keys() & large.keys()
    assert len(both) > 40, f"auto_explain reported too few statements of both runs ({len(both)}): is it loaded?"
    # The step's own statements are among those compared: the ones this test is for.
    assert any("avg(" in statement and "origin_slot" in statement for statement in both), "a step's release (its first-attempt reward) was not recorded in both runs"
    ratios = {statement: mean(large[statement]) / max(1.0, mean(small[statement])) for statement in both}
    grown = {
        f"{statement[:80]} ... {statement[-300:]}": (mean(small[statement]), mean(large[statement]))
        for statement in both
        if mean(large[statement]) > SIZE * GROWTH * mean(small[statement]) + SLACK
    }
    assert not grown, (
        f"statements whose work grows faster than the step ({SIZE} times the slots; rows their plans handled,"
        f" {SMALL} slots a step and {SMALL * SIZE}): {grown}; the largest ratios: {sorted(ratios.values())[-5:]}"
    )


#: The slots of a step as large as the benchmark's (`bench overhead`).
LARGE = 4096
#: Rows any one statement's plan may handle, per slot of the step: a step's own statements read
#: its slots, attempts and spare prompts a few times over; a plan that pairs each slot with the
#: step's attempts handles thousands per slot.
PER_SLOT = 16


def test_a_large_steps_statements_handle_rows_in_proportion(pg_ledger_truncated_after) -> None:  # type: ignore[no-untyped-def]
    """One step of 4096 slots played through: admission, the relay, leases in bundles, results
    in batches of 64 with a third of the groups filtered, a quarter of the way in every running
    lease expiring at once (the reaper retries them), halfway a stop and a resume (every open
    slot repaired), the reads that watch a run, the release and its metrics, the trainer's
    claim. No statement's plan handles more than `PER_SLOT` rows a slot, and the run is whole
    (`refill check`'s invariants). The plans PostgreSQL picks for a step this size are its
    own: stop 38's first form of the first-attempt reward handled the step's rows linearly at
    64 slots and 39.9 million rows here (11.9 s in `bench overhead`)."""
    pg_ledger = pg_ledger_truncated_after
    recorder = Recorder(pg_ledger, measure=handled, key=shape_any_length)
    config = {"grpo": {"num_prompts_per_step": LARGE, "max_num_steps": 1}, "async_rl": {"over_dispatch": {"enabled": True}}}
    d = Driver(pg_ledger, config, num_prompts=2 * LARGE, check=False)  # checked below, before the fixture empties the tables
    moves: list[str] = []
    with recorder.recording() as rows:
        recorder.on = True
        assert d.admit() == [0]
        for _ in range(400):
            sent = [m.body["attempt_id"] for m in d.relay() if m.kind == "generate"]
            for first in range(0, len(sent), 64):
                batch = sent[first : first + 64]
                for bundle in range(0, len(batch), 8):
                    d.ledger.transaction(
                        lambda s, ids=batch[bundle : bundle + 8]: start_attempts(s, d.run_id, ids, d.worker, 60.0, d.now, 0)
                    )
                if "expired" not in moves and d.step(0).committed >= LARGE // 4:
                    continue  # started, never finished: their leases expire below
                d.record(*(d.result(a, FLAT if a % 3 == 0 else SPREAD, 0) for a in batch))
            committed = d.step(0).committed
            if "expired" not in moves and committed >= LARGE // 4:
                d.tick(120)
                assert d.reap().attempts, "no lease expired"
                moves.append("expired")
            elif "restarted" not in moves and committed >= LARGE // 2:
                d.stop()
                d.resume()  # every open slot lost its attempt: the resume repairs them all
                moves.append("restarted")
            watch(d)
            if d.step(0).status == StepStatus.RELEASED.value:
                break
        assert moves == ["expired", "restarted"] and d.step(0).status == StepStatus.RELEASED.value, moves
        assert d.train(0)
    assert any("avg(" in statement and "origin_slot" in statement for statement in rows), "the release's metrics were not recorded"
    heaviest = sorted(((max(work), statement) for statement, work in rows.items()), reverse=True)
    over = [(work, statement[:300]) for work, statement in heaviest if work > PER_SLOT * LARGE]
    assert not over, f"statements whose plans handled more than {PER_SLOT} rows a slot of a {LARGE}-slot step: {over}"
    with pg_ledger.session() as session:
        assert_ledger_consistent(session, d.run_id)
