"""`refill worker train --nproc 2` on the fleet: a trainer of two ranks (FSDP2 over gloo, on
the CPU) trains the tiny model on groups from `sim` generation workers, through Redis and
PostgreSQL like any trainer worker; each trained step's figures and the last weight version
are those of a one-process trainer replaying the very groups the ledger says each step
trained."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file
from sqlalchemy import select

from refill.config import RunConfig
from refill.models.payload import TrainGroup
from refill.models.rollout_codec import decode, unpack_payload
from refill.models.tables import Group, Run, Slot, StepMetrics
from refill.trainer.grpo import GRPOTrainer
from refill.trainer.weights import weights_dir
from tests.acceptance.runs import run_facts
from tests.support.fleet import Fleet, fleet

STEPS = 3
RANKED_RUN = {
    "model": {"name_or_path": "builtin:tiny-arith"},
    "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": STEPS},
    # Adam made linear (eps above the gradients' scale), so that the ranks' float noise stays
    # noise in the weights; two updates per step.
    "optimizer": {"lr": 0.05, "eps": 1.0, "groups_per_update": 2, "micro_batch_tokens": 64},
    "infra": {"trainer": "torch", "trainer_lease_seconds": 120},
}


def start_ranked_trainer(f: Fleet, name: str, nproc: int, timeout: float = 120) -> subprocess.Popen[bytes]:
    """`refill worker train --nproc N` as one of the fleet's workers."""
    log = f.workdir / f"worker-{name}.log"
    argv = [sys.executable, "-m", "refill.admin.cli", "worker", "train", "--nproc", str(nproc),
            "--hostname", f"{name}@test", "--loglevel", "INFO"]
    with log.open("ab") as handle:
        process = subprocess.Popen(
            argv, env={**f.env, "REFILL_WORKER_NAME": name}, stdout=handle, stderr=subprocess.STDOUT, cwd=f.workdir
        )
    f.workers[name], f.logs[name] = process, log
    f.wait_ready(name, timeout)
    return process


@pytest.fixture(scope="module")
def ranked_fleet(fleet_db: str, tmp_path_factory) -> Iterator[Fleet]:
    with fleet(fleet_db, tmp_path_factory.mktemp("ranked-fleet"), roles=("generate", "consume")) as f:
        start_ranked_trainer(f, "train-ranks", 2)
        yield f


def step_groups(session, run_id: int, step: int, run_dir: str) -> list[TrainGroup]:
    """The groups step `step` trained, in slot order, as the trainer read them."""
    rows = session.execute(
        select(Group.attempt_id, Group.rollout, Group.completion_texts, Group.rewards, Group.weight_version, Group.payload_ref)
        .join(Slot, Slot.group_attempt_id == Group.attempt_id)
        .where(Slot.run_id == run_id, Slot.step == step, Slot.status == "committed")
        .order_by(Slot.idx)
    ).all()
    groups = []
    for row in rows:
        if row.payload_ref is None:
            prompt, completions = decode(row.rollout, row.completion_texts)
        else:
            prompt, completions = unpack_payload(Path(run_dir, "payloads", row.payload_ref).read_bytes())
        groups.append(TrainGroup(row.attempt_id, prompt, completions, list(row.rewards), row.weight_version))
    return groups


@pytest.mark.slow
def test_two_ranks_on_the_fleet_train_as_one_process(ranked_fleet: Fleet, fleet_ledger, tmp_path) -> None:
    run_id = ranked_fleet.create_run(fleet_ledger, RANKED_RUN)
    assert ranked_fleet.drive(fleet_ledger, run_id, timeout=300) == "completed", ranked_fleet.tail_logs()
    with fleet_ledger.session() as session:
        facts = run_facts(session, run_id)
        run = session.get(Run, run_id)
        config, run_dir = RunConfig.model_validate(run.config), run.run_dir
        batches = [step_groups(session, run_id, step, run_dir) for step in range(STEPS)]
        stored = {m.step: m for m in session.scalars(select(StepMetrics).where(StepMetrics.run_id == run_id))}
    assert facts.status == "completed" and facts.violations == []
    assert facts.trained_per_step == [4] * STEPS
    log = ranked_fleet.log("train-ranks")
    assert "trainer rank 1 of 2 is pid" in log

    replay = GRPOTrainer(config, tmp_path / "replay")
    replay.restore(0)
    for step, groups in enumerate(batches):
        want = replay.train_step(step, groups)
        got = stored[step]
        extra = got.extra or {}
        assert extra["ranks"] == 2.0
        assert all(extra[f"rank{r}_step_seconds"] > 0 and extra[f"rank{r}_peak_memory_bytes"] > 0 for r in (0, 1))
        assert extra["tokens"] == want["tokens"] and extra["updates"] == want["updates"] == 2
        assert got.loss == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got.grad_norm == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got.entropy == pytest.approx(want["entropy"], rel=1e-5)
        for key in ("clip_fraction_lower", "clip_fraction_upper", "ratio_mean", "importance_weight_mean"):
            assert extra[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    published = load_file(str(weights_dir(run_dir, STEPS) / "model.safetensors"))
    mine = replay.model.state_dict()
    worst = max((published[k] - mine[k]).abs().max().item() for k in published)
    assert worst < 1e-4, f"the two ranks' weights differ from one process's by up to {worst}"


def test_nproc_is_for_the_trainer_alone(ranked_fleet: Fleet) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "refill.admin.cli", "worker", "consume", "--nproc", "2"],
        env=ranked_fleet.env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0 and "--nproc is for the train role" in done.stderr + done.stdout


def test_the_ranks_stop_with_their_launcher(ranked_fleet: Fleet) -> None:
    # Kept last: it stops the module's trainer. A warm shutdown of rank 0 (SIGTERM to the
    # launcher) ends every rank and the launcher cleanly.
    import psutil

    process = ranked_fleet.workers.pop("train-ranks")
    ranks = psutil.Process(process.pid).children()
    assert len(ranks) == 2
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
