"""Worker roles: which queues, pool and concurrency each `refill worker ROLE` runs.

Every role is a plain `celery worker` on `refill.tasks.app`; only the command line differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from refill.tasks.queues import CONTROL, GENERATE, RESULTS, TRAIN


@dataclass(frozen=True)
class Role:
    name: str
    queue: str
    pool: str
    concurrency: int
    doc: str


ROLES = {
    "generate": Role(
        "generate",
        GENERATE,
        "threads",
        8,
        "one engine per process (run one per GPU); each thread runs one message, a bundle of up "
        "to 8 of a run's attempts, so 8 x --concurrency groups are in flight for the engine to "
        "batch (set --concurrency to generation.groups_in_flight / 8)",
    ),
    "consume": Role(
        "consume",
        RESULTS,
        "threads",
        64,
        "records results; the threads' results are committed together (group commit), so "
        "concurrency bounds the batch size",
    ),
    "train": Role(
        "train",
        TRAIN,
        "threads",
        1,
        "one step at a time: the model and optimizer are this process's state",
    ),
    "control": Role(
        "control",
        CONTROL,
        "threads",
        4,
        "runs detached controllers (`refill run start --detach`) in time slices",
    ),
}


def worker_argv(role: str, *, concurrency: int | None = None, hostname: str | None = None, loglevel: str = "INFO") -> list[str]:
    """The `celery worker` arguments for a role."""
    spec = ROLES[role]
    return [
        "worker",
        "--queues",
        spec.queue,
        "--pool",
        spec.pool,
        "--concurrency",
        str(concurrency or spec.concurrency),
        "--prefetch-multiplier",
        "1",
        "--hostname",
        hostname or f"{role}@%h",
        "--loglevel",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]
