"""Fault injection: knobs, read from the environment, that make a fleet process misbehave on
purpose.

They exist to prove the fleet's guarantees (no committed group lost, none trained twice, no
hang) in the fault-injection suite, `tests/faults/`. **Never set them in production**: each
one makes a healthy process do something a broken one would. A process that reads a knob
set says so in its log at WARNING level when its runtime is built.

| variable | read by | what it does |
| --- | --- | --- |
| `REFILL_CHAOS_DUPLICATE_RESULTS=1` | generation worker | sends every result message twice |
| `REFILL_CHAOS_WORKER_HOLD_AFTER_STORING=N` | generation worker | once N payloads are stored, every further attempt stores its payload and then holds its result, unsent, forever (log line `chaos: holding the result of attempt ... after storing its payload`); the suite SIGKILLs the worker there to prove the payload is swept and the attempt retried |
| `REFILL_CHAOS_CONSUMER_HANG_AFTER_RESULTS=N` | results consumer | once N results are recorded, the next batch is written into its transaction and then held there, uncommitted, forever (log line `chaos: holding ... uncommitted`); the suite SIGKILLs the consumer there to prove the batch rolls back and its messages come back |
| `REFILL_CHAOS_CLOCK_OFFSET_SECONDS=S` | any worker | shifts the process's own clock (`refill.models.clock.utcnow`) by S seconds, as on a machine whose clock is off; the suite proves that no lease or time-out is decided on it |

Malformed generation output (wrong group size, oversized payloads) is injected through the
`sim` back-end's own knobs (`generation.sim.wrong_group_size_rate`,
`generation.sim.oversized_rate`), since that back-end exists for tests.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from refill.models.clock import set_clock_offset

log = logging.getLogger(__name__)

DUPLICATE_RESULTS = "REFILL_CHAOS_DUPLICATE_RESULTS"
CONSUMER_HANG_AFTER_RESULTS = "REFILL_CHAOS_CONSUMER_HANG_AFTER_RESULTS"
CLOCK_OFFSET_SECONDS = "REFILL_CHAOS_CLOCK_OFFSET_SECONDS"
WORKER_HOLD_AFTER_STORING = "REFILL_CHAOS_WORKER_HOLD_AFTER_STORING"
KNOBS = (DUPLICATE_RESULTS, CONSUMER_HANG_AFTER_RESULTS, CLOCK_OFFSET_SECONDS, WORKER_HOLD_AFTER_STORING)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _count(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def announce() -> None:
    """Warn, once per process, about every knob that is set; apply the clock's offset."""
    for name in KNOBS:
        if os.environ.get(name, "").strip():
            log.warning("chaos: %s=%s is set; this process injects faults (never in production)",
                        name, os.environ[name])
    offset = os.environ.get(CLOCK_OFFSET_SECONDS, "").strip()
    if offset:
        try:
            set_clock_offset(float(offset))
        except ValueError as error:
            raise ValueError(f"{CLOCK_OFFSET_SECONDS} must be a number of seconds, got {offset!r}") from error


def result_copies() -> int:
    """How many times a generation worker sends each result (1 unless injecting duplicates)."""
    return 2 if _flag(DUPLICATE_RESULTS) else 1


class WorkerChaos:
    """The generation worker's hook: called after an attempt's payload is stored, before its
    result is sent."""

    def __init__(self) -> None:
        self.hold_after = _count(WORKER_HOLD_AFTER_STORING)
        self.stored = 0
        self._lock = threading.Lock()

    def after_storing(self, attempt_id: int) -> None:
        if self.hold_after is None:
            return
        with self._lock:
            self.stored += 1
            hold = self.stored > self.hold_after
        if hold:
            log.error("chaos: holding the result of attempt %s after storing its payload", attempt_id)
            threading.Event().wait()  # until the process is killed


class ConsumerChaos:
    """The consumer's hook: called inside the batch's transaction, after it was written."""

    def __init__(self) -> None:
        self.hang_after = _count(CONSUMER_HANG_AFTER_RESULTS)
        self.recorded = 0

    def before_commit(self, attempt_ids: Sequence[int]) -> None:
        if self.hang_after is None:
            return
        if self.recorded >= self.hang_after and attempt_ids:
            log.error(
                "chaos: holding a batch of %d results uncommitted (attempts %s)",
                len(attempt_ids),
                ",".join(str(a) for a in attempt_ids),
            )
            threading.Event().wait()  # until the process is killed
        self.recorded += len(attempt_ids)
