"""The generation worker's lease keeper beats once per interval, not once per lease taken
(issue 7: a beat per handshake doubled the worker's transactions)."""

from __future__ import annotations

import time

from refill.models.leases import Lease
from refill.tasks.generation import LeaseKeeper


class FakeLedger:
    def __init__(self) -> None:
        self.beats: list[float] = []

    def transaction(self, fn, what: str = ""):  # type: ignore[no-untyped-def]
        self.beats.append(time.monotonic())
        return set()


def test_taking_leases_does_not_cost_a_beat_each() -> None:
    ledger = FakeLedger()
    keeper = LeaseKeeper(ledger, "w")  # type: ignore[arg-type]
    try:
        for attempt_id in range(50):
            keeper.hold(Lease(attempt_id, 1, 0, 3.0), heartbeat_seconds=0.3)
        time.sleep(0.15)
        assert ledger.beats == []  # leases just taken are fresh
        time.sleep(0.5)
        assert 1 <= len(ledger.beats) <= 3  # one per 0.3 s interval
    finally:
        keeper.close()
