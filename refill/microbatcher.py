"""A micro-batcher: many threads submit items, one worker thread processes them in batches.

Two parts of refill need the same shape of concurrency:

- a generation worker runs a Celery ``threads`` pool, one prompt group per thread, in front of a
  single engine that is far faster per token when it sees many groups at once;
- the results consumer commits several results per ledger transaction, amortising the lock on
  the run row.

In both, callers want a blocking call that returns *their own* result, while the expensive step
sees a batch. ``MicroBatcher[Req, Res]`` does exactly that and nothing domain-specific: it gathers
whatever is waiting (up to ``max_batch`` items, waiting at most ``max_wait_ms`` after the first
one for more), calls ``process(batch)`` once from its own thread, and routes result ``i`` back to
the caller of item ``i``.

``process`` returns one entry per item; an entry that is an exception fails that item only. If
``process`` itself raises, every item of the batch fails with that exception: a crashed engine or
a failed transaction is a failure of the whole batch, and the callers decide how to report it.

Because ``process`` runs on a single thread, anything done inside it (loading weights between two
engine calls, say) can never overlap another batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Res = TypeVar("Res")


class BatcherClosed(RuntimeError):
    """The batcher was closed before (or while) the item could be processed."""


class MicroBatcher(Generic[Req, Res]):
    """Gather items submitted from many threads and process them in batches on one thread.

    ``process(batch) -> results`` must return a sequence of the same length as ``batch``; an
    entry that is a ``BaseException`` is raised in the submitting thread instead of returned.
    """

    def __init__(
        self,
        process: Callable[[list[Req]], Sequence[Res | BaseException]],
        *,
        max_batch: int = 16,
        max_wait_ms: float = 5.0,
        name: str = "microbatcher",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be non-negative, not {max_wait_ms}")
        self._process = process
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self._pending: deque[tuple[Req, Future]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._drain = True
        self.batches_processed = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers' side

    def submit_future(self, item: Req) -> Future:
        """Queue ``item`` and return a Future for its result (never blocks)."""
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise BatcherClosed("the batcher is closed and takes no new items")
            self._pending.append((item, future))
            self._cond.notify()
        return future

    def submit_many(self, items: Sequence[Req], timeout: float | None = None) -> list[Res | BaseException]:
        """Queue ``items`` together and block until each was processed; return their results
        in order, an item's exception in its place instead of raised.

        The items are queued under one lock and the caller wakes once per batch that holds
        them, where a thread per item would each hand its item over and be woken for it: a
        caller with several items of its own (a bundle of attempts) pays one hand-over.
        On ``timeout`` (for all of them) a ``TimeoutError`` is raised and the items not yet
        processed are dropped as ``submit`` drops one.
        """
        futures: list[Future] = [Future() for _ in items]
        with self._cond:
            if self._closing:
                raise BatcherClosed("the batcher is closed and takes no new items")
            self._pending.extend(zip(items, futures, strict=True))
            self._cond.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Res | BaseException] = []
        for future in futures:
            try:
                error = future.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout as exc:
                for pending in futures:
                    pending.cancel()
                raise TimeoutError(f"no result within {timeout} s") from exc
            out.append(future.result() if error is None else error)
        return out

    def submit(self, item: Req, timeout: float | None = None) -> Res:
        """Queue ``item``, block until its batch is processed, return its result or raise.

        On ``timeout`` a ``TimeoutError`` is raised; the item may still be processed later and
        its result is then dropped (the batch it joined is not delayed for it).
        """
        future = self.submit_future(item)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout as exc:
            # Leaving it queued but cancelled means the worker skips it if it has not started.
            future.cancel()
            raise TimeoutError(f"no result within {timeout} s") from exc

    def close(self, timeout: float | None = None, *, drain: bool = True) -> None:
        """Stop taking items; process (``drain=True``) or fail what is queued; join the worker.

        The batch being processed when ``close`` is called always finishes: interrupting an
        engine mid-batch would lose work that is already paid for.
        """
        with self._cond:
            self._closing = True
            self._drain = drain
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the batcher's worker did not stop within {timeout} s")

    @property
    def closed(self) -> bool:
        return self._closing

    def __enter__(self) -> MicroBatcher[Req, Res]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ worker side

    def _take_batch(self) -> list[tuple[Req, Future]] | None:
        """Block for the next batch; ``None`` once closed with nothing left to do."""
        with self._cond:
            while not self._pending:
                if self._closing:
                    return None
                self._cond.wait()
            if self._closing and not self._drain:
                failed = list(self._pending)
                self._pending.clear()
                for _, future in failed:
                    if future.set_running_or_notify_cancel():
                        future.set_exception(
                            BatcherClosed("the batcher closed before this item ran")
                        )
                return None
            # The wait starts at the first item: a lone request pays at most max_wait, and a
            # burst is cut at max_batch without waiting at all.
            deadline = time.monotonic() + self.max_wait_s
            while len(self._pending) < self.max_batch and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch = []
            while self._pending and len(batch) < self.max_batch:
                batch.append(self._pending.popleft())
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            # Items whose callers gave up (cancelled futures) are not worth engine time.
            live = [(item, fut) for item, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            items = [item for item, _ in live]
            try:
                results = self._process(items)
                if len(results) != len(items):
                    raise RuntimeError(
                        f"process() returned {len(results)} results for a batch of {len(items)}"
                    )
            except BaseException as exc:  # noqa: BLE001 - routed to every caller of the batch
                log.warning("batch of %d failed as a whole: %r", len(items), exc)
                for _, future in live:
                    future.set_exception(exc)
                if not isinstance(exc, Exception):
                    # KeyboardInterrupt/SystemExit: the callers are told, then the worker stops.
                    self._fail_remaining(exc)
                    raise
                continue
            self.batches_processed += 1
            for (_, future), result in zip(live, results, strict=True):
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _fail_remaining(self, exc: BaseException) -> None:
        with self._cond:
            self._closing = True
            remaining = list(self._pending)
            self._pending.clear()
        for _, future in remaining:
            if future.set_running_or_notify_cancel():
                future.set_exception(BatcherClosed(f"the batcher's worker stopped: {exc!r}"))
