"""One engine, many groups in flight: the engine-side wrapper around ``refill.microbatcher.MicroBatcher``.

A generation worker runs a Celery ``threads`` pool; each thread handles one generate message
(a bundle of attempts) and calls ``BatchingEngine.submit_many(requests)`` (``submit`` for one),
which blocks until those groups are generated. A single engine
thread gathers whatever requests are waiting and calls ``engine.generate`` once for all of them,
so the GPU sees a batch instead of one group at a time.

Weights are handed over on the engine thread, between batches: before each batch it asks
``weights_provider(min_version_needed)`` for the newest version the worker may use and, when that
is newer than what the engine holds, calls ``engine.load_weights``. Since the same thread runs
``generate``, a load can never overlap a generation. A request whose ``min_weight_version`` is
still above what the engine holds after that fails alone with ``StaleWeightsError`` (an infra
failure, retried later) rather than being generated with weights it may not use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from refill.microbatcher import BatcherClosed, MicroBatcher
from refill.models.payload import GenerationRequest
from refill.tasks.backends.base import Engine, EngineError, GenerationOutput, engine_config

log = logging.getLogger(__name__)

#: ``weights_provider(min_version_needed)`` returns the newest weight version this worker may
#: load and its published directory, or ``None`` when it knows of none. A ``None`` path means
#: "nothing to load for this version" (version 0 being the model the engine was built from).
WeightsProvider = Callable[[int], "tuple[int, str | None] | None"]


class StaleWeightsError(EngineError):
    """The engine cannot get a weight version as new as the request requires."""


class BatchingEngine:
    """Thread-safe front of an ``Engine``: ``submit`` from many threads, one ``generate`` per batch."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 16,
        max_wait_ms: float = 10.0,
        weights_provider: WeightsProvider | None = None,
        name: str = "engine",
    ) -> None:
        self.engine = engine
        self.weights_provider = weights_provider
        self._batcher: MicroBatcher[GenerationRequest, GenerationOutput] = MicroBatcher(
            self._process, max_batch=max_batch, max_wait_ms=max_wait_ms, name=name
        )

    @classmethod
    def from_config(
        cls, engine: Engine, config: Any, weights_provider: WeightsProvider | None = None
    ) -> BatchingEngine:
        """``generation.groups_in_flight`` groups per engine call at most, gathered for at most
        ``generation.max_batch_wait_ms`` after the first one arrives."""
        generation = engine_config(config).generation
        return cls(
            engine,
            max_batch=generation.groups_in_flight,
            max_wait_ms=generation.max_batch_wait_ms,
            weights_provider=weights_provider,
        )

    @property
    def weight_version(self) -> int | None:
        return self.engine.weight_version

    @property
    def batches_processed(self) -> int:
        return self._batcher.batches_processed

    def submit(self, request: GenerationRequest, timeout: float | None = None) -> GenerationOutput:
        """Generate one group; blocks the calling thread. Raises that request's exception."""
        return self._batcher.submit(request, timeout=timeout)

    def submit_many(self, requests: list[GenerationRequest]) -> list[GenerationOutput | BaseException]:
        """Generate several groups submitted together (a bundle's); blocks the calling thread.
        Each request's output, or its exception in its place."""
        return self._batcher.submit_many(requests)

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued, stop the engine thread, then close the engine."""
        try:
            self._batcher.close(timeout)
        finally:
            self.engine.close()

    def __enter__(self) -> BatchingEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ engine thread

    def _refresh_weights(self, needed: int) -> None:
        if self.weights_provider is None:
            return
        offer = self.weights_provider(needed)
        if offer is None:
            return
        version, path = offer
        current = self.engine.weight_version
        if current is None or version > current:
            log.info("loading weight version %s from %s (had %s)", version, path, current)
            self.engine.load_weights(version, path)

    def _process(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        # A provider or load failure propagates: every request of the batch fails as infra.
        self._refresh_weights(max(r.min_weight_version for r in requests))
        version = self.engine.weight_version
        results: list[GenerationOutput | Exception | None] = [None] * len(requests)
        runnable: list[int] = []
        for i, request in enumerate(requests):
            if self.weights_provider is not None and (
                version is None or version < request.min_weight_version
            ):
                results[i] = StaleWeightsError(
                    f"attempt {request.attempt_id} needs weight version >= "
                    f"{request.min_weight_version}; this worker holds {version} and no newer one "
                    "is published"
                )
            else:
                runnable.append(i)
        if runnable:
            started = time.perf_counter()
            outputs = self.engine.generate([requests[i] for i in runnable])
            elapsed = time.perf_counter() - started
            if len(outputs) != len(runnable):
                raise EngineError(
                    f"the engine returned {len(outputs)} outputs for {len(runnable)} requests"
                )
            for i, output in zip(runnable, outputs, strict=True):
                if isinstance(output, GenerationOutput):
                    output.weight_version = version
                    if output.generation_seconds is None:
                        output.generation_seconds = elapsed
                results[i] = output
        return results  # type: ignore[return-value]


__all__ = ["BatchingEngine", "BatcherClosed", "StaleWeightsError", "WeightsProvider"]
