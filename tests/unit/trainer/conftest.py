from __future__ import annotations

import random

import pytest
import torch

from refill.models.payload import Completion, TrainGroup
from refill.trainer.settings import TrainerConfig


@pytest.fixture(autouse=True)
def _few_threads():
    # The CI machine has two cores shared with other suites.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def settings(tmp_path) -> TrainerConfig:
    """The tiny model, randomly initialised (no warm start: unit tests need no skill)."""
    s = TrainerConfig()
    s.model.name_or_path = "builtin:tiny-arith"
    s.model.warm_start.enabled = False
    s.model.warm_start.cache_dir = str(tmp_path / "cache")
    s.optimizer.lr = 1e-3
    s.optimizer.weight_decay = 0.01
    s.optimizer.warmup_steps = 2
    s.optimizer.micro_batch_tokens = 4096
    s.generation.max_new_tokens = 6
    s.async_rl.max_lookahead_versions = 1
    return s


def make_groups(step: int, seed: int, count: int = 3, n: int = 4) -> list[TrainGroup]:
    """Deterministic groups of varied prompt and completion lengths, tokens from the digits."""
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [rng.randint(4, 18) for _ in range(rng.randint(3, 6))]
        completions = []
        for _ in range(n):
            length = rng.randint(1, 6)
            tokens = [rng.randint(4, 13) for _ in range(length - 1)] + [2]
            completions.append(
                Completion(
                    token_ids=tokens,
                    logprobs=[-rng.uniform(0.5, 4.0) for _ in tokens],
                    text="",
                )
            )
        rewards = [float(rng.random() < 0.5) for _ in range(n - 1)]
        rewards.append(1.0 - rewards[0])  # never zero-variance
        groups.append(TrainGroup(1000 * step + g, prompt, completions, rewards, step))
    return groups
