"""Process-wide resources of a worker, attached to its Celery app.

A worker process has one ledger connection pool, one generation engine (the reason many
groups are in flight per process), one results consumer and one trainer. They are created
lazily by the first task that needs them, so a worker of one role never loads another role's
machinery (a consumer never imports torch).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING

from celery import Celery

from refill.models.db import Ledger
from refill.tasks import chaos

if TYPE_CHECKING:
    from refill.tasks.consumer import ResultConsumer
    from refill.tasks.generation import GenerationService
    from refill.trainer.service import TrainerService

DEFAULT_DATABASE_URL = "sqlite:///runs/refill.db"


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Runtime:
    def __init__(self, app: Celery, database_url: str, worker_name: str | None = None) -> None:
        self.app = app
        self.worker_name = worker_name or default_worker_name()
        self.ledger = Ledger(database_url, application_name=f"refill:{self.worker_name}")
        self._lock = threading.Lock()
        self._generation: GenerationService | None = None
        self._consumer: ResultConsumer | None = None
        self._trainer: TrainerService | None = None
        chaos.announce()

    def relay(self, outbox_ids: list[int]) -> int:
        """Send what a commit just wrote, without waiting for the controller's relay tick."""
        from refill.tasks.relay import relay

        return relay(self.ledger, self.app, claimer=self.worker_name, ids=outbox_ids)

    def generation(self) -> GenerationService:
        with self._lock:
            if self._generation is None:
                from refill.tasks.generation import GenerationService

                self._generation = GenerationService(
                    self.ledger, send_result=self.send_result, worker=self.worker_name
                )
            return self._generation

    def consumer(self) -> ResultConsumer:
        with self._lock:
            if self._consumer is None:
                from refill.tasks.consumer import ResultConsumer

                self._consumer = ResultConsumer(self.ledger, after_commit=self.relay)
            return self._consumer

    def trainer(self) -> TrainerService:
        with self._lock:
            if self._trainer is None:
                from refill.trainer.service import TrainerService

                self._trainer = TrainerService(
                    self.ledger, trainer_id=self.worker_name, after_commit=self.relay
                )
            return self._trainer

    def send_result(self, body: dict) -> None:
        from refill.tasks.queues import RESULTS, TASK_RECORD_RESULT

        for _ in range(chaos.result_copies()):  # 1, or 2 when the fault suite injects duplicates
            self.app.send_task(
                TASK_RECORD_RESULT, args=[body], queue=RESULTS, routing_key=RESULTS, serializer="json"
            )

    def close(self) -> None:
        for part in (self._generation, self._consumer, self._trainer):
            if part is not None:
                part.close()
        self.ledger.dispose()


_runtimes: dict[int, Runtime] = {}
_runtimes_lock = threading.Lock()


def install_runtime(app: Celery, runtime: Runtime) -> Runtime:
    with _runtimes_lock:
        _runtimes[id(app)] = runtime
    return runtime


def runtime_for(app: Celery) -> Runtime:
    """The app's runtime; a fleet worker builds it from REFILL_DATABASE_URL on first use."""
    with _runtimes_lock:
        found = _runtimes.get(id(app))
        if found is None:
            url = os.environ.get("REFILL_DATABASE_URL") or DEFAULT_DATABASE_URL
            found = _runtimes[id(app)] = Runtime(app, url, os.environ.get("REFILL_WORKER_NAME"))
        return found


def remove_runtime(app: Celery) -> None:
    with _runtimes_lock:
        runtime = _runtimes.pop(id(app), None)
    if runtime is not None:
        runtime.close()
