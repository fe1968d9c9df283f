"""The ledger's read side for progress: what `refill tail` polls."""

from __future__ import annotations

from refill.admin.progress_queries import step_metrics
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
