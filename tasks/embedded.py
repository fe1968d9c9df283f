"""The embedded default: every role of the fleet in one process.

The same app, tasks, consumer and ledger code as the fleet, on a SQLite ledger and kombu's
in-process `memory://` transport, with one Celery worker per role running in a thread (the
way `celery.contrib.testing.worker` starts one). The controller then runs in the caller's
thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.worker import WorkController
from celery.worker import state as worker_state

from refill.tasks.app import EMBEDDED_BROKER, make_app
from refill.tasks.queues import QUEUES
from refill.tasks.runtime import Runtime, install_runtime, remove_runtime
from refill.tasks.workers import ROLES

log = logging.getLogger(__name__)


class _ThreadWorker(WorkController):
    """A WorkController that says when its consumer is ready."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.ready = threading.Event()
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer) -> None:  # type: ignore[no-untyped-def]
        self.ready.set()


def fleet_options(config: Any) -> dict[str, Any]:
    """`embedded_fleet`'s sizes for a run's config (a `RunConfig`): the generate threads, and
    the consumer's group commit (`infra.consumer_batch_size`, `infra.consumer_batch_wait_ms`)."""
    return {
        "generate_concurrency": config.generation.groups_in_flight,
        "consume_concurrency": config.infra.consumer_batch_size,
        "consume_wait_ms": config.infra.consumer_batch_wait_ms,
    }


@contextmanager
def embedded_fleet(
    database_url: str,
    config: Any = None,
    *,
    broker_url: str = EMBEDDED_BROKER,
    loglevel: str = "WARNING",
) -> Iterator[Runtime]:
    """Start a worker thread for the generate, consume and train roles; yield the runtime.

    Sized by the run's `config` (a `RunConfig`; None: the schema's defaults, `fleet_options`):
    the consumer commits up to `infra.consumer_batch_size` results together (its threads, and
    its batch's bound), waiting at most `infra.consumer_batch_wait_ms` after the first."""
    from refill.config import from_snapshot

    sizes = fleet_options(config if config is not None else from_snapshot({}))
    app: Celery = make_app(broker_url, name="refill-embedded")
    consumer_batch = (sizes["consume_concurrency"], sizes["consume_wait_ms"])
    runtime = install_runtime(app, Runtime(app, database_url, worker_name="embedded", consumer_batch=consumer_batch))
    app.finalize()
    # Celery's threads pool resolves the app through the process's current app.
    app.set_current()
    app.set_default()
    _purge(app)
    concurrency = {"generate": sizes["generate_concurrency"], "consume": sizes["consume_concurrency"], "train": 1}
    workers: list[tuple[_ThreadWorker, threading.Thread]] = []
    try:
        for role in ("generate", "consume", "train"):
            spec = ROLES[role]
            worker = _ThreadWorker(
                app=app,
                hostname=f"{role}@embedded",
                pool=spec.pool,
                concurrency=concurrency[role],
                queues=[spec.queue],
                prefetch_multiplier=1,
                loglevel=loglevel,
                without_heartbeat=True,
                without_mingle=True,
                without_gossip=True,
            )
            thread = threading.Thread(target=worker.start, name=f"worker-{role}", daemon=True)
            thread.start()
            if not worker.ready.wait(30):
                raise RuntimeError(f"the embedded {role} worker did not start within 30 s")
            workers.append((worker, thread))
        yield runtime
    finally:
        # Celery stops in-thread workers through its module-level flag, all together.
        worker_state.should_terminate = 0
        for worker, thread in workers:
            thread.join(30)
            if thread.is_alive():
                log.warning("embedded worker %s did not stop within 30 s", worker.hostname)
        worker_state.should_terminate = None
        remove_runtime(app)


def _purge(app: Celery) -> None:
    # The memory transport is process-global: a previous embedded run in this process may
    # have left messages behind.
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for queue in QUEUES:
            channel.queue_declare(queue=queue, durable=True, auto_delete=False)
            channel.queue_purge(queue)
