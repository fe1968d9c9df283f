"""A trainer of two ranks (FSDP2 over gloo, on the CPU) trains the same steps as a trainer of
one process: the same loss and metrics, the same weights (published and in memory), and a
resume from the two ranks' checkpoint is exact, on two ranks or on one.

The ranks are real processes started by the launcher `refill worker train --nproc` uses
(`refill.trainer.launch`); each runs `python -m tests.unit.trainer.test_distributed CASE`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from refill.config import RunConfig
from refill.trainer.grpo import GRPOTrainer
from refill.trainer.launch import RankGroup
from refill.trainer.weights import checkpoint_versions, weights_dir

from .conftest import make_groups

REPO = Path(__file__).resolve().parents[3]
#: The step-1 groups come from version 0 and 1 alike (max_lookahead_versions 1).
STEPS = 2


def _config(settings: RunConfig) -> RunConfig:
    """The fixture's tiny model, made to show any difference: mini-batches (2 updates per
    pass, 2 passes), micro-batches of a few sequences, importance correction, a KL term, the
ranks' activation checkpointing; and
    Adam made linear (eps above the gradients' scale, as in test_trainer_grpo's split test) so
    that float noise stays noise."""
    settings.optimizer.groups_per_update = 2
    settings.optimizer.passes_per_step = 2
    settings.optimizer.micro_batch_tokens = 24
    settings.optimizer.eps = 1.0
    settings.optimizer.lr = 0.1
    settings.optimizer.warmup_steps = 0
    settings.loss.use_importance_sampling_correction = True
    settings.loss.reference_policy_kl_penalty = 0.05
    # Recomputing the blocks' activations in the backward pass changes no number.
    settings.distributed.activation_checkpointing = True
    return settings


def step_groups(step: int) -> list[Any]:
    """Three groups; the third keeps one non-empty completion, so its mini-batch (the second)
    has one sequence and one rank trains on nothing but a padding micro-batch."""
    groups = make_groups(step, seed=40 + step)
    for completion in groups[2].completions[1:]:
        completion.token_ids, completion.logprobs = [], []
    return groups


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


#: The tiny model's head is its embedding: a published version holds it once.
TIED = {"lm_head.weight"}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) ^ set(b) <= TIED, sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a.keys() & b.keys())


# --- what each rank runs ----------------------------------------------------------------------


def _rank_main(config_path: str, run_dir: str, out: str) -> None:
    from refill.trainer.distributed import join_world
    from refill.trainer.sharding import gather_full

    torch.set_num_threads(1)
    world = join_world()
    assert world is not None and world.size == 2
    config = RunConfig.model_validate(json.loads(Path(config_path).read_text()))
    trainer = GRPOTrainer(config, run_dir, world=world)
    trainer.restore(0)
    metrics = [trainer.train_step(0, step_groups(0))]
    trainer.checkpoint(1)  # publishes version 1
    metrics.append(trainer.train_step(1, step_groups(1)))
    straight = gather_full(trainer.model, world, "float32")

    # A fresh trainer of the same ranks, from the ranks' checkpoint of version 1.
    resumed = GRPOTrainer(config, run_dir, world=world)
    resumed.restore(1)
    metrics.append(resumed.train_step(1, step_groups(1)))
    again = gather_full(resumed.model, world, "float32")
    if world.leader:
        torch.save({"metrics": metrics, "straight": straight, "resumed": again}, out)
    world.close()
    # Then end at once, without the interpreter's finalization: gloo's worker threads can still
    # hold work whose tensors, freed while the interpreter is torn down (the FSDP models keep
    # the process groups alive until then), abort the process ("terminate called without an
    # active exception", status 134: once in a CI run, after World.close's barrier was added).
    # Everything this rank had to say is in its output file or flushed below.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_ranks(tmp_path: Path, config: RunConfig) -> dict[str, Any]:
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    out = tmp_path / "ranks.pt"
    argv = [sys.executable, "-m", "tests.unit.trainer.test_distributed", str(config_path), str(tmp_path / "ranks"), str(out)]
    status = RankGroup(argv, 2, environ={**_environ(), "OMP_NUM_THREADS": "1"}).wait()
    assert status == 0, f"the ranks exited with status {status}"
    return torch.load(out, weights_only=True)


def _environ() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


# --- the tests --------------------------------------------------------------------------------

COMPARED = (
    "loss", "grad_norm", "grad_norm_max", "clip_fraction_lower", "clip_fraction_upper",
    "ratio_mean", "entropy", "kl", "importance_weight_mean", "advantage_abs_mean",
)


@pytest.mark.slow
def test_two_ranks_train_as_one_process_and_resume_exactly(settings, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    config = _config(settings)
    ranks = _run_ranks(tmp_path, config)

    single = GRPOTrainer(config, tmp_path / "single")
    single.restore(0)
    before = _params(single.model)
    expected = [single.train_step(0, step_groups(0))]
    single.checkpoint(1)
    expected.append(single.train_step(1, step_groups(1)))
    # The steps move the weights far more than the tolerance below.
    assert _worst(before, _params(single.model)) > 1e-2

    for got, want in zip(ranks["metrics"][:STEPS], expected, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        for key in ("tokens", "sequences", "groups", "updates", "mini_batches"):
            assert got[key] == want[key], key
        assert got["ranks"] == 2 and want["ranks"] == 1
        assert all(got[f"rank{r}_step_seconds"] > 0 and got[f"rank{r}_peak_memory_bytes"] > 0 for r in (0, 1))
    assert expected[0]["updates"] == 4  # two mini-batches, two passes
    # Same weights: in memory after two steps, and the published version 1.
    assert _worst(ranks["straight"], _params(single.model)) < 1e-5
    published = load_file(str(weights_dir(tmp_path / "ranks", 1) / "model.safetensors"))
    reference = load_file(str(weights_dir(tmp_path / "single", 1) / "model.safetensors"))
    assert _worst(published, reference) < 1e-5

    # Resumed from the two ranks' checkpoint of version 1: exactly the straight run.
    assert ranks["metrics"][2] == ranks["metrics"][1] | {
        k: v for k, v in ranks["metrics"][2].items() if k.endswith(("_seconds", "_bytes"))
    }
    assert _worst(ranks["resumed"], ranks["straight"]) == 0.0

    # The same checkpoint resumes in one process (its shards read back whole).
    assert checkpoint_versions(tmp_path / "ranks") == [1]
    alone = GRPOTrainer(config, tmp_path / "ranks")
    alone.restore(1)
    assert alone.optimizer.state_dict()["state"][0]["step"] == 4
    alone.train_step(1, step_groups(1))
    assert _worst(_params(alone.model), ranks["straight"]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, a rank per GPU)")
def test_two_gpus_train_in_bf16_over_fp32_master_weights(settings, tmp_path, monkeypatch) -> None:
    """The GPU path: NCCL, a rank per GPU, bf16 parameters and compute with fp32 reductions
    and fp32 master weights (the optimizer's), against one GPU in full precision."""
    monkeypatch.chdir(REPO)
    config = _config(settings)
    config.distributed.mixed_precision = "bf16"
    ranks = _run_ranks(tmp_path, config)

    single = GRPOTrainer(config, tmp_path / "single")
    single.restore(0)
    expected = [single.train_step(0, step_groups(0))]
    single.checkpoint(1)
    expected.append(single.train_step(1, step_groups(1)))
    for got, want in zip(ranks["metrics"][:STEPS], expected, strict=True):
        # bf16 keeps about 3 significant digits.
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=5e-2, abs=1e-3), key
        assert got["tokens"] == want["tokens"] and got["updates"] == want["updates"]
        assert all(got[f"rank{r}_peak_memory_bytes"] > 0 for r in (0, 1))
    straight = {k: v.cpu() for k, v in ranks["straight"].items()}
    assert _worst(straight, {k: v.cpu() for k, v in _params(single.model).items()}) < 1e-2
    # Published in model.dtype (float32 here), from the fp32 master weights.
    published = load_file(str(weights_dir(tmp_path / "ranks", 1) / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in published.values())
    # The resume starts from the master weights and optimizer state: the same step again
    # (GPU kernels add in their own order, so within float noise rather than bit for bit).
    assert _worst(ranks["resumed"], ranks["straight"]) < 1e-4


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
