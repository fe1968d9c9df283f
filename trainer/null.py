"""A trainer that trains nothing: for fleet simulation and capacity planning with the `sim`
back-end (`infra.trainer: null`). It takes the same path through the ledger as the real
trainer — claim, publish a weight version, mark trained — after a configurable delay."""

from __future__ import annotations

import time
from typing import Any

from refill.models.payload import TrainGroup


class NullTrainer:
    def __init__(self, delay_seconds: float = 0.0) -> None:
        self.delay_seconds = delay_seconds
        self.version: int | None = None

    def restore(self, version: int) -> None:
        self.version = version

    def train_step(self, step: int, groups: list[TrainGroup]) -> dict[str, float]:
        if self.delay_seconds > 0:
            time.sleep(self.delay_seconds)
        self.version = step + 1
        rewards = [r for g in groups for r in g.rewards]
        return {"loss": 0.0, "groups": float(len(groups)), "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0}

    def publish(self, version: int) -> str | None:
        return None

    def checkpoint(self, version: int) -> None:
        return None

    @classmethod
    def from_config(cls, config: Any) -> NullTrainer:
        return cls(float(config.infra.null_trainer_delay_seconds))
