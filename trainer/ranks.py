"""Rank 0 and the others: how one trainer of several ranks takes the fleet's steps.

Rank 0 is the trainer worker the fleet knows: a Celery worker that claims a step, keeps its
lease alive and records it (`refill.trainer.service`), exactly as a trainer of one process.
Its `Trainer` is a `RankTrainer`: each call (restore, train_step, publish, checkpoint) is an
`Order` handed to every other rank, then run on rank 0's own `GRPOTrainer`. The other ranks
run `follow`: they never see Celery or the ledger; they take each order, run the same call on
their own `GRPOTrainer`, and the ranks end each order by agreeing on its outcome. The step's
groups reach every rank inside the order (a broadcast from rank 0), and every rank works out
the same plan from them, training on its share.

An order runs in lockstep (`World.lockstep`): a failure that every rank meets alike (a refused
batch, a non-finite gradient, a checkpoint that does not load) is raised on every rank and
reported by rank 0 as the step's failure; any other failure of a rank ends its process, and
the launcher then ends the others, so a trainer short of a rank never holds a step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from refill.config import RunConfig
from refill.trainer.distributed import World
from refill.trainer.grpo import GRPOTrainer
from refill.trainer.launch import EXIT_RANK_FAILED

log = logging.getLogger(__name__)

#: The trainer methods an order may name.
CALLS = ("restore", "train_step", "publish", "checkpoint")


@dataclass
class Order:
    """One call for every rank's trainer of one run."""

    run_dir: str
    config: RunConfig
    method: str
    args: tuple[Any, ...]
    #: Rank 0's trainer version when it gave the order: every rank's trainer takes it first,
    #: so that all check the call against the same version.
    version: int | None


class RankTrainer:
    """Rank 0's trainer of one run: what it is asked, every rank does."""

    def __init__(self, world: World, config: RunConfig, run_dir: str) -> None:
        if not world.leader:
            raise RuntimeError("only rank 0 takes the fleet's steps; the other ranks follow()")
        self.world = world
        self.config = config
        self.run_dir = str(run_dir)
        self.local = GRPOTrainer(config, run_dir, world=world)

    @property
    def version(self) -> int | None:
        return self.local.version

    @version.setter
    def version(self, value: int | None) -> None:
        # The other ranks take it with the next order.
        self.local.version = value

    def _everywhere(self, method: str, *args: Any) -> Any:
        # An order that cannot reach every rank leaves a trainer short of one: stop it.
        with self.world.lockstep(f"handing {method} to the other ranks"):
            self.world.post(Order(self.run_dir, self.config, method, args, self.local.version))
        return run_order(self.local, self.world, method, args)

    def restore(self, version: int) -> None:
        self._everywhere("restore", version)

    def train_step(self, step: int, groups: list[Any]) -> dict[str, float]:
        return self._everywhere("train_step", step, groups)

    def publish(self, version: int) -> str:
        return self._everywhere("publish", version)

    def checkpoint(self, version: int) -> str:
        return self._everywhere("checkpoint", version)


def run_order(trainer: GRPOTrainer, world: World, method: str, args: tuple[Any, ...]) -> Any:
    """Run one order on this rank's trainer; every rank ends it knowing whether any failed."""
    if method not in CALLS:
        raise ValueError(f"no trainer call {method!r}; an order names one of {', '.join(CALLS)}")
    error: BaseException | None = None
    result = None
    with world.lockstep(f"{method} of {trainer.run_dir}"):
        try:
            result = getattr(trainer, method)(*args)
        except Exception as caught:  # noqa: BLE001 - World.agree raises it on every rank
            error = caught
        world.agree(error, f"{method} on the trainer's ranks")
    return result


def follow(world: World) -> int:
    """A rank other than 0: run rank 0's orders until it is gone. Returns the exit status."""
    if world.leader:
        raise RuntimeError("rank 0 gives the orders; it does not follow them")
    trainers: dict[str, GRPOTrainer] = {}
    log.info("trainer rank %d of %d waiting for rank 0's orders", world.rank, world.size)
    while True:
        try:
            order: Order = world.receive()
        except dist.DistNetworkError as error:
            # The store the orders come through is gone: its server (rank 0, or the launcher
            # or torchrun's agent) stopped or died.
            log.info("trainer rank %d: rank 0 is gone (%s); stopping", world.rank, error)
            return 0
        except Exception:
            log.critical("trainer rank %d: rank 0's order did not arrive; stopping", world.rank, exc_info=True)
            return EXIT_RANK_FAILED
        trainer = trainers.get(order.run_dir)
        if trainer is None:
            with world.lockstep(f"opening the trainer of {order.run_dir}"):
                trainer = trainers[order.run_dir] = GRPOTrainer(
                    order.config, order.run_dir, world=world
                )
        trainer.version = order.version
        try:
            run_order(trainer, world, order.method, order.args)
        except Exception as error:  # noqa: BLE001 - rank 0 reports it as the step's failure
            log.warning("trainer rank %d: %s failed: %s", world.rank, order.method, error)
