from __future__ import annotations

import threading
import time

import pytest

from refill.microbatcher import BatcherClosed, MicroBatcher
from refill.models.payload import Completion, GenerationRequest
from refill.tasks.backends.base import GenerationOutput
from refill.tasks.backends.engine_batching import BatchingEngine, StaleWeightsError


def request(attempt_id: int, min_weight_version: int = 0) -> GenerationRequest:
    return GenerationRequest(
        attempt_id=attempt_id,
        prompt=f"prompt {attempt_id}",
        row={},
        n=2,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=4,
        seed=attempt_id,
        min_weight_version=min_weight_version,
    )


class RecordingEngine:
    """An engine that remembers its calls and checks it is never re-entered."""

    def __init__(
        self, delay: float = 0.02, bad: set[int] | None = None, crash_on: int | None = None
    ):
        self.weight_version: int | None = None
        self.delay = delay
        self.bad = bad or set()
        self.crash_on = crash_on
        self.calls: list[list[int]] = []
        self.events: list[tuple[str, object]] = []
        self._busy = threading.Lock()
        self.overlaps = 0
        self.closed = False

    def generate(self, requests):
        if not self._busy.acquire(blocking=False):
            self.overlaps += 1
            self._busy.acquire()
        try:
            ids = [r.attempt_id for r in requests]
            self.calls.append(ids)
            self.events.append(("generate-start", self.weight_version))
            if self.crash_on is not None and self.crash_on in ids:
                raise RuntimeError("CUDA error: device-side assert triggered")
            time.sleep(self.delay)
            out = []
            for r in requests:
                if r.attempt_id in self.bad:
                    out.append(ValueError(f"bad request {r.attempt_id}"))
                else:
                    out.append(
                        GenerationOutput(
                            prompt_token_ids=[r.attempt_id],
                            completions=[Completion([r.attempt_id], [-0.1], str(r.attempt_id))],
                        )
                    )
            self.events.append(("generate-end", self.weight_version))
            return out
        finally:
            self._busy.release()

    def load_weights(self, version, path):
        if not self._busy.acquire(blocking=False):
            self.overlaps += 1
            self._busy.acquire()
        try:
            self.events.append(("load", version))
            time.sleep(0.005)
            self.weight_version = version
        finally:
            self._busy.release()

    def close(self):
        self.closed = True


def run_threads(target, count):
    results: dict[int, object] = {}
    barrier = threading.Barrier(count)

    def worker(i):
        barrier.wait()
        try:
            results[i] = target(i)
        except Exception as exc:  # noqa: BLE001 - the test inspects what each caller got
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_sixteen_threads_share_few_engine_calls_and_get_their_own_results():
    engine = RecordingEngine()
    with BatchingEngine(engine, max_batch=8, max_wait_ms=50) as batching:
        results = run_threads(lambda i: batching.submit(request(i)), 16)
    assert len(engine.calls) < 16
    assert max(len(c) for c in engine.calls) > 1
    assert sorted(a for call in engine.calls for a in call) == list(range(16))
    for i, out in results.items():
        assert isinstance(out, GenerationOutput)
        assert out.prompt_token_ids == [i]
        assert out.completions[0].text == str(i)
        assert out.generation_seconds is not None and out.generation_seconds > 0
    assert engine.overlaps == 0
    assert engine.closed


def test_one_bad_request_fails_alone():
    engine = RecordingEngine(bad={5})
    with BatchingEngine(engine, max_batch=16, max_wait_ms=50) as batching:
        results = run_threads(lambda i: batching.submit(request(i)), 8)
    assert isinstance(results[5], ValueError) and "bad request 5" in str(results[5])
    assert all(isinstance(results[i], GenerationOutput) for i in range(8) if i != 5)


def test_an_engine_crash_fails_the_whole_batch_and_the_engine_thread_survives():
    engine = RecordingEngine(crash_on=3, delay=0.0)
    batching = BatchingEngine(engine, max_batch=16, max_wait_ms=100)
    try:
        results = run_threads(lambda i: batching.submit(request(i)), 6)
        crashed_batch = next(c for c in engine.calls if 3 in c)
        for i in crashed_batch:
            assert isinstance(results[i], RuntimeError) and "CUDA" in str(results[i])
        # Later batches still run.
        assert isinstance(batching.submit(request(100)), GenerationOutput)
    finally:
        batching.close()


def test_weights_load_between_batches_never_during():
    engine = RecordingEngine(delay=0.01)
    published = {"version": 0}
    asked: list[int] = []

    def provider(needed):
        asked.append(needed)
        v = published["version"]
        return v, f"/weights/v{v:06d}"

    with BatchingEngine(engine, max_batch=4, max_wait_ms=5, weights_provider=provider) as batching:
        assert batching.submit(request(0)).weight_version == 0
        published["version"] = 1

        def call(i):
            if i == 7:
                published["version"] = 2
            return batching.submit(request(10 + i, min_weight_version=1))

        results = run_threads(call, 12)
    assert engine.overlaps == 0
    loads = [v for kind, v in engine.events if kind == "load"]
    assert loads[0] == 0 and loads[-1] == 2 and loads == sorted(set(loads))
    # Each load sits between a generate-end and the next generate-start.
    for i, (kind, _) in enumerate(engine.events):
        if kind == "load" and i > 0:
            assert engine.events[i - 1][0] in ("generate-end", "load")
    # A generate never saw its weight version change under it.
    for start, end in zip(engine.events[::1], engine.events[1::1], strict=False):
        if start[0] == "generate-start":
            assert end == ("generate-end", start[1])
    for out in results.values():
        assert isinstance(out, GenerationOutput) and out.weight_version in (1, 2)
    assert max(asked) == 1


def test_a_request_needing_unpublished_weights_fails_as_stale_others_run():
    engine = RecordingEngine(delay=0.0)
    with BatchingEngine(
        engine, max_batch=8, max_wait_ms=50, weights_provider=lambda needed: (1, "/w1")
    ) as b:
        results = run_threads(
            lambda i: b.submit(request(i, min_weight_version=3 if i == 2 else 1)), 4
        )
    assert isinstance(results[2], StaleWeightsError)
    assert "needs weight version >= 3" in str(results[2])
    assert all(isinstance(results[i], GenerationOutput) for i in (0, 1, 3))
    assert all(2 not in call for call in engine.calls)


def test_a_failing_weights_provider_fails_the_batch():
    def provider(needed):
        raise ConnectionError("ledger unreachable")

    engine = RecordingEngine()
    with BatchingEngine(engine, weights_provider=provider) as b:
        with pytest.raises(ConnectionError):
            b.submit(request(1))
    assert engine.calls == []


def test_microbatcher_is_generic_and_drains_on_close():
    seen: list[list[int]] = []

    def process(batch):
        seen.append(list(batch))
        time.sleep(0.01)
        return [x * 10 for x in batch]

    batcher: MicroBatcher[int, int] = MicroBatcher(process, max_batch=3, max_wait_ms=30)
    futures = [batcher.submit_future(i) for i in range(7)]
    batcher.close(timeout=5)
    assert [f.result() for f in futures] == [i * 10 for i in range(7)]
    assert all(len(b) <= 3 for b in seen)
    with pytest.raises(BatcherClosed):
        batcher.submit(1)


def test_microbatcher_close_without_drain_fails_queued_items():
    entered, gate = threading.Event(), threading.Event()

    def process(batch):
        entered.set()
        gate.wait(5)
        return batch

    batcher = MicroBatcher(process, max_batch=1, max_wait_ms=0)
    first = batcher.submit_future(1)
    assert entered.wait(5)  # the worker is now inside process([1])
    queued = batcher.submit_future(2)
    closer = threading.Thread(target=batcher.close, kwargs={"drain": False})
    closer.start()
    while not batcher.closed:
        time.sleep(0.001)
    gate.set()
    closer.join(5)
    assert first.result(1) == 1
    with pytest.raises(BatcherClosed):
        queued.result(1)


def test_microbatcher_rejects_a_wrong_number_of_results():
    batcher = MicroBatcher(lambda batch: [], max_batch=2, max_wait_ms=0)
    with pytest.raises(RuntimeError, match="0 results for a batch of 1"):
        batcher.submit(5, timeout=5)
    batcher.close()


def test_lone_request_waits_at_most_max_wait():
    batcher = MicroBatcher(lambda batch: batch, max_batch=64, max_wait_ms=20)
    started = time.perf_counter()
    assert batcher.submit("x", timeout=5) == "x"
    assert time.perf_counter() - started < 1.0
    batcher.close()


def test_items_submitted_together_share_a_batch_and_fail_one_by_one():
    """A caller with several items (a generate bundle's attempts) queues them at once: one
    batch holds them all, each result comes back in its place, a failed item as its
    exception, without failing the others."""
    seen: list[list[int]] = []

    def process(batch):
        seen.append(list(batch))
        return [ValueError(f"odd {x}") if x % 2 else x * 10 for x in batch]

    with MicroBatcher(process, max_batch=64, max_wait_ms=0) as batcher:
        out = batcher.submit_many([2, 3, 4, 5])
    assert seen == [[2, 3, 4, 5]]
    assert out[0] == 20 and out[2] == 40
    assert isinstance(out[1], ValueError) and str(out[1]) == "odd 3"
    assert isinstance(out[3], ValueError) and str(out[3]) == "odd 5"


def test_items_submitted_together_are_cut_at_max_batch_and_time_out_together():
    gate = threading.Event()
    seen: list[list[int]] = []

    def process(batch):
        seen.append(list(batch))
        gate.wait(5)
        return batch

    batcher = MicroBatcher(process, max_batch=2, max_wait_ms=0)
    try:
        with pytest.raises(TimeoutError):
            batcher.submit_many([1, 2, 3], timeout=0.2)
        gate.set()
        assert batcher.submit_many([4, 5, 6], timeout=5) == [4, 5, 6]
    finally:
        gate.set()
        batcher.close(timeout=5)
    # The first two went together; the third, dropped when its caller gave up, never ran.
    assert seen[0] == [1, 2] and [3] not in seen
    assert all(len(b) <= 2 for b in seen)
