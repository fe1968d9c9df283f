"""Issue 15: pre-rollout skipping survives a controller killed by SIGKILL and a resume.

The run cycles a small data set with `data.prompt_skipping` on, so the loader skips prompts
from its second epoch on, in admissions and spare-pool draws that die with the controller or
are redone after the resume. `refill check` then proves what the ledger says: each place of
each epoch drawn once and in order, each recorded decision replays from its seeded uniform
and its probability (so a redone draw decided what the lost one would have), and every prompt
the loader took is in a slot or the spare pool: none lost from its epoch.
"""

from __future__ import annotations

import re
import time

import pytest
from sqlalchemy import func, select

from refill.models.tables import PromptDraw, Run
from tests.support.chaos_fleet import FAULT_RUN, assert_nothing_lost, fault_facts, wait_for
from tests.support.fleet import merged

pytestmark = pytest.mark.faults


def test_sigkill_the_controller_of_a_skipping_run_then_resume(fleet, fault_ledger) -> None:
    config = fleet.write_config(
        merged(FAULT_RUN, {
            "data": {"builtin": "arith", "builtin_size": 48, "prompt_skipping": {"enabled": True}},
            "grpo": {"max_num_steps": 8},
            # Failures are retried after a back-off, which only a controller's relay sends: the
            # run waits for the resume (as test_crashes' controller scenario).
            "generation": {"sim": {"failure_rate": 0.1, "zero_variance_fraction": 0.6}},
            "async_rl": {"over_dispatch": {"enabled": False}},
        }),
        name="skipping-controller-kill",
    )
    started = time.monotonic()
    # A log of its own: `controller`'s is appended to by test_crashes' scenario, and the first
    # "run N created" there is that run, not this one.
    controller = fleet.spawn_cli("skipping-controller", "run", "start", str(config), "--quiet")
    try:
        found = wait_for(
            lambda: re.search(r"run (\d+) created", fleet.log("skipping-controller")), 90, "run created"
        )
        run_id = int(found.group(1))
        wait_for(
            lambda: fault_ledger.transaction(lambda s: s.get(Run, run_id).loader_epoch) >= 2, 90, "a second epoch"
        )
    finally:
        controller.kill()
        controller.wait(30)
    time.sleep(2.0)
    resumed = fleet.cli("run", "resume", str(run_id), "--force", "--quiet", timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        skipped = session.scalar(
            select(func.count()).where(PromptDraw.run_id == run_id, PromptDraw.skipped.is_(True))
        )
    print(facts.line("sigkill-controller-skipping", time.monotonic() - started, skipped=skipped))
    assert_nothing_lost(facts, steps=8)  # refill check included: its prompt_draws check
    assert skipped
