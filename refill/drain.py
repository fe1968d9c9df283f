"""A drain: work handed to a thread of its own, everything waiting taken at once.

The consumer moves two pieces of work off its serial stage, to be done after a batch commits:
removing the payloads the batch discarded (`refill.models.payload_store.Remover`) and relaying
what it left to send (`refill.tasks.consumer`). The consumer never waits for either, and what
piles up while the thread is busy is handled together: the new attempts of several batches go
out in one relay transaction. A drain keeps nothing durable: what it has not handled when
the process dies, the controller finds (its payload sweep, its own relay).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")


class Drain(Generic[Item]):
    """Calls `handle` on its own thread with every item submitted since its last call, in the
    order submitted. `handle` deals with the failures it expects; anything else it raises is
    logged and the thread goes on with the next items."""

    def __init__(self, handle: Callable[[list[Item]], None], *, name: str) -> None:
        self._handle = handle
        self._name = name
        self._pending: list[Item] = []
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Iterable[Item]) -> None:
        with self._cond:
            self._pending.extend(items)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until what was submitted so far is handled; False if that took over `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Handle what is waiting, then end the thread (waiting at most `timeout` for it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                work, self._pending = self._pending, []
                self._busy = True
            try:
                self._handle(work)
            except Exception:
                # A thread that died here would leave every later submission waiting forever.
                log.exception("%s: handling %d items failed", self._name, len(work))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
