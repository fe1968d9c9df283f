"""One trainer over several processes: its process groups, the orders rank 0 gives, the sums
the ranks add up, and what a rank does when the ranks can no longer run in step.

A `World` has two process groups. The default one (NCCL on GPUs, gloo on the CPU) carries
FSDP's all-gathers and reduce-scatters. The control group (always gloo, on the CPU) carries
small objects: rank 0's orders, each rank's outcome, metric sums, checkpoint plans. Between
orders the other ranks wait on the c10d store, not in a collective: a trainer may stand idle
for hours between steps, longer than any collective's timeout, and a store wait can time out
and be retried harmlessly. (When rank 0 dies the launcher, or torchrun, stops them; where rank 0
serves the store itself, their wait fails at once too.)

Every rank runs the same trainer code on the same orders (SPMD). Where a rank fails inside a
stretch of collectives (`World.lockstep`), the others would wait for it forever, so it exits
the process instead: the launcher (or torchrun) then stops every rank, the step's lease
expires, and the next trainer trains the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from refill.trainer.launch import EXIT_RANK_FAILED, RankEnv, rank_env

log = logging.getLogger(__name__)

#: A collective that waits longer than this for a peer fails (FSDP's and the control group's).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
#: One wait of an idle rank for rank 0's next order; it is simply repeated.
IDLE_WAIT = timedelta(hours=12)
_ORDER_PREFIX = "refill/order/"


class World:
    """This process's place among the ranks of one trainer, and what they share."""

    def __init__(
        self, env: RankEnv, device: torch.device, control: Any, store: Any, mesh: Any = None
    ) -> None:
        self.rank = env.rank
        self.size = env.world_size
        self.local_rank = env.local_rank
        self.device = device
        self.control = control
        self._store = store
        self._posted = 0
        self._received = 0
        #: The 1-D device mesh FSDP shards over.
        self.mesh = mesh

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, env: RankEnv) -> World:
        """Join the trainer's process group (blocks until every rank has joined)."""
        if torch.cuda.is_available():
            device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        # The store every rank already reaches (the launcher's, torchrun's agent's, or rank 0's).
        store = dist.PrefixStore(_ORDER_PREFIX, dist.distributed_c10d._get_default_store())
        mesh = init_device_mesh(device.type, (env.world_size,))
        world = cls(env, device, control, store, mesh)
        log.info("trainer rank %d of %d on %s", world.rank, world.size, device)
        return world

    # -- rank 0's orders ---------------------------------------------------------------------

    def post(self, order: Any) -> None:
        """Rank 0: hand `order` to every other rank (they take it with `receive`)."""
        if not self.leader:
            raise RuntimeError("only rank 0 gives orders")
        self._posted += 1
        self._store.set(str(self._posted), b"1")
        self.broadcast(order)
        if self._posted > 2:
            # Every rank has taken the order before the previous one: its key is done with.
            self._store.delete_key(str(self._posted - 2))

    def receive(self) -> Any:
        """Another rank: wait (as long as it takes) for rank 0's next order."""
        key = str(self._received + 1)
        while True:
            try:
                self._store.wait([key], IDLE_WAIT)
                break
            except dist.DistStoreError as error:
                if "timeout" not in str(error).lower():
                    raise
        self._received += 1
        return self.broadcast(None)

    # -- collectives on the control group ----------------------------------------------------

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, by rank, on every rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.control)
        return out

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks, in float64."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor, group=self.control)
        return tensor.tolist()

    def agree(self, outcome: BaseException | None, what: str) -> None:
        """Every rank says whether its part of `what` failed; a rank whose own part went well
        raises if another's did not, so that all ranks raise or none does (`agreed`). The
        rank's own exception is re-raised as it is."""
        said = self.gather(None if outcome is None else f"{type(outcome).__name__}: {outcome}")
        if outcome is not None:
            raise agreed(outcome)
        failed = [(rank, text) for rank, text in enumerate(said) if text is not None]
        if failed:
            raise agreed(
                RuntimeError(
                    f"{what} failed on "
                    + "; ".join(f"rank {rank}: {text}" for rank, text in failed)
                )
            )

    @contextlib.contextmanager
    def lockstep(self, what: str) -> Iterator[None]:
        """Code in which the ranks run the same collectives in the same order. An exception
        here may leave the other ranks waiting in a collective this rank will never join, so
        the process exits (EXIT_RANK_FAILED) and takes the trainer down with it; only an
        exception every rank raises at the same point (`agreed`) passes."""
        try:
            yield
        except Exception as error:
            if is_agreed(error):
                raise
            log.critical(
                "trainer rank %d of %d failed during %s, with the other ranks in collectives; "
                "stopping this trainer so that the step's lease expires and another trains it",
                self.rank,
                self.size,
                what,
                exc_info=True,
            )
            _flush_logs()
            os._exit(EXIT_RANK_FAILED)

    def close(self) -> None:
        """Leave the world together: a rank that tears its process group down while a peer's
        last collective is still sending to it (a gather's final bytes) aborts in gloo
        ("terminate called without an active exception"), so every rank waits for all first."""
        if dist.is_initialized():
            dist.barrier(group=self.control)
            dist.destroy_process_group()


def agreed(error: BaseException) -> BaseException:
    """Mark `error` as raised at the same point on every rank (from values every rank shares,
    or after `World.agree`), so that `World.lockstep` lets it pass."""
    error.refill_agreed = True  # type: ignore[attr-defined]
    return error


def is_agreed(error: BaseException) -> bool:
    return bool(getattr(error, "refill_agreed", False))


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


_current: World | None = None


def current_world() -> World | None:
    """The world this process joined with `join_world`, or None (a single-process trainer)."""
    return _current


def join_world(env: RankEnv | None = None) -> World | None:
    """Join the trainer's process group when the environment names several ranks (torchrun's
    variables, which `--nproc` sets too); None when it does not. Once per process."""
    global _current
    if _current is not None:
        return _current
    env = env or rank_env()
    if env is None:
        return None
    _current = World.start(env)
    return _current


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> float:
    """The most memory this rank held: on a GPU, what torch allocated since the last
    `reset_peak_memory` (its step); on the CPU, the process's peak resident set so far (the
    kernel keeps no per-step figure)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
