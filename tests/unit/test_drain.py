"""`refill.drain.Drain`: the consumer's after-commit work on a thread of its own."""

from __future__ import annotations

import logging
import threading

from refill.drain import Drain


def test_what_piles_up_while_the_thread_is_busy_is_handled_in_one_call_in_order() -> None:
    calls: list[list[int]] = []
    started, release = threading.Event(), threading.Event()

    def handle(items: list[int]) -> None:
        calls.append(items)
        started.set()
        release.wait(10)

    drain: Drain[int] = Drain(handle, name="test-drain")
    drain.submit([1])
    assert started.wait(10)
    drain.submit([2, 3])
    drain.submit([4])
    assert not drain.flush(0.05)  # the first call still runs
    release.set()
    assert drain.flush(10)
    drain.close(10)
    assert calls == [[1], [2, 3, 4]]


def test_a_handler_that_raises_is_logged_and_the_next_items_are_handled(caplog) -> None:  # type: ignore[no-untyped-def]
    seen: list[int] = []

    def handle(items: list[int]) -> None:
        if items == [0]:
            raise RuntimeError("boom")
        seen.extend(items)

    drain: Drain[int] = Drain(handle, name="test-drain")
    with caplog.at_level(logging.ERROR, logger="refill.drain"):
        drain.submit([0])
        assert drain.flush(10)
        drain.submit([1, 2])
        assert drain.flush(10)
    drain.close(10)
    assert seen == [1, 2]
    assert any("test-drain: handling 1 items failed" in r.getMessage() for r in caplog.records)


def test_close_handles_what_is_waiting_then_ends_the_thread() -> None:
    seen: list[int] = []
    gate = threading.Event()

    def handle(items: list[int]) -> None:
        gate.wait(10)
        seen.extend(items)

    drain: Drain[int] = Drain(handle, name="test-drain")
    drain.submit([1])
    drain.submit([2])
    gate.set()
    drain.close(10)
    assert seen == [1, 2]
    assert not drain._thread.is_alive()
