"""The parts of a trainer of several ranks that need no second rank: the launcher (ranks live
and die together), torchrun's environment, the split of an update over the ranks, the
mixed-precision choice, the per-rank figures of a single process, and a checkpoint whose
metadata names anything but DCP's own classes."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from refill.trainer import checkpoints
from refill.trainer.grpo import GRPOTrainer
from refill.trainer.launch import EXIT_RANK_FAILED, RankGroup, rank_env, rank_environment
from refill.trainer.minibatches import padding_micro_batch, share_by_tokens, split_into_mini_batches
from refill.trainer.sequence_batches import TrainSequence, score
from refill.trainer.sharding import mixed_precision
from refill.trainer.weights import checkpoint_dir

from .conftest import make_groups

# --- torchrun's environment -------------------------------------------------------------------


def test_rank_env_reads_torchruns_variables() -> None:
    assert rank_env({}) is None
    assert rank_env({"WORLD_SIZE": "1", "RANK": "0"}) is None  # one rank: a plain trainer
    env = rank_env({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"})
    assert (env.rank, env.local_rank, env.world_size, env.leader) == (2, 0, 4, False)
    with pytest.raises(ValueError, match="RANK is not"):
        rank_env({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        rank_env({"WORLD_SIZE": "2", "RANK": "one"})
    with pytest.raises(ValueError, match="need 0 <= RANK < WORLD_SIZE"):
        rank_env({"WORLD_SIZE": "2", "RANK": "2"})


def test_each_rank_gets_its_environment() -> None:
    env = rank_environment({"OMP_NUM_THREADS": "3"}, 1, 2, 29500)
    assert env["RANK"] == env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the launcher serves the store
    assert env["OMP_NUM_THREADS"] == "3"  # an explicit setting wins
    assert int(rank_environment({}, 0, 2, 1)["OMP_NUM_THREADS"]) >= 1


# --- the launcher: ranks live and die together -------------------------------------------------

#: A rank that does as RANK_<rank> says: "sleep", "exit N" (after a moment), "late N" (exit
#: a second later), or "kill" itself.
RANK_SCRIPT = """
import os, signal, sys, time
what = os.environ.get("RANK_" + os.environ["RANK"], "sleep").split()
if what[0] in ("exit", "late"):
    time.sleep(0.3 if what[0] == "exit" else 1.3)
    sys.exit(int(what[1]))
if what[0] == "kill":
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _ranks(nproc: int, **behaviour: str) -> tuple[RankGroup, float]:
    env = {**__import__("os").environ, **{f"RANK_{r}": v for r, v in behaviour.items()}}
    started = time.monotonic()
    group = RankGroup([sys.executable, "-c", RANK_SCRIPT], nproc, environ=env)
    return group, started


def test_a_rank_that_fails_takes_the_others_down() -> None:
    group, started = _ranks(3, **{"1": "exit 3"})
    assert group.wait() == 3
    assert time.monotonic() - started < 30  # not the others' 60 s
    assert all(p.poll() is not None for p in group.processes)


def test_a_killed_rank_reports_its_signal() -> None:
    group, _ = _ranks(2, **{"1": "kill"})
    assert group.wait() == 137
    assert all(p.poll() is not None for p in group.processes)


def test_a_rank_that_exits_cleanly_still_stops_the_trainer() -> None:
    # Rank 1 has no business ending while rank 0 runs: the trainer is short of a rank.
    group, _ = _ranks(2, **{"1": "exit 0"})
    assert group.wait() == EXIT_RANK_FAILED
    # Rank 0 ending (a warm shutdown done) ends the rest with its status.
    group, _ = _ranks(2, **{"0": "exit 0"})
    assert group.wait() == 0
    assert all(p.poll() is not None for p in group.processes)


def test_ranks_leaving_together_end_cleanly_whichever_exits_first() -> None:
    # `World.close` lets every rank go at once; a follower's process may end a moment first.
    group, _ = _ranks(2, **{"0": "late 0", "1": "exit 0"})
    assert group.wait() == 0
    # The leader failing just after a follower ended cleanly is the leader's failure.
    group, _ = _ranks(2, **{"0": "late 4", "1": "exit 0"})
    assert group.wait() == 4
    assert all(p.poll() is not None for p in group.processes)


def test_no_rank_outlives_a_killed_launcher() -> None:
    import os
    import re

    code = (
        "import sys; from refill.trainer.launch import launch; "
        "sys.exit(launch([sys.executable, '-c', 'import time; time.sleep(60)'], 2))"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pids = []
    while len(pids) < 2:
        line = launcher.stdout.readline()
        assert line, "the launcher ended before announcing its ranks"
        pids += [int(p) for p in re.findall(r"is pid (\d+)", line)]
    launcher.kill()
    launcher.wait(10)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:  # a zombie waits only for its reaper
            return not stat.read().split(") ", 1)[1].startswith("Z")

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_one_rank_is_no_group() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        RankGroup([sys.executable, "-c", "pass"], 1)


def test_the_cli_refuses_nproc_inside_torchrun(tmp_path) -> None:
    env = {**__import__("os").environ, "REFILL_BROKER_URL": "redis://127.0.0.1:1/0",
           "REFILL_DATABASE_URL": "sqlite:///x.db", "WORLD_SIZE": "2", "RANK": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "refill.admin.cli", "worker", "train", "--nproc", "2"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "already rank 0 of 2" in done.stdout + done.stderr


# --- an update split over the ranks -----------------------------------------------------------


def _sequence(attempt: int, prompt: int, completion: int) -> TrainSequence:
    return TrainSequence([5] * prompt, [6] * completion, 0.5, [], attempt)


def test_shares_are_balanced_by_tokens_and_cover_every_sequence() -> None:
    sequences = [_sequence(1, 3, n) for n in (9, 1, 1, 1, 5, 4, 2, 2)]
    shares = share_by_tokens(sequences, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(sequences)))
    loads = [sum(sequences[i].length for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(s.length for s in sequences)
    assert share_by_tokens(sequences, 1) == [list(range(len(sequences)))]


def test_every_rank_runs_as_many_micro_batches_and_the_normaliser_is_the_whole_update() -> None:
    # Two groups: one of four sequences, one of a single sequence (its update has nothing for
    # the second rank but padding).
    sequences = [_sequence(1, 4, n) for n in (6, 5, 2, 1)] + [_sequence(2, 4, 3)]
    per_rank = [
        split_into_mini_batches(sequences, [1, 2], 1, 12, 0, rank=r, ranks=2) for r in range(2)
    ]
    for a, b in zip(*per_rank, strict=True):
        assert len(a.micro) == len(b.micro)
        assert a.total_tokens == b.total_tokens == a.tokens + b.tokens
        assert a.total_sequences == b.total_sequences == len(a.sequences) + len(b.sequences)
    assert [m.total_tokens for m in per_rank[0]] == [14, 3]
    padded = [m for mbs in per_rank for m in mbs if not m.sequences]
    assert len(padded) == 1 and all(b.tokens == 0 for b in padded[0].micro)
    # One rank: exactly the plan of a single process.
    alone = split_into_mini_batches(sequences, [1, 2], 1, 12, 0)
    assert [len(m.sequences) for m in alone] == [4, 1] and all(m.total_tokens == m.tokens for m in alone)


def test_a_padding_micro_batch_scores_finite_and_has_no_token() -> None:
    from refill.model_loading import load_model, model_directory

    model = load_model(model_directory("builtin:tiny-arith"))
    batch = padding_micro_batch(0)
    scored = score(model, batch, 1.0, torch.device("cpu"), True, 0.9)
    assert batch.tokens == 0
    assert torch.isfinite(scored.logprobs).all() and torch.isfinite(scored.entropy).all()
    assert scored.processed is not None and not scored.processed.any()


# --- mixed precision ----------------------------------------------------------------------------


def test_mixed_precision_is_for_devices_with_bf16() -> None:
    cpu = torch.device("cpu")
    choose = lambda mode: mixed_precision(SimpleNamespace(distributed=SimpleNamespace(mixed_precision=mode)), cpu)  # noqa: E731
    assert choose("auto") is False and choose("off") is False
    with pytest.raises(ValueError, match="mixed_precision=bf16 needs a GPU with bf16"):
        choose("bf16")


# --- a single process ----------------------------------------------------------------------------


def test_a_single_process_reports_itself_as_rank_0(settings, tmp_path) -> None:
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    metrics = trainer.train_step(0, make_groups(0, seed=1))
    assert metrics["ranks"] == 1.0
    assert metrics["rank0_step_seconds"] > 0 and metrics["rank0_peak_memory_bytes"] > 0
    assert "rank1_step_seconds" not in metrics


def test_a_checkpoint_whose_metadata_names_other_code_is_refused(settings, tmp_path) -> None:
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    trainer.train_step(0, make_groups(0, seed=2))
    trainer.checkpoint(1)
    metadata = checkpoint_dir(tmp_path / "run", 1) / checkpoints.METADATA_FILE

    class Payload:
        def __reduce__(self):
            return (print, ("this ran",))

    metadata.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(RuntimeError, match="refusing to load it"):
        GRPOTrainer(settings, tmp_path / "run").restore(1)
    # Nothing was unpickled: the name is refused before anything is called.
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        checkpoints._MetadataUnpickler(io.BytesIO(metadata.read_bytes())).load()


def test_a_checkpoint_from_before_dcp_still_resumes_exactly(settings, tmp_path) -> None:
    import random
    import shutil

    import numpy as np

    straight = GRPOTrainer(settings, tmp_path / "straight")
    straight.restore(0)
    straight.train_step(0, make_groups(0, seed=3))
    straight.train_step(1, make_groups(1, seed=4))

    old = GRPOTrainer(settings, tmp_path / "old")
    old.restore(0)
    old.train_step(0, make_groups(0, seed=3))
    old.publish(1)
    # What refill wrote before DCP: trainer_state.pt, the optimizer by parameter position.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "version": 1,
        "optimizer": old.optimizer.state_dict(),
        "scheduler": old.scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]},
    }
    folder = checkpoint_dir(tmp_path / "old", 1)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    torch.save(state, folder / checkpoints.LEGACY_FILE)
    del old

    resumed = GRPOTrainer(settings, tmp_path / "old")
    resumed.restore(1)
    resumed.train_step(1, make_groups(1, seed=4))
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert int(resumed.optimizer.state_dict()["state"][0]["step"]) == 2
