"""The claim check's pieces without a ledger (issue 17): the versioned result body, the stored
payload's layout, and the file store a worker writes and the trainer reads."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from refill.models import rollout_codec
from refill.models.payload import (
    MAX_ERROR_CHARS,
    PAYLOAD_BUCKET,
    ClaimCheckResult,
    Completion,
    PayloadError,
    PayloadRef,
    ResultMessage,
    as_list,
    estimated_body_bytes,
    payload_name,
)
from refill.models.payload_store import (
    DamagedPayload,
    FileStore,
    Remover,
    StoredGroup,
    read_groups,
    stored_attempt,
)

NONCE = "0123456789abcdef"


def _group(n: int, tokens: int, seed: int = 0) -> tuple[list[int], list[Completion]]:
    rng = random.Random(seed)
    completions = [
        Completion(
            token_ids=[rng.randrange(150_000) for _ in range(tokens)],
            logprobs=[-rng.random() * 20 for _ in range(tokens)],
            text=f"answer {i} \u00e9\u4e2d " * (tokens // 4 + 1),
            finish_reason=rng.choice(["stop", "length"]),
        )
        for i in range(n)
    ]
    return [rng.randrange(150_000) for _ in range(37)], completions


def _claim(attempt_id: int = 5000, **kw) -> ClaimCheckResult:  # type: ignore[no-untyped-def]
    values = dict(
        run_id=3,
        attempt_id=attempt_id,
        worker="host:123",
        weight_version=2,
        rewards=[1.0, 0.0, 0.25, 0.5],
        payload=PayloadRef(payload_name(attempt_id, NONCE), 1234, "sha256:" + "ab" * 32),
        prompt_length=37,
        lengths=[10, 0, 512, 8192],
        generation_seconds=1.5,
    )
    values.update(kw)
    return ClaimCheckResult(**values)


# --- the result body, version 2 --------------------------------------------------------------


def test_a_claim_check_round_trips_through_json() -> None:
    message = _claim()
    body = json.loads(json.dumps(message.to_json()))
    assert body["v"] == 2 and "completions" not in body and "prompt_token_ids" not in body
    decoded = ResultMessage.from_json(body)
    assert isinstance(decoded, ClaimCheckResult) and decoded == message
    assert decoded.num_tokens == 10 + 512 + 8192
    assert decoded.estimated_bytes() == 1234  # what infra.max_result_bytes bounds: the payload


def test_a_version_1_body_still_decodes_inline() -> None:
    """Consumers are upgraded before workers: the old body (no "v") is what a worker of the
    previous release sends, and it is recorded as before."""
    old = {
        "run_id": 1, "attempt_id": 2, "worker": "w", "weight_version": 0, "prompt_token_ids": [1, 2],
        "completions": [{"token_ids": [3], "logprobs": [-0.1], "text": "t"}], "rewards": [1.0],
    }
    decoded = ResultMessage.from_json(old)
    assert type(decoded) is ResultMessage and decoded.completions[0].token_ids == [3]
    assert ResultMessage.from_json({**old, "v": 1}) == decoded


def test_a_group_the_run_filters_travels_without_a_payload_and_says_why() -> None:
    """A worker does not store a group the run will filter (`unstored`): the body names no
    payload, carries the rewards and lengths the consumer decides on, and round-trips; a claim
    check with a payload writes no `unstored` key (the body is as before)."""
    message = _claim(payload=None, unstored="zero_variance", rewards=[1.0] * 4)
    body = json.loads(json.dumps(message.to_json()))
    assert body["payload"] is None and body["unstored"] == "zero_variance" and body["error_kind"] is None
    decoded = ResultMessage.from_json(body)
    assert isinstance(decoded, ClaimCheckResult) and decoded == message
    assert decoded.estimated_bytes() == 0 and decoded.num_tokens == 10 + 512 + 8192
    assert "unstored" not in _claim().to_json()


def test_a_newer_body_version_is_refused_naming_the_upgrade_order() -> None:
    with pytest.raises(PayloadError, match=r"version 3: this consumer reads versions 1, 2 \(upgrade the consumers before the workers\)"):
        ResultMessage.from_json({**_claim().to_json(), "v": 3})


@pytest.mark.parametrize(
    "ref",
    [
        "../../etc/passwd",
        "/tmp/1/5000.0123456789abcdef.rfp",
        "1/5001.0123456789abcdef.rfp",  # another attempt's
        "2/5000.0123456789abcdef.rfp",  # the wrong bucket
        "1/5000.0123456789abcdef.rfp/../x",
        "1/5000.0123456789ABCDEF.rfp",
        "1/5000.0123.rfp",
    ],
)
def test_a_payload_name_must_be_one_the_store_makes_for_that_attempt(ref: str) -> None:
    """The consumer removes a discarded payload by its name: a body may only name a file of its
    own attempt in its run's store."""
    body = _claim().to_json()
    body["payload"]["ref"] = ref
    with pytest.raises(PayloadError, match="payload name"):
        ResultMessage.from_json(body)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"payload": None}, "neither a payload nor an error"),
        ({"lengths": [1, -1]}, "'lengths' must be a list of non-negative integers"),
        ({"lengths": [1, True]}, "'lengths' must be a list of non-negative integers"),
        ({"prompt_length": "37"}, "'prompt_length' must be a non-negative integer"),
        ({"payload": {"ref": payload_name(5000, NONCE), "bytes": 10}}, "missing field 'checksum'"),
        ({"payload": {"ref": payload_name(5000, NONCE), "bytes": 10, "checksum": "md5:00"}}, "not 'sha256:'"),
        ({"payload": {"ref": payload_name(5000, NONCE), "bytes": -1, "checksum": "sha256:" + "0" * 64}}, "-1 bytes"),
        ({"rewards": "1.0"}, "must be lists"),
        ({"rewards": [0.5, True]}, "reward True is not a number"),
        ({"rewards": [0.5, "1.0"]}, "reward '1.0' is not a number"),
        ({"lengths": [1, 2.0]}, "'lengths' must be a list of non-negative integers"),
        ({"error_kind": "oops"}, "error_kind must be"),
        ({"payload": None, "unstored": "too_big"}, "'unstored' must be null or 'zero_variance'"),
        ({"unstored": "zero_variance"}, "says its group was not stored, but names a payload"),
        ({"payload": None, "unstored": "zero_variance", "error_kind": "data", "error": "x"}, "says its group was not stored"),
    ],
)
def test_a_malformed_claim_check_is_refused(change: dict, problem: str) -> None:
    with pytest.raises(PayloadError, match=problem):
        ResultMessage.from_json({**_claim().to_json(), **change})


def test_a_failure_needs_no_payload_and_its_error_text_is_bounded() -> None:
    failure = ClaimCheckResult(run_id=1, attempt_id=7, worker="w", weight_version=None, error_kind="infra", error="x" * 50_000)
    body = failure.to_json()
    assert len(body["error"]) == MAX_ERROR_CHARS and body["payload"] is None
    decoded = ResultMessage.from_json(json.loads(json.dumps(body)))
    assert isinstance(decoded, ClaimCheckResult) and decoded.error_kind == "infra" and decoded.payload is None


@pytest.mark.parametrize("tokens", [8, 512, 8192])
def test_a_claim_check_body_stays_small_at_any_rollout_length(tokens: int) -> None:
    """16 completions of 8 or 8,192 tokens: the body is the same few hundred bytes, and
    estimated_body_bytes (the ResultSender's bundle budget) is an upper bound of it."""
    rng = random.Random(tokens)
    message = _claim(
        rewards=[rng.random() for _ in range(16)], lengths=[tokens] * 16, worker="generate-worker-17@host-0042:31337"
    )
    encoded = json.dumps(message.to_json())
    assert len(encoded) < 1100
    assert estimated_body_bytes(message.to_json()) >= len(encoded)


def test_estimated_body_bytes_bounds_an_inline_body_too() -> None:
    prompt, completions = _group(4, 100)
    body = ResultMessage(run_id=1, attempt_id=2, worker="w", weight_version=0, prompt_token_ids=prompt,
                         completions=completions, rewards=[0.123456789012345] * 4, error="e" * 300).to_json()
    assert estimated_body_bytes(body) >= len(json.dumps(body))


def test_a_payload_name_is_bucketed_by_attempt() -> None:
    name = payload_name(3 * PAYLOAD_BUCKET + 5, NONCE)
    assert name == f"3/{3 * PAYLOAD_BUCKET + 5}.{NONCE}.rfp"
    assert PayloadRef(name, 0, "sha256:" + "0" * 64).attempt_id == 3 * PAYLOAD_BUCKET + 5
    with pytest.raises(ValueError, match="16 hex"):
        payload_name(5, "not-hex")


# --- the stored payload's layout --------------------------------------------------------------


@pytest.mark.parametrize(("n", "tokens"), [(16, 8), (4, 512), (2, 0), (0, 0)])
def test_a_payload_reads_back_exactly(n: int, tokens: int) -> None:
    prompt, completions = _group(n, tokens, seed=n + tokens)
    payload = rollout_codec.pack_payload(rollout_codec.Rollout.build(prompt, completions), rollout_codec.texts(completions))
    assert payload[:4] == b"RFP\x01"
    assert rollout_codec.unpack_payload(payload) == (prompt, completions)
    # As the trainer's claim reads it: numpy arrays (int64 ids, float64 log-probs viewing the
    # payload's bytes, read-only), the same values.
    prompt_array, arrays = rollout_codec.unpack_payload(payload, arrays=True)
    assert prompt_array.dtype == np.int64 and as_list(prompt_array) == prompt and arrays == completions
    for completion in arrays:
        assert completion.token_ids.dtype == np.int64 and completion.logprobs.dtype == np.float64
        assert not completion.logprobs.flags.writeable
    assert rollout_codec.checksum(payload).startswith("sha256:") and len(rollout_codec.checksum(payload)) == 71


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p[:3], "shorter than its header"),
        (lambda p: b"RFX\x01" + p[4:], "not b'RFP\\\\x01'"),
        (lambda p: p[:8] + p[8:40], "declares a rollout of"),
        (lambda p: p[:-3], "texts are not JSON"),
        (lambda p: p + b"  7", "texts are not JSON"),
        (lambda p: _rollout_cut(p, 8), "ends before its 10 values"),
        (lambda p: _rollout_cut(p, -8), "8 bytes past its declared end"),
    ],
)
@pytest.mark.parametrize("arrays", [False, True])
def test_a_damaged_payload_does_not_decode(damage, message: str, arrays: bool) -> None:  # type: ignore[no-untyped-def]
    prompt, completions = _group(2, 5)
    payload = rollout_codec.pack_payload(rollout_codec.Rollout.build(prompt, completions), rollout_codec.texts(completions))
    with pytest.raises(rollout_codec.RolloutFormatError, match=message):
        rollout_codec.unpack_payload(damage(payload), arrays=arrays)


def _rollout_cut(payload: bytes, count: int) -> bytes:
    """The payload with its rollout's last `count` bytes cut (or `-count` zero bytes added),
    the payload's header saying so: a rollout shorter (longer) than its own header declares."""
    size = int.from_bytes(payload[4:8], "little")
    end = 8 + size
    rollout = payload[8:end][: size - count] if count > 0 else payload[8:end] + bytes(-count)
    return payload[:4] + len(rollout).to_bytes(4, "little") + rollout + payload[end:]


# --- the file store ---------------------------------------------------------------------------


def _payload(n: int = 2, tokens: int = 5) -> bytes:
    prompt, completions = _group(n, tokens)
    return rollout_codec.pack_payload(rollout_codec.Rollout.build(prompt, completions), rollout_codec.texts(completions))


def test_a_stored_payload_is_read_back_verified(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = FileStore.of_run(tmp_path)
    payload = _payload()
    ref = store.put(PAYLOAD_BUCKET + 9, payload)
    again = store.put(PAYLOAD_BUCKET + 9, payload)
    assert ref.name != again.name  # a name per write: a late writer never overwrites a committed payload
    assert ref.size == len(payload) and ref.checksum == rollout_codec.checksum(payload)
    assert store.path(ref.name) == tmp_path / "payloads" / "1" / ref.name.split("/")[1]
    assert store.read(ref) == payload
    assert not [p for p in (tmp_path / "payloads" / "1").iterdir() if p.name.endswith(".tmp")]
    assert sorted(name for _, name in store.listing()) == sorted([ref.name, again.name])
    assert list(store.listing({1})) == []
    assert store.measure() == (2, 2 * len(payload))
    assert store.remove([ref.name, ref.name, "1/nothing.rfp"]) == 1
    assert store.remove_all() == 1 and not store.root.exists() and store.measure() == (0, 0)


def test_a_damaged_stored_payload_says_what_differs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = FileStore.of_run(tmp_path)
    payload = _payload()
    ref = store.put(11, payload)
    path = store.path(ref.name)
    path.write_bytes(payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(DamagedPayload, match="has checksum sha256:.*, its worker wrote sha256:"):
        store.read(ref)
    path.write_bytes(payload + b"x")
    with pytest.raises(DamagedPayload, match=f"has {len(payload) + 1} bytes, its worker wrote {len(payload)}"):
        store.read(ref)
    path.unlink()
    with pytest.raises(DamagedPayload, match="is missing"):
        store.read(ref)


def test_read_groups_verifies_each_group_against_what_the_ledger_committed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = FileStore.of_run(tmp_path)
    prompt, completions = _group(3, 7)
    payload = rollout_codec.pack_payload(rollout_codec.Rollout.build(prompt, completions), rollout_codec.texts(completions))
    refs = [store.put(i, payload) for i in (1, 2)]
    good = [StoredGroup(i, ref, 3, 21) for i, ref in zip((1, 2), refs, strict=True)]
    read = read_groups(store, good, "run 1 step 0")
    assert [(as_list(p), c) for p, c in read] == [(prompt, completions)] * 2
    with pytest.raises(DamagedPayload, match=r"run 1 step 4: the payload of group 2 \(.*\) holds 3 completions of 21 tokens, the ledger committed 3 of 20"):
        read_groups(store, [good[0], StoredGroup(2, refs[1], 3, 20)], "run 1 step 4")
    os.unlink(store.path(refs[0].name))
    with pytest.raises(DamagedPayload, match="run 1 step 0: the payload of group 1 is damaged: .* is missing"):
        read_groups(store, good, "run 1 step 0")


def test_stored_attempt_reads_a_name_or_a_write_in_progress() -> None:
    name = payload_name(PAYLOAD_BUCKET * 2 + 1, NONCE)
    assert stored_attempt(name) == PAYLOAD_BUCKET * 2 + 1
    bucket, base = name.split("/")
    assert stored_attempt(f"{bucket}/.{base}.tmp") == PAYLOAD_BUCKET * 2 + 1
    assert stored_attempt(f"{bucket}/notes.txt") is None
    assert stored_attempt(f"0/{base}") is None  # not the attempt's bucket: not the store's


def test_the_remover_removes_after_submit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = FileStore.of_run(tmp_path)
    refs = [store.put(i, _payload()) for i in range(5)]
    remover = Remover()
    try:
        remover.submit(store, [r.name for r in refs[:3]])
        remover.submit(store, [])
        assert remover.flush(10)
        assert remover.removed == 3
        assert sorted(n for _, n in store.listing()) == sorted(r.name for r in refs[3:])
    finally:
        remover.close(10)


def test_whole_number_rewards_are_read_as_floats_and_lengths_as_given() -> None:
    """A reward written as a whole number (encoders other than Python's drop the .0) is a float
    once read; lengths stay as given."""
    body = {**_claim().to_json(), "rewards": [1, 0.5, 0, -2.25], "lengths": [0, 3, 7, 2**40]}
    result = ResultMessage.from_json(body)
    assert result.rewards == [1.0, 0.5, 0.0, -2.25]
    assert [type(r) for r in result.rewards] == [float] * 4
    assert result.lengths == [0, 3, 7, 2**40]
