"""`python -m bench overhead --parts`: where a batch of results spends its time, part by part.

The record phase's transactions, split into the parts every batch goes through
(`refill.models.results.record_results`), each timed by wall clock and by this process's CPU:

lock     `RunContext.open`: the run's row locked and read, its settings, the batch's context
read     `results._read_batch`: the joint read of what the batch's decisions look up
decide   `results._record_one` for each result and `overdispatch.top_up`: the decisions (any
         read they make on the way, and the step's release in the last batch, included)
write    `RunContext.__exit__`: the batch's changed and new rows written
rest     the record phase's other time: decoding the results, the commit, the payloads removed

A part's wall time less its CPU time is time this process waited: on the server, the network,
or a core. The wrappers cost about a microsecond a call (one per result for `decide`).

Why it is here: cProfile weighs every Python call several times over, and it showed the small
functions of the decisions (a row's attribute set, an enum's value) as the cost; timed whole, a
batch's parts say instead that it waits on the server for its write about as long as it decides
(bench/HISTORY.md, stop 48).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PARTS = ("lock", "read", "decide", "write")


class Parts:
    """Wall and CPU seconds and calls of each part, over one round."""

    def __init__(self, counting: Callable[[], bool] = lambda: True) -> None:
        #: whether a call now belongs to the record phase (admission locks and writes too)
        self.counting = counting
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def _timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.counting():
                return fn(*args, **kwargs)
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[part] += time.perf_counter() - wall
                self.cpu[part] += time.process_time() - cpu
                self.calls[part] += 1

        return timed

    @contextmanager
    def installed(self) -> Iterator[Parts]:
        """Time the parts while in the block (the functions wrapped where `record_results`
        finds them, and put back after)."""
        from refill.models import results
        from refill.models.context import RunContext

        patches: list[tuple[Any, str, Any]] = [
            (RunContext, "open", ("lock", True)),
            (results, "_read_batch", ("read", False)),
            (results, "_record_one", ("decide", False)),
            (results, "top_up", ("decide", False)),
            (RunContext, "__exit__", ("write", False)),
        ]
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
        try:
            for owner, name, (part, is_classmethod) in patches:
                found = getattr(owner, name)
                wrapped = self._timed(part, found)
                # A classmethod found on its class is bound to it already.
                setattr(owner, name, staticmethod(wrapped) if is_classmethod else wrapped)
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


def print_parts(rounds: list[tuple[Parts, float, float, int]]) -> None:
    """Each part's medians over `rounds`: (its parts, the record transactions' wall and CPU
    seconds, and their number) of each round."""
    batches = statistics.median(n for *_, n in rounds) or 1
    print(
        "the record phase by part (median of rounds; --parts): wall s, this process's CPU s, "
        "waited s (wall - CPU: the server, the network), and per batch ms"
    )
    print(f"  {'part':8}{'wall s':>9}{'CPU s':>9}{'waited s':>10}{'wall ms/batch':>15}{'waited ms/batch':>17}")

    def line(name: str, wall: float, cpu: float) -> None:
        print(f"  {name:8}{wall:9.3f}{cpu:9.3f}{wall - cpu:10.3f}{wall / batches * 1000:15.2f}{(wall - cpu) / batches * 1000:17.2f}")

    for part in PARTS:
        line(part, statistics.median(p.wall[part] for p, *_ in rounds), statistics.median(p.cpu[part] for p, *_ in rounds))
    line(
        "rest",
        statistics.median(wall - sum(p.wall.values()) for p, wall, _, _ in rounds),
        statistics.median(cpu - sum(p.cpu.values()) for p, _, cpu, _ in rounds),
    )
