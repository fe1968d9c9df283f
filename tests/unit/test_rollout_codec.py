"""A group's token ids and log-probs packed for `groups.rollout` read back exactly."""

from __future__ import annotations

import math
import random
import struct

import pytest

from refill.models.payload import Completion
from refill.models.rollout_codec import (
    MAX_TOKEN_ID,
    Rollout,
    RolloutFormatError,
    decode,
    encode,
    texts,
)


def _group(rng: random.Random, lengths: list[int]) -> tuple[list[int], list[Completion]]:
    prompt = [rng.randrange(MAX_TOKEN_ID + 1) for _ in range(rng.randrange(1, 40))]
    completions = [
        Completion(
            token_ids=[rng.randrange(150_000) for _ in range(length)],
            # Doubles that a float32 would round: the layout keeps all 64 bits.
            logprobs=[-rng.random() * 20 - 1e-300 for _ in range(length)],
            text=f"completion {i} \u00e9\u4e2d",
            finish_reason=rng.choice(["stop", "length"]),
        )
        for i, length in enumerate(lengths)
    ]
    return prompt, completions


@pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5], [0, 7], [], [512] * 16])
def test_a_group_reads_back_exactly(lengths: list[int]) -> None:
    prompt, completions = _group(random.Random(len(lengths)), lengths)
    blob, texts = encode(prompt, completions)
    assert isinstance(blob, bytes)
    assert texts == [{"text": c.text, "finish_reason": c.finish_reason} for c in completions]
    assert decode(blob, texts) == (prompt, completions)
    # header + lengths + ids + log-probs: nothing else travels
    assert len(blob) == 12 + 4 * len(lengths) + 4 * (len(prompt) + sum(lengths)) + 8 * sum(lengths)


def test_the_layout_is_little_endian_and_versioned() -> None:
    blob, _ = encode([7], [Completion([258], [-0.5], "a")])
    assert blob[:4] == b"RFR\x01"
    assert struct.unpack_from("<III", blob, 4) == (1, 1, 1)  # prompt length, n, first length
    assert struct.unpack_from("<IId", blob, 16) == (7, 258, -0.5)


def test_decode_accepts_a_memoryview() -> None:
    # psycopg hands bytea back as bytes, but a driver may give a buffer.
    blob, texts = encode([1, 2], [Completion([3], [-1.0], "x")])
    assert decode(memoryview(blob), texts) == ([1, 2], [Completion([3], [-1.0], "x")])


@pytest.mark.parametrize(
    ("token", "error"),
    [(-1, OverflowError), (MAX_TOKEN_ID + 1, OverflowError), (1.5, TypeError)],
)
def test_encode_refuses_a_token_id_it_cannot_store(token: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode([1], [Completion([token], [-1.0], "x")])  # type: ignore[list-item]


def test_encode_refuses_a_completion_with_a_logprob_per_token_missing() -> None:
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        encode([1], [Completion([1, 2], [-1.0], "x")])


def test_non_finite_logprobs_survive() -> None:
    # The payload checks refuse them before commit; the layout itself does not lose them.
    blob, texts = encode([1], [Completion([1, 2], [-math.inf, -0.0], "x")])
    assert decode(blob, texts)[1][0].logprobs == [-math.inf, -0.0]


def test_a_damaged_rollout_is_named_not_misread() -> None:
    blob, texts = encode([1, 2, 3], [Completion([4, 5], [-1.0, -2.0], "x")])
    with pytest.raises(RolloutFormatError, match="shorter than its header"):
        decode(blob[:5], texts)
    with pytest.raises(RolloutFormatError, match="not b'RFR\\\\x01'"):
        decode(b"XXXX" + blob[4:], texts)
    with pytest.raises(RolloutFormatError, match="ends before"):
        decode(blob[:-1], texts)
    with pytest.raises(RolloutFormatError, match="bytes past its declared end"):
        decode(blob + b"\0", texts)
    with pytest.raises(RolloutFormatError, match="1 completions has 2 texts"):
        decode(blob, texts * 2)


def test_checked_arrays_refuse_what_would_not_read_back_as_sent() -> None:
    fine = Rollout.checked([5, 1], [Completion([7, 0], [-1.0, 0], "x")])  # an int log-prob is a number
    assert fine is not None and fine.num_tokens == 2 and fine.max_token_id() == 7
    assert fine.logprobs_within(0.0) and not fine.logprobs_within(-0.5)
    assert decode(fine.pack(), texts([Completion([7, 0], [-1.0, 0], "x")]))[1][0].logprobs == [-1.0, 0.0]
    # True is an int to `array`, and would read back as token 1
    assert Rollout.checked([True], [Completion([1], [-1.0], "x")]) is None
    assert Rollout.checked([1], [Completion([1], [False], "x")]) is None
    assert Rollout.checked([1], [Completion([1.0], [-1.0], "x")]) is None
    assert Rollout.checked([1], [Completion([1], ["-1"], "x")]) is None  # type: ignore[list-item]
    assert Rollout.checked([1], [Completion([1], [10**400], "x")]) is None  # past the float range
    assert Rollout.checked([MAX_TOKEN_ID + 1], [Completion([1], [-1.0], "x")]) is None
    empty = Rollout.checked([1], [Completion([], [], "x")])
    assert empty is not None and empty.logprobs_within(-1.0) and empty.num_tokens == 0


def test_non_finite_logprobs_are_outside_any_ceiling() -> None:
    rollout = Rollout.build([1], [Completion([1, 2], [-1.0, math.nan], "x")])
    assert not rollout.logprobs_within(0.0)
    assert not Rollout.build([1], [Completion([1], [-math.inf], "x")]).logprobs_within(0.0)
