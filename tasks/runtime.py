"""Process-wide resources of a worker, attached to its Celery app.

A worker process has one ledger connection pool, one generation engine (the reason many
groups are in flight per process), one results consumer and one trainer. They are created
lazily by the first task that needs them, so a worker of one role never loads another role's
machinery (a consumer never imports torch).
"""

from __future__ import annotations

import gc
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from celery import Celery

from refill.models.payload import estimated_body_bytes
from refill.tasks import chaos
from refill.tasks.outage import PatientLedger

if TYPE_CHECKING:
    from refill.models.outbox import ToSend
    from refill.tasks.consumer import ResultConsumer
    from refill.tasks.generation import GenerationService
    from refill.trainer.service import TrainerService

DEFAULT_DATABASE_URL = "sqlite:///runs/refill.db"

#: The cyclic garbage collector's thresholds in a worker process (Python's: 700, 10, 10).
GC_THRESHOLD = (50_000, 20, 100)


def tune_collector() -> None:
    """Set this process's garbage collector for a worker's allocations, before it starts.

    A batch of results makes tens of thousands of dicts and rows, all freed by reference
    counting, and at Python's thresholds they set off the cyclic collector every 700
    allocations: about 1,800 passes in `bench overhead`'s 4096-group step, among them full
    passes over every object the process holds (its imports, SQLAlchemy's and Celery's state),
    about a second of that process's time (bench/README.md). What the process loaded before it
    starts work is moved out of the collector's sight (`gc.freeze`), and it runs every 50,000
    allocations: a few megabytes of cyclic garbage wait at most that long."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Runtime:
    def __init__(
        self,
        app: Celery,
        database_url: str,
        worker_name: str | None = None,
        *,
        consumer_batch: tuple[int, float] | None = None,
    ) -> None:
        """`consumer_batch`: the results consumer's group commit, (results, milliseconds), where
        a run's config sets it (the embedded run's `infra.consumer_batch_size` and `_wait_ms`);
        a fleet's consumer serves every run and keeps `ResultConsumer`'s own."""
        self.app = app
        self.worker_name = worker_name or default_worker_name()
        self.consumer_batch = consumer_batch
        # Waits out an outage of the database instead of failing the task in hand.
        self.ledger = PatientLedger(database_url, application_name=f"refill:{self.worker_name}")
        self._lock = threading.Lock()
        self._generation: GenerationService | None = None
        self._consumer: ResultConsumer | None = None
        self._trainer: TrainerService | None = None
        self._sender: ResultSender | None = None
        chaos.announce()

    def relay(self, to_send: ToSend) -> int:
        """Send what a commit just wrote, without waiting for the controller's relay tick."""
        from refill.tasks.relay import relay

        return relay(self.ledger, self.app, claimer=self.worker_name, only=to_send)

    def generation(self) -> GenerationService:
        with self._lock:
            if self._generation is None:
                from refill.tasks.generation import GenerationService

                self._generation = GenerationService(
                    self.ledger, send_results=self.send_results, worker=self.worker_name
                )
            return self._generation

    def consumer(self) -> ResultConsumer:
        with self._lock:
            if self._consumer is None:
                from refill.tasks.consumer import ResultConsumer

                batch: dict[str, Any] = {}
                if self.consumer_batch is not None:
                    batch["max_batch"], batch["max_wait_ms"] = self.consumer_batch
                self._consumer = ResultConsumer(self.ledger, after_commit=self.relay, **batch)
            return self._consumer

    def trainer(self) -> TrainerService:
        with self._lock:
            if self._trainer is None:
                from refill.trainer.service import TrainerService

                self._trainer = TrainerService(
                    self.ledger, trainer_id=self.worker_name, after_commit=self.relay
                )
            return self._trainer

    def send_results(self, bodies: list[dict]) -> None:
        """Send results to the consumers; returns once they are on the broker (the caller's
        generate message is acknowledged after this, so a crash never loses a result that
        was not sent). Results that finish together go out as one message (ResultSender)."""
        with self._lock:
            if self._sender is None:
                self._sender = ResultSender(self.app)
        self._sender.send_many(bodies)

    def close(self) -> None:
        for part in (self._generation, self._consumer, self._trainer):
            if part is not None:
                part.close()
        if self._sender is not None:
            self._sender.close()
        self.ledger.dispose()


#: Results per `record_result` message at most, and their estimated JSON bytes at most.
BUNDLE_MAX_RESULTS = 64
BUNDLE_MAX_BYTES = 8 * 2**20
#: How long the first result of a bundle waits for others (an engine batch finishes its groups
#: together, so they are usually already there).
BUNDLE_WAIT_MS = 2.0


class ResultSender:
    """Bundles the results a worker process finishes within a few milliseconds into one
    `refill.record_result` message: `{"bundle": [result, ...]}`.

    Each caller blocks until the message holding its result is on the broker, so a generate
    message is still acknowledged only after its result was sent. A bundle is delivered at
    least once like any message; the ledger keys every result by attempt id, so a bundle
    delivered twice records each result once (the repeats are refused as DUPLICATE). A lone
    result goes out as a plain result message, as before bundling.
    """

    def __init__(
        self,
        app: Celery,
        *,
        max_results: int = BUNDLE_MAX_RESULTS,
        max_bytes: int = BUNDLE_MAX_BYTES,
        max_wait_ms: float = BUNDLE_WAIT_MS,
    ) -> None:
        from refill.microbatcher import MicroBatcher

        self.app = app
        self.max_bytes = max_bytes
        self.messages_sent = 0
        self._batcher: MicroBatcher[dict[str, Any], None] = MicroBatcher(
            self._publish, max_batch=max_results, max_wait_ms=max_wait_ms, name="result-sender"
        )

    def send(self, body: dict[str, Any]) -> None:
        self.send_many([body])

    def send_many(self, bodies: list[dict[str, Any]]) -> None:
        """Send these results (a bundle's, finished together); returns once every one of them
        is on the broker, or raises the first sending error."""
        for outcome in self._batcher.submit_many(bodies):
            if isinstance(outcome, BaseException):
                raise outcome

    def _publish(self, bodies: list[dict[str, Any]]) -> list[None]:
        from refill.tasks.queues import RESULTS, TASK_RECORD_RESULT

        messages = []
        current: list[dict[str, Any]] = []
        size = 0
        for body in bodies:
            estimate = estimated_body_bytes(body)
            if current and size + estimate > self.max_bytes:
                messages.append(current)
                current, size = [], 0
            current.append(body)
            size += estimate
        messages.append(current)
        with self.app.producer_or_acquire() as producer:
            for _ in range(chaos.result_copies()):  # 1, or 2 when the fault suite injects duplicates
                for group in messages:
                    self.app.send_task(
                        TASK_RECORD_RESULT,
                        args=[group[0] if len(group) == 1 else {"bundle": group}],
                        queue=RESULTS,
                        routing_key=RESULTS,
                        serializer="json",
                        producer=producer,
                        # What the logs show of the message; Celery would otherwise repr the
                        # whole payload (every token and log-prob) for each message it sends.
                        argsrepr=f"[results of attempts {','.join(str(b.get('attempt_id')) for b in group)}]",
                        kwargsrepr="{}",
                    )
                    self.messages_sent += 1
        return [None] * len(bodies)

    def close(self) -> None:
        self._batcher.close(timeout=30)


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
