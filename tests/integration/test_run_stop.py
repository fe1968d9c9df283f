"""`refill run stop`: a run whose controller was seen within 30 s is asked to stop; otherwise the
command stops it itself. "Seen" is judged on the database's clock, which wrote
`runs.controller_seen_at`, so a skewed clock on the operator's machine changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.models.clock import set_clock_offset
from refill.models.db import Ledger
from tests.support.driver import Driver


@pytest.fixture
def migrated(migrated_url: str) -> Iterator[Ledger]:
    ledger = Ledger(migrated_url)
    yield ledger
    ledger.dispose()


@pytest.fixture
def skewed_clock() -> Iterator[None]:
    set_clock_offset(120.0)  # this process runs two minutes fast
    yield
    set_clock_offset(0.0)


def _seen(d: Driver, ago_seconds: int) -> None:
    d.ledger.transaction(
        lambda s: s.execute(
            text("UPDATE runs SET controller_seen_at = now() - make_interval(secs => :ago) WHERE id = :r"),
            {"ago": ago_seconds, "r": d.run_id},
        )
    )


def _stop(d: Driver) -> str:
    result = CliRunner().invoke(app, ["run", "stop", str(d.run_id), "--database-url", d.ledger.url])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_live_controller_is_asked_on_the_databases_clock(migrated, skewed_clock) -> None:  # type: ignore[no-untyped-def]
    d = Driver(migrated)
    d.admit()
    _seen(d, 5)
    assert "stop requested" in _stop(d)
    assert d.run().status == "running" and d.run().stop_requested


def test_a_run_without_a_live_controller_is_stopped_by_the_command(migrated, skewed_clock) -> None:  # type: ignore[no-untyped-def]
    d = Driver(migrated)
    d.admit()
    d.relay()
    _seen(d, 60)
    out = _stop(d)
    assert "stopped (no live controller)" in out
    assert d.run().status == "stopped"
    assert d.attempts(state="queued") == [] and d.attempts(state="cancelled")


def test_a_run_that_never_started_is_stopped_and_a_queued_detached_start_leaves_it(migrated) -> None:  # type: ignore[no-untyped-def]
    """`refill run stop` on a run made by `refill run start --detach` before any control worker
    took it said "nothing to stop", and the queued first slice then started it anyway (starting
    clears `stop_requested`). It is stopped now; that slice refuses it; resume starts it."""
    from refill.models.runs import RunStateError, start_run

    d = Driver(migrated, start=False)
    assert "had not started; it is stopped" in _stop(d)
    run = d.run()
    assert (run.status, run.end_reason, run.controller_id) == ("stopped", "stopped", None)
    with pytest.raises(RunStateError, match="this controller was sent to start it, not to resume it"):
        d.ledger.transaction(lambda s: start_run(s, d.run_id, "control:1#0", created_only=True, now=d.now))
    assert d.run().status == "stopped"
    run = d.resume("controller-2")
    assert (run.status, run.controller_id) == ("running", "controller-2")
    assert d.admit()  # it runs from its first step


def test_a_detached_start_delivered_again_keeps_the_run_it_started(migrated) -> None:  # type: ignore[no-untyped-def]
    """The first slice's message comes again when its control worker died mid-slice: the same
    controller takes the run back (after the takeover wait) rather than leaving it undriven;
    another controller sent to start it does not."""
    from refill.models.runs import RunStateError, start_run

    d = Driver(migrated, start=False)

    def start(controller: str):  # type: ignore[no-untyped-def]
        return d.ledger.transaction(lambda s: start_run(s, d.run_id, controller, created_only=True, now=d.now))

    assert start("control:1#0").status == "running"
    d.admit()
    d.tick(31)  # its worker died: no heartbeat for 30 s
    with pytest.raises(RunStateError, match="sent to start it, not to resume it"):
        start("control:2#0")
    assert start("control:1#0").controller_id == "control:1#0"


def test_resume_of_a_completed_run_is_refused_before_any_worker_starts(migrated) -> None:  # type: ignore[no-untyped-def]
    """It exited 1 ("checked and wrong"), where `refill gc` on a run that has not ended exits 2
    (bad input), and only after the embedded fleet (the run's config names no broker) had
    started its workers."""
    d = Driver(migrated, {"grpo": {"max_num_steps": 1}})
    d.admit()
    d.fill_step(0)
    assert d.train(0) and d.run().status == "completed"
    result = CliRunner().invoke(
        app, ["run", "resume", str(d.run_id), "--database-url", d.ledger.url], env={"REFILL_BROKER_URL": None}
    )
    assert result.exit_code == 2, result.output
    assert f"run {d.run_id} is completed (max_num_steps); start a new run instead" in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr  # that line alone: nothing started
