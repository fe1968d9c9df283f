"""Detached runs end to end: `refill run start --detach` hands a run to a real `refill worker
control`, which drives it to completion; a detached run stopped before any control worker
took it stays stopped when one does, until `refill run resume --detach`."""

from __future__ import annotations

import subprocess
import sys
import time

from refill.models.tables import Run
from tests.acceptance.runs import assert_healthy_dynamic_sampling_run, run_facts
from tests.support.fleet import Fleet

STEPS = 6


def refill(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "refill.admin.cli", *args],
        env=fleet.env, cwd=fleet.workdir, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def start_detached(fleet: Fleet, name: str) -> int:
    config = fleet.write_config({"grpo": {"max_num_steps": STEPS}}, name=name)
    done = refill(fleet, "run", "start", str(config), "--detach")
    # "run N handed to the control workers (...)"
    return int(done.stdout.split("run ", 1)[1].split()[0])


def status_of(ledger, run_id: int) -> str:  # type: ignore[no-untyped-def]
    with ledger.session() as session:
        return session.get(Run, run_id).status


def wait_for(ledger, run_id: int, wanted: set[str], fleet: Fleet, timeout: float = 180) -> str:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (status := status_of(ledger, run_id)) not in wanted:
        assert time.monotonic() < deadline, f"run {run_id} still {status}\n{fleet.tail_logs()}"
        time.sleep(0.2)
    return status


def assert_completes_healthy(fleet: Fleet, ledger, run_id: int) -> None:  # type: ignore[no-untyped-def]
    assert wait_for(ledger, run_id, {"completed", "failed"}, fleet) == "completed"
    with ledger.session() as session:
        facts = run_facts(session, run_id)
    assert_healthy_dynamic_sampling_run(facts, steps=STEPS, n_prompts=16, lookahead=1)


def test_a_detached_run_is_driven_by_the_control_workers(running_fleet, fleet_ledger) -> None:
    running_fleet.start("control", name="control-a")
    try:
        run_id = start_detached(running_fleet, "detached")
        assert_completes_healthy(running_fleet, fleet_ledger, run_id)
    finally:
        running_fleet.kill("control-a", sig=15)
    assert "drive_run" in running_fleet.log("control-a")


def test_a_detached_run_stopped_before_a_control_worker_took_it_stays_stopped(running_fleet, fleet_ledger) -> None:
    """The queued first slice started it anyway before: starting a run clears its stop request,
    and `refill run stop` had said "nothing to stop"."""
    run_id = start_detached(running_fleet, "stopped-early")  # no control worker yet: it waits
    assert status_of(fleet_ledger, run_id) == "created"
    stopped = refill(running_fleet, "run", "stop", str(run_id))
    assert "had not started; it is stopped" in stopped.stderr
    running_fleet.start("control", name="control-b")
    try:
        deadline = time.monotonic() + 60
        while "does not drive it" not in running_fleet.log("control-b"):
            assert time.monotonic() < deadline, running_fleet.log("control-b")[-3000:]
            time.sleep(0.2)
        assert "sent to start it, not to resume it" in running_fleet.log("control-b")
        assert status_of(fleet_ledger, run_id) == "stopped"
        refill(running_fleet, "run", "resume", str(run_id), "--detach")
        assert_completes_healthy(running_fleet, fleet_ledger, run_id)
    finally:
        running_fleet.kill("control-b", sig=15)
