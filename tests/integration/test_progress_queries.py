"""The ledger's read side for progress: what `refill tail` polls."""

from __future__ import annotations

from refill.admin import progress_queries
from refill.admin.progress_queries import run_progress, step_metrics
from tests.support.driver import Driver
from tests.support.play import play


def test_a_poll_reads_the_newest_steps_metrics_in_step_order(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_steps": 5}})
    play(d)
    with ledger.session() as session:
        every = step_metrics(session, d.run_id)
        newest = step_metrics(session, d.run_id, last=2)
        beyond = step_metrics(session, d.run_id, last=50)
    assert [row["step"] for row in every] == [0, 1, 2, 3, 4]
    assert newest == every[-2:]
    assert beyond == every


def test_progress_counts_the_trained_steps_as_admitted_less_unfinished(ledger) -> None:  # type: ignore[no-untyped-def]
    """`run_progress` counts the trained steps without walking them: the steps admitted less
    those not trained yet, the same number as counting them, at every point of a run."""
    d = Driver(ledger, {"grpo": {"max_num_steps": 4}})
    seen = []

    def counted() -> None:
        with ledger.session() as session:
            progress = run_progress(session, d.run_id)
        steps = d.steps()
        assert progress.trained_steps == sum(s.status == "trained" for s in steps)
        assert [s.step for s in progress.open_steps] == [s.step for s in steps if s.status != "trained"]
        seen.append(progress.trained_steps)

    play(d, after=lambda _: counted())
    assert seen[0] == 0 and seen[-1] == 4 and sorted(seen) == seen


def test_a_progress_snapshot_carries_the_newest_trained_steps_metrics(ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What `refill run start` prints a line for each step from: the newest trained steps'
    metrics in step order (RECENT_STEPS of them), not the newest step's alone."""
    d = Driver(ledger, {"grpo": {"max_num_steps": 5}})
    play(d)
    with ledger.session() as session:
        every = run_progress(session, d.run_id)
        monkeypatch.setattr(progress_queries, "RECENT_STEPS", 3)
        newest = run_progress(session, d.run_id)
    assert [m["step"] for m in every.recent_metrics] == [0, 1, 2, 3, 4]
    assert [m["step"] for m in newest.recent_metrics] == [2, 3, 4]
    assert newest.recent_metrics and newest.recent_metrics[-1]["step"] == 4
    assert every.recent_metrics[-1] == newest.recent_metrics[-1]
