"""Workers bundle results that finish together into one `record_result` message (issue 7)."""

from __future__ import annotations

import threading
from typing import Any

from refill.tasks import chaos
from refill.tasks.runtime import ResultSender, estimated_body_bytes


class FakeApp:
    """What ResultSender uses of a Celery app: a producer and send_task."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def producer_or_acquire(self):  # type: ignore[no-untyped-def]
        from contextlib import nullcontext

        return nullcontext(object())

    def send_task(self, name: str, *, args: list[Any], **options: Any) -> None:
        assert name == "refill.record_result" and options["serializer"] == "json"
        with self.lock:
            self.sent.append(args[0])


def result(attempt_id: int, text: str = "ok") -> dict[str, Any]:
    return {
        "run_id": 1,
        "attempt_id": attempt_id,
        "worker": "w",
        "weight_version": 0,
        "prompt_token_ids": [1, 2],
        "completions": [{"token_ids": [3], "logprobs": [-0.1], "text": text}],
        "rewards": [1.0],
    }


def results_in(messages: list[dict[str, Any]]) -> list[int]:
    out = []
    for body in messages:
        out.extend(r["attempt_id"] for r in body.get("bundle", [body]))
    return sorted(out)


def test_results_sent_together_share_a_message_and_each_caller_returns_after_it_is_sent() -> None:
    app = FakeApp()
    sender = ResultSender(app, max_wait_ms=50)  # type: ignore[arg-type]
    threads = [threading.Thread(target=sender.send, args=(result(i),)) for i in range(20)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        # Every caller returned, so every result is on the "broker".
        assert results_in(app.sent) == list(range(20))
        assert len(app.sent) < 20
        assert all("bundle" in body for body in app.sent if body.get("attempt_id") is None)
    finally:
        sender.close()


def test_a_lone_result_goes_out_as_a_plain_result_message() -> None:
    app = FakeApp()
    sender = ResultSender(app, max_wait_ms=0)  # type: ignore[arg-type]
    try:
        sender.send(result(7))
    finally:
        sender.close()
    assert app.sent == [result(7)]


def test_bundles_are_cut_at_the_byte_budget() -> None:
    app = FakeApp()
    big = result(1, text="x" * 1000)
    sender = ResultSender(app, max_bytes=2 * estimated_body_bytes(big), max_wait_ms=0)  # type: ignore[arg-type]
    try:
        sender._publish([result(i, text="x" * 1000) for i in range(5)])
    finally:
        sender.close()
    assert [len(body.get("bundle", [body])) for body in app.sent] == [2, 2, 1]
    assert results_in(app.sent) == list(range(5))


def test_the_fault_suite_duplicates_whole_bundles(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(chaos.DUPLICATE_RESULTS, "1")
    app = FakeApp()
    sender = ResultSender(app, max_wait_ms=0)  # type: ignore[arg-type]
    try:
        sender._publish([result(1), result(2)])
    finally:
        sender.close()
    assert app.sent == [{"bundle": [result(1), result(2)]}] * 2


def test_a_result_message_serialises_as_dataclasses_would() -> None:
    from dataclasses import asdict

    from refill.models.payload import Completion, ResultMessage

    message = ResultMessage(
        run_id=1, attempt_id=2, worker="w", weight_version=3, prompt_token_ids=[1, 2],
        completions=[Completion([4, 5], [-0.5, -0.25], "text", "length")], rewards=[0.5],
        error_kind="data", error="why", generation_seconds=1.5,
    )
    assert message.to_json() == asdict(message)
    assert ResultMessage.from_json(message.to_json()) == message
