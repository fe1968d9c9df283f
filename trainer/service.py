"""What the trainer worker does with one `train_step(run, step)` message.

Claim the step in the ledger (exactly one trainer gets it), bring the model to weight version
`step` (restoring a checkpoint after a crash or a lost step), train on the released batch,
publish version `step + 1`, and record it in the ledger in one transaction. A lease on the
step, kept alive while training, lets the reaper hand the step to another trainer if this
one dies; a trainer that lost its lease discards its update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from refill.config import RunConfig
from refill.models.db import Ledger
from refill.models.outbox import ToSend
from refill.models.payload import TrainGroup
from refill.models.training import (
    TrainBatch,
    claim_training,
    extend_training_lease,
    finish_training,
    training_failed,
)

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """What a trainer worker drives. `train_step`'s groups hold numpy arrays (`TrainGroup`)."""

    version: int | None

    def restore(self, version: int) -> None: ...
    def train_step(self, step: int, groups: list[TrainGroup]) -> dict[str, float]: ...
    def publish(self, version: int) -> str | None: ...
    def checkpoint(self, version: int) -> Any: ...


def make_trainer(config: RunConfig, run_dir: str) -> Trainer:
    """The run's trainer in this process: rank 0's of a trainer of several ranks when the
    process joined one (`refill worker train --nproc N`, torchrun), else a single process's."""
    if config.infra.trainer == "null":
        from refill.trainer.null import NullTrainer

        return NullTrainer.from_config(config)
    from refill.trainer.distributed import current_world

    world = current_world()
    if world is not None:
        from refill.trainer.ranks import RankTrainer

        return RankTrainer(world, config, run_dir)
    from refill.trainer.grpo import GRPOTrainer

    return GRPOTrainer(config, run_dir)


class TrainerService:
    def __init__(
        self,
        ledger: Ledger,
        *,
        trainer_id: str,
        after_commit: Callable[[ToSend], int] | None = None,
        trainer_factory: Callable[[RunConfig, str], Trainer] = make_trainer,
    ) -> None:
        self.ledger = ledger
        self.trainer_id = trainer_id
        self.after_commit = after_commit
        self.trainer_factory = trainer_factory
        self._trainers: dict[int, Trainer] = {}
        self._lock = threading.Lock()

    def train(self, run_id: int, step: int) -> str:
        with self._lock:  # one step at a time per process: the model is shared state
            batch = self.ledger.transaction(
                lambda s: claim_training(s, run_id, step, self.trainer_id), what="claim step"
            )
            if batch is None:
                return "skipped"
            return self._train(batch)

    def _train(self, batch: TrainBatch) -> str:
        config = RunConfig.model_validate(batch.config)
        # The lease is kept from the claim on: building a trainer (importing torch, loading a
        # large model onto its ranks) can take longer than the lease.
        keeper = _TrainingLease(self.ledger, batch, self.trainer_id, config.infra.trainer_lease_seconds)
        trainer = self._trainers.get(batch.run_id)
        if trainer is None:
            try:
                trainer = self._trainers[batch.run_id] = self.trainer_factory(config, batch.run_dir)
            except BaseException:
                keeper.stop()
                raise
        started = time.perf_counter()
        try:
            if trainer.version != batch.weight_version:
                # A fresh process, or a step this process lost: continue from the checkpoint of
                # exactly the version this step trains from.
                log.info("restoring trainer of run %s to version %s", batch.run_id, batch.weight_version)
                trainer.restore(batch.weight_version)
            if batch.groups:
                metrics = trainer.train_step(batch.step, batch.groups)
                path = trainer.publish(batch.step + 1)
                trainer.checkpoint(batch.step + 1)
            else:
                # Every slot of the step shrank at the end of the data: no optimizer step, but
                # the version still advances (same weights, published and checkpointed like any
                # other) so that step s always trains from version s and a restart finds it.
                metrics = {"empty_step": 1.0}
                trainer.version = batch.step + 1
                path = trainer.publish(batch.step + 1)
                trainer.checkpoint(batch.step + 1)
        except Exception as error:
            trainer.version = None  # state may be half-updated: restore before the next step
            keeper.stop()  # before the ledger write below, which the beat would race
            log.exception("training step %s of run %s failed", batch.step, batch.run_id)
            reason = f"{type(error).__name__}: {error}"
            to_send = self.ledger.transaction(
                lambda s: training_failed(s, batch.run_id, batch.step, self.trainer_id, reason),
                what="record training failure",
            )
            self._relay(to_send)
            return "failed"
        except BaseException:
            trainer.version = None
            raise
        finally:
            keeper.stop()
        metrics = dict(metrics)
        metrics["train_seconds"] = time.perf_counter() - started
        to_send = self.ledger.transaction(
            lambda s: finish_training(s, batch.run_id, batch.step, self.trainer_id, path, metrics),
            what="finish step",
        )
        if to_send is None:
            log.warning(
                "step %s of run %s was taken over by another trainer; discarding this update",
                batch.step,
                batch.run_id,
            )
            trainer.version = None
            return "lost"
        self._relay(to_send)
        return "trained"

    def _relay(self, to_send: ToSend) -> None:
        if to_send and self.after_commit is not None:
            try:
                self.after_commit(to_send)
            except Exception as error:  # noqa: BLE001 - the controller's relay sends it later
                log.warning("immediate relay after training failed: %r", error)

    def close(self) -> None:
        self._trainers.clear()


class _TrainingLease:
    """Keeps the step's trainer lease alive while the optimizer works."""

    def __init__(self, ledger: Ledger, batch: TrainBatch, trainer_id: str, lease_seconds: float) -> None:
        self._stop = threading.Event()

        def beat() -> None:
            while not self._stop.wait(max(1.0, lease_seconds / 4)):
                try:
                    ledger.transaction(
                        lambda s: extend_training_lease(
                            s, batch.run_id, batch.step, trainer_id, lease_seconds
                        )
                    )
                except Exception as error:  # noqa: BLE001 - retried at the next beat
                    log.warning("training lease heartbeat failed: %r", error)

        self._thread = threading.Thread(target=beat, name="training-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
