"""The worker's side of the claim check at speed (issues 14 and 17): payloads finished together
share one directory fsync, and the sim back-end's numpy arrays are packed as they are."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from refill.microbatcher import MicroBatcher
from refill.models import decisions, payload_store, rollout_codec
from refill.models.payload import PAYLOAD_BUCKET, Completion, GenerationRequest, ResultMessage
from refill.models.payload_store import FileStore
from refill.tasks import claim_checks
from refill.tasks.backends.sim import SimEngine


def _payload(seed: int) -> bytes:
    completions = [Completion([seed, 2, 3], [-0.5, -1.0, -2.0], f"text {seed}")]
    return rollout_codec.pack_payload(rollout_codec.Rollout.build([1], completions), rollout_codec.texts(completions))


@pytest.fixture
def fsyncs(monkeypatch):  # type: ignore[no-untyped-def]
    """Each directory fsync, as the files its directory held when it started (a rename before
    that start is what the fsync makes durable)."""
    calls: list[tuple[str, set[str]]] = []
    real = payload_store.fsync_dir

    def record(path):  # type: ignore[no-untyped-def]
        calls.append((os.path.basename(path), set(os.listdir(path))))
        real(path)

    monkeypatch.setattr(payload_store, "fsync_dir", record)
    return calls


def test_put_many_fsyncs_each_directory_once(tmp_path, fsyncs) -> None:  # type: ignore[no-untyped-def]
    store = FileStore.of_run(tmp_path)
    attempts = [1, 2, 3, PAYLOAD_BUCKET + 1, PAYLOAD_BUCKET + 2]
    payloads = [_payload(i) for i in range(len(attempts))]
    refs = store.put_many(list(zip(attempts, payloads, strict=True)))
    assert [store.read(ref) for ref in refs] == payloads
    assert sorted(bucket for bucket, _ in fsyncs) == ["0", "1"]
    for ref in refs:
        bucket, base = ref.name.split("/")
        assert any(b == bucket and base in present for b, present in fsyncs)
    assert not [n for _, n in store.listing() if n.rsplit("/", 1)[1].startswith(".")]
    assert store.put_many([]) == []


def test_a_staged_payload_is_not_in_the_store_until_published(tmp_path, fsyncs) -> None:  # type: ignore[no-untyped-def]
    store = FileStore.of_run(tmp_path)
    staged = store.stage(7, _payload(7))
    assert not store.path(staged.ref.name).exists()
    # The sweep sees a write in progress, for the attempt that wrote it.
    [(bucket, name)] = list(store.listing())
    assert payload_store.stored_attempt(name) == 7 and fsyncs == []
    store.publish([staged])
    assert store.read(staged.ref) == _payload(7) and len(fsyncs) == 1


def test_claim_checks_finished_together_share_a_directory_fsync(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """As the generation service runs them: each task thread stages its payloads and hands
    them to one publishing batcher; no result comes back before its payload's rename was
    fsynced, and the payloads that wait meanwhile share the next fsync."""
    calls: list[set[str]] = []
    real = payload_store.fsync_dir

    def slow(path):  # type: ignore[no-untyped-def]
        calls.append(set(os.listdir(path)))
        time.sleep(0.05)  # a journal commit, longer than staging the others takes
        real(path)

    monkeypatch.setattr(payload_store, "fsync_dir", slow)
    store = FileStore.of_run(tmp_path)
    settings = SimpleNamespace(group_size=4, vocab_size=100, use_dynamic_sampling=True, zero_variance_tolerance=0.0)
    engine = SimEngine(tokens_per_completion=16)
    publishes = MicroBatcher(claim_checks.publish_batch, max_batch=1024, max_wait_ms=0.0, name="test-publish")
    results: dict[int, object] = {}

    def attempt(attempt_id: int) -> None:
        request = GenerationRequest(attempt_id, f"prompt {attempt_id}", {}, 4, 1.0, 1.0, 64, attempt_id)
        output = engine.generate([request])[0]
        result = ResultMessage(
            run_id=1, attempt_id=attempt_id, worker="w", weight_version=0,
            prompt_token_ids=output.prompt_token_ids, completions=output.completions, rewards=[1.0, 0.0, 0.0, 1.0],
        )
        checked, staged = claim_checks.stage_claim_check(result, store, settings, 10**7)
        publishes.submit((store, staged))
        base = checked.payload.name.split("/")[1]
        # Returned: its payload is in place, and an fsync that started after its rename ran.
        assert store.path(checked.payload.name).exists() and any(base in present for present in calls)
        results[attempt_id] = checked

    try:
        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(1, 33)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        publishes.close(10)
    assert sorted(results) == list(range(1, 33))
    assert all(r.error_kind is None for r in results.values())
    assert len(calls) < 32 / 2  # shared: one fsync per batch, not per payload
    for checked in results.values():
        prompt, completions = rollout_codec.unpack_payload(store.read(checked.payload))
        assert [len(c.token_ids) for c in completions] == checked.lengths == [16] * 4


def test_publish_batches_by_store(tmp_path, fsyncs) -> None:  # type: ignore[no-untyped-def]
    a, b = FileStore(tmp_path / "a"), FileStore(tmp_path / "b")
    staged = [(a, a.stage(1, _payload(1))), (b, b.stage(2, _payload(2))), (a, a.stage(3, _payload(3)))]
    assert claim_checks.publish_batch(staged) == [None] * 3
    assert len(fsyncs) == 2
    assert all(store.read(s.ref) for store, s in staged)


# --- numpy arrays from an engine ----------------------------------------------------------------


def _sim_result(tokens: int = 512, n: int = 16) -> ResultMessage:
    engine = SimEngine(tokens_per_completion=tokens, vocab_size=32_000)
    output = engine.generate([GenerationRequest(9, "what is 2+2?", {}, n, 1.0, 1.0, 10**6, 42)])[0]
    assert isinstance(output.completions[0].token_ids, np.ndarray)
    return ResultMessage(
        run_id=1, attempt_id=9, worker="w", weight_version=0,
        prompt_token_ids=output.prompt_token_ids, completions=output.completions, rewards=[0.0] * n,
    )


def test_numpy_completions_pack_as_their_lists_do() -> None:
    result = _sim_result()
    as_lists = [Completion(c.token_ids.tolist(), c.logprobs.tolist(), c.text, c.finish_reason) for c in result.completions]
    problem, rollout = decisions.checked_payload(result, 16, 32_000)
    assert problem is None and isinstance(rollout.ids, np.ndarray)
    assert rollout.pack() == rollout_codec.Rollout.build(result.prompt_token_ids, as_lists).pack()
    assert rollout.num_tokens == 16 * 512 and rollout.max_token_id() < 32_000
    texts = rollout_codec.texts(result.completions)
    assert rollout_codec.unpack_payload(rollout_codec.pack_payload(rollout, texts)) == (result.prompt_token_ids, as_lists)
    # Equal as the lists they hold (the dataclass's own __eq__ would compare element-wise).
    assert result.completions == as_lists


def test_numpy_completions_travel_inline_as_lists() -> None:
    result = _sim_result(tokens=8, n=4)
    body = json.loads(json.dumps(result.to_json()))
    assert type(body["completions"][0]["token_ids"]) is list
    assert ResultMessage.from_json(body).completions == result.completions


@pytest.mark.parametrize(
    ("token_ids", "problem"),
    [
        (np.array([5, 32_000]), "token id 32000, outside the vocabulary of 32000"),
        (np.array([5, -1]), "token id -1; token ids are non-negative integers"),
        (np.array([True, False]), "token id True; token ids are non-negative integers"),
        (np.array([1.0, 2.0]), "token id 1.0; token ids are non-negative integers"),
        (np.array([1, 2**32]), "above the largest the ledger stores"),
    ],
)
def test_numpy_token_ids_are_checked_as_lists_are(token_ids: np.ndarray, problem: str) -> None:
    completion = Completion(token_ids, np.full(len(token_ids), -1.0), "x")
    result = ResultMessage(
        run_id=1, attempt_id=9, worker="w", weight_version=0,
        prompt_token_ids=[1], completions=[completion], rewards=[0.0],
    )
    found, rollout = decisions.checked_payload(result, 1, None if "ledger stores" in problem else 32_000)
    assert rollout is None and problem in found


def test_numpy_logprobs_are_checked_as_lists_are() -> None:
    for logprobs, problem in [(np.array([-1.0, np.nan]), "log-prob nan"), (np.array([-1.0, 0.5]), "log-prob 0.5")]:
        result = ResultMessage(
            run_id=1, attempt_id=9, worker="w", weight_version=0,
            prompt_token_ids=[1], completions=[Completion(np.array([1, 2]), logprobs, "x")], rewards=[0.0],
        )
        found, rollout = decisions.checked_payload(result, 1, 100)
        assert rollout is None and problem in found
    with pytest.raises(TypeError):
        rollout_codec.Rollout.build([1], [Completion(np.array([1]), np.array(["a"]), "x")])
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        rollout_codec.Rollout.build([1], [Completion(np.array([1, 2]), np.array([-1.0]), "x")])
