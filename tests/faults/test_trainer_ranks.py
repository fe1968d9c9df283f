"""Issue 22's fault: one rank of a trainer of two ranks (`refill worker train --nproc 2`) dies
by SIGKILL while the trainer holds a step. The launcher takes the trainer down (no rank is left
behind), the step's lease expires, and the next trainer, two ranks again, trains the step once,
resuming from the dead trainer's checkpoint; the run completes with nothing lost."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import select

from refill.models.tables import Step, StepStatus, WeightVersion
from tests.support.chaos_fleet import (
    FAULT_RUN,
    ChaosFleet,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
    wait_for,
)
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

STEPS = 5
RANKED_RUN = merged(
    FAULT_RUN,
    {
        "model": {"name_or_path": "builtin:tiny-arith"},
        "grpo": {"max_num_steps": STEPS, "num_prompts_per_step": 4, "num_generations_per_prompt": 4},
        "optimizer": {"groups_per_update": 2, "passes_per_step": 2},
        "infra": {"trainer": "torch", "trainer_lease_seconds": 3},
    },
)


def start_ranked_trainer(fleet: ChaosFleet, name: str) -> subprocess.Popen[bytes]:
    """`refill worker train --nproc 2` as one of the fleet's trainers (`ensure` replaces it by
    a plain trainer for the next scenario)."""
    log = fleet.workdir / f"worker-{name}.log"
    argv = [sys.executable, "-m", "refill.admin.cli", "worker", "train", "--nproc", "2",
            "--hostname", f"{name}@test", "--loglevel", "INFO"]
    with log.open("ab") as handle:
        process = subprocess.Popen(
            argv, env={**fleet.env, "REFILL_WORKER_NAME": name}, stdout=handle, stderr=subprocess.STDOUT, cwd=fleet.workdir
        )
    fleet.workers[name], fleet.logs[name], fleet.roles[name] = process, log, "train"
    fleet.special.add(name)
    fleet.wait_ready(name, 120)
    return process


def rank_pids(fleet: ChaosFleet, name: str) -> dict[int, int]:
    """Rank -> pid, as the launcher announced them."""
    return {int(r): int(p) for r, p in re.findall(r"trainer rank (\d+) of \d+ is pid (\d+)", fleet.log(name))}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too: only its parent's wait is left.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1].startswith("Z")


def held_by(session, run_id: int, trainer: str) -> int | None:
    return session.scalar(
        select(Step.step).where(
            Step.run_id == run_id, Step.status == StepStatus.TRAINING.value, Step.trainer_id == trainer
        )
    )


def test_sigkill_one_rank_of_a_two_rank_trainer(fleet: ChaosFleet, fault_ledger) -> None:
    for name in fleet.names("train"):
        fleet.stop(name)
    victim = fleet.fresh_name("train-ranks")
    launcher = start_ranked_trainer(fleet, victim)
    run_id = fleet.create_run(fault_ledger, RANKED_RUN)

    def training(session) -> bool:
        step = held_by(session, run_id, victim)
        return step is not None and step >= 1

    def kill() -> tuple[int, dict[int, int]]:
        pids = rank_pids(fleet, victim)
        # Rank 1 stopped first: rank 0 can then finish no order, so once it holds a step (it
        # claims the next one if it was between steps) it holds it until rank 1 is killed.
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(1.0)

        def stuck() -> tuple[int] | None:
            with fault_ledger.session() as session:
                step = held_by(session, run_id, victim)
            return None if step is None else (step,)

        (step,) = wait_for(stuck, 60, "the two-rank trainer holding a step")
        os.kill(pids[1], signal.SIGKILL)
        start_ranked_trainer(fleet, fleet.fresh_name("train-ranks"))
        return step, pids

    result = drive_with_fault(fleet, fault_ledger, run_id, when=training, fault=kill, timeout=300)
    step, pids = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        versions = session.execute(
            select(WeightVersion.version, WeightVersion.trained_step).where(WeightVersion.run_id == run_id).order_by(WeightVersion.version)
        ).all()
    print(facts.line("sigkill-one-rank-of-two", result.seconds, step=step, claims=facts.train_claims[step]))
    assert_nothing_lost(facts, steps=STEPS)
    # The dead trainer's claim, then the next trainer's, which trained it; every other step once.
    assert facts.train_claims[step] == 2, facts.train_claims
    assert all(claims == 1 for s, claims in facts.train_claims.items() if s != step)
    assert [v for v, _ in versions] == list(range(STEPS + 1))
    assert all(trained == v - 1 for v, trained in versions[1:])
    # The launcher took its trainer down: it exited, and left no rank behind.
    assert launcher.wait(30) != 0
    assert all(gone(pid) for pid in pids.values())
    # Whichever the launcher saw go first: rank 1 (killed), or rank 0 (which found its peer
    # gone in a collective and stopped, EXIT_RANK_FAILED).
    assert re.search(r"trainer rank (1 exited with status 137|0 exited with status 70); killing the other ranks", fleet.log(victim))
    # The next trainer resumed from the dead one's checkpoint of the step's version.
    successors = [n for n in fleet.special if n != victim]
    assert any(f"restoring trainer of run {run_id} to version {step}" in fleet.log(n) for n in successors)
