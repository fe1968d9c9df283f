"""A committed group's token ids and log-probs as one packed binary value (`groups.rollout`).

A group is `n` completions of up to thousands of tokens, each token with its log-prob. Stored
as JSONB numbers, PostgreSQL parsed every one of them on insert (each float to a `numeric`)
and the trainer's read turned them back: about 16 ms to write and 9 ms to read a group of
16 x 512 tokens, which alone capped the consumer near 60 groups a second. Packed, the same
group costs the ledger a byte copy each way (bench/README.md, "Storing rollouts").

Layout, little-endian, version 1:

    b"RFR" 0x01 | uint32 prompt_len | uint32 n | n x uint32 completion lengths
    | (prompt_len + sum(lengths)) x uint32 token ids (the prompt's, then each completion's)
    | sum(lengths) x float64 log-probs (each completion's, in order)

Token ids are unsigned 32-bit (`MAX_TOKEN_ID`; the payload checks refuse larger ones before a
group is committed); log-probs keep all 64 bits, so a group reads back exactly as it came.
Each completion's text and finish reason stay readable in SQL, in `groups.completion_texts`.
A later layout takes a new version byte and this module keeps reading version 1.

A group stored beside the broker (`refill.models.payload_store`, the claim check) is one
*payload*: the same rollout with the texts after it, version 1:

    b"RFP" 0x01 | uint32 rollout bytes | the rollout (above) | completion_texts as UTF-8 JSON

`checksum` is what the worker records of it and the trainer's claim verifies.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from refill.models.payload import Completion

#: The largest token id a rollout can hold (unsigned 32 bits; vocabularies are far smaller).
MAX_TOKEN_ID = 2**32 - 1

_MAGIC = b"RFR\x01"
_HEADER = struct.Struct("<4sII")
_PAYLOAD_MAGIC = b"RFP\x01"
_PAYLOAD_HEADER = struct.Struct("<4sI")
_BIG_ENDIAN = sys.byteorder == "big"
# array's "I" is C's unsigned int: 4 bytes on every platform CPython supports today. Checked
# once, here, rather than silently writing a different layout somewhere it is not.
if array("I").itemsize != 4 or array("d").itemsize != 8:  # pragma: no cover
    raise ImportError("refill's rollout layout needs 4-byte unsigned ints and 8-byte doubles")


_INT = {int}
_NUMBER = {int, float}


class RolloutFormatError(ValueError):
    """A stored rollout that does not decode: a corrupt or foreign `groups.rollout` value."""


def _little_endian(values: array | np.ndarray) -> bytes:
    if isinstance(values, np.ndarray):
        # Built with an explicit little-endian dtype (`_from_ndarrays`).
        return values.tobytes()
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian machine in CI
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _values(values: array | np.ndarray, dtype: type) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else np.frombuffer(values, dtype=dtype)


def _from_ndarrays(prompt_token_ids: Sequence[int], completions: Sequence[Completion]) -> Rollout | None:
    """`Rollout.build` for completions whose token ids and log-probs are numpy arrays (an
    engine that produces them: the sim back-end): concatenated and range-checked at C speed,
    never turned into Python numbers. None when any completion holds something else; raises as
    `Rollout.build` for values it cannot store."""
    if not completions:
        return None
    parts_ids, parts_logprobs = [], []
    for completion in completions:
        ids, logprobs = completion.token_ids, completion.logprobs
        if not (isinstance(ids, np.ndarray) and isinstance(logprobs, np.ndarray)):
            return None
        if len(logprobs) != len(ids):
            raise ValueError(f"a completion has {len(ids)} token ids but {len(logprobs)} log-probs")
        # What `array` refuses from a list: token ids that are not integers (and, as
        # `Rollout.checked` does, bools), log-probs that are not numbers.
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"token ids of dtype {ids.dtype} and {ids.ndim} dimensions are not integers")
        if logprobs.ndim != 1 or logprobs.dtype.kind not in "biuf":
            raise TypeError(f"log-probs of dtype {logprobs.dtype} and {logprobs.ndim} dimensions are not numbers")
        parts_ids.append(ids)
        parts_logprobs.append(logprobs)
    if isinstance(prompt_token_ids, np.ndarray):
        if prompt_token_ids.ndim != 1 or prompt_token_ids.dtype.kind not in "iu":
            raise TypeError(f"prompt token ids of dtype {prompt_token_ids.dtype} are not integers")
        prompt = prompt_token_ids
    else:
        prompt = np.frombuffer(array("I", prompt_token_ids), dtype=np.uint32)
    lengths = np.array([len(ids) for ids in parts_ids], dtype="<u4")
    ids = np.concatenate([prompt, *parts_ids])
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID):
        raise OverflowError(f"a token id outside [0, {MAX_TOKEN_ID}]")
    logprobs = np.concatenate(parts_logprobs).astype("<f8", copy=False)
    return Rollout(len(prompt), lengths, ids.astype("<u4", copy=False), logprobs)


class Rollout:
    """A group's token ids and log-probs as typed arrays: built once per result on the
    consumer's serial path, checked there (`decisions.checked_payload`) and packed on commit.

    Building the arrays is the check that every token id is an integer in [0, MAX_TOKEN_ID]
    and every log-prob a number, at C speed; the range and finiteness tests then run over
    the arrays, not over Python lists."""

    __slots__ = ("prompt_len", "lengths", "ids", "logprobs")

    def __init__(
        self, prompt_len: int, lengths: array | np.ndarray, ids: array | np.ndarray, logprobs: array | np.ndarray
    ) -> None:
        self.prompt_len = prompt_len
        self.lengths = lengths
        self.ids = ids
        self.logprobs = logprobs

    @classmethod
    def build(cls, prompt_token_ids: Sequence[int], completions: Sequence[Completion]) -> Rollout:
        """Raises ValueError if a completion has more or fewer log-probs than token ids, and
        OverflowError or TypeError for a token id that is not an integer in [0, MAX_TOKEN_ID]
        or a log-prob that is not a number.

        Completions whose token ids and log-probs are numpy arrays are taken as they are
        (`_from_ndarrays`), lists through `array`."""
        fast = _from_ndarrays(prompt_token_ids, completions)
        if fast is not None:
            return fast
        lengths = array("I", [len(c.token_ids) for c in completions])
        ids = array("I", prompt_token_ids)
        logprobs = array("d")
        for completion in completions:
            if len(completion.logprobs) != len(completion.token_ids):
                raise ValueError(
                    f"a completion has {len(completion.token_ids)} token ids but {len(completion.logprobs)} log-probs"
                )
            ids.extend(completion.token_ids)
            logprobs.extend(completion.logprobs)
        return cls(len(prompt_token_ids), lengths, ids, logprobs)

    @classmethod
    def checked(cls, prompt_token_ids: Sequence[int], completions: Sequence[Completion]) -> Rollout | None:
        """`build`, or None where it raises or a value is not of its exact JSON type (a bool
        is an int to `array`; True is not a token id). None sends the caller to the checks
        that name the problem."""
        try:
            rollout = cls.build(prompt_token_ids, completions)
        except (ValueError, TypeError, OverflowError):
            return None
        # A numpy array's dtype was checked by `build`; a list's values are checked here.
        for ids in [prompt_token_ids, *(c.token_ids for c in completions)]:
            if not isinstance(ids, np.ndarray) and ids and set(map(type, ids)) != _INT:
                return None
        for completion in completions:
            logprobs = completion.logprobs
            if isinstance(logprobs, np.ndarray):
                if logprobs.dtype.kind not in "iuf":
                    return None
            elif logprobs and not set(map(type, logprobs)) <= _NUMBER:
                return None
        return rollout

    @property
    def num_tokens(self) -> int:
        """Tokens of the completions (the prompt's left out)."""
        return len(self.logprobs)

    def max_token_id(self) -> int:
        """The largest token id, prompt included (-1 when there is none)."""
        return int(_values(self.ids, np.uint32).max()) if len(self.ids) else -1

    def logprobs_within(self, ceiling: float) -> bool:
        """Every log-prob finite and at most `ceiling`."""
        if not len(self.logprobs):
            return True
        values = _values(self.logprobs, np.float64)
        return bool(np.isfinite(values).all() and values.max() <= ceiling)

    def pack(self) -> bytes:
        return b"".join(
            (
                _HEADER.pack(_MAGIC, self.prompt_len, len(self.lengths)),
                _little_endian(self.lengths),
                _little_endian(self.ids),
                _little_endian(self.logprobs),
            )
        )


def texts(completions: Sequence[Completion]) -> list[dict[str, Any]]:
    """`groups.completion_texts` of a group."""
    return [{"text": c.text, "finish_reason": c.finish_reason} for c in completions]


def encode(prompt_token_ids: Sequence[int], completions: Sequence[Completion]) -> tuple[bytes, list[dict[str, Any]]]:
    """`(rollout, completion_texts)` for a group (raises as `Rollout.build`)."""
    return Rollout.build(prompt_token_ids, completions).pack(), texts(completions)


def decode(
    rollout: bytes, completion_texts: Sequence[dict[str, Any]], *, arrays: bool = False
) -> tuple[Sequence[int], list[Completion]]:
    """`(prompt_token_ids, completions)` of a stored group: lists of Python numbers, or with
    `arrays` numpy arrays (token ids int64, log-probs read-only float64 views over `rollout`,
    which they keep alive), as the trainer's claim reads them (`TrainGroup`)."""
    blob = rollout if arrays and isinstance(rollout, bytes | memoryview) else bytes(rollout)
    if len(blob) < _HEADER.size:
        raise RolloutFormatError(f"a rollout of {len(blob)} bytes is shorter than its header")
    magic, prompt_len, n = _HEADER.unpack_from(blob)
    if magic != _MAGIC:
        raise RolloutFormatError(f"a rollout starts with {bytes(magic)!r}, not {_MAGIC!r} (layout version 1)")
    if len(completion_texts) != n:
        raise RolloutFormatError(f"a rollout of {n} completions has {len(completion_texts)} texts")
    read = _read_array if arrays else _read
    offset = _HEADER.size
    lengths = _read(blob, "I", offset, n)
    offset += 4 * n
    total = sum(lengths)
    ids = read(blob, "I", offset, prompt_len + total)
    offset += 4 * (prompt_len + total)
    logprobs = read(blob, "d", offset, total)
    offset += 8 * total
    if offset != len(blob):
        raise RolloutFormatError(f"a rollout has {len(blob) - offset} bytes past its declared end")
    completions = []
    start_ids, start_logprobs = prompt_len, 0
    for length, text in zip(lengths, completion_texts, strict=True):
        completions.append(
            Completion(
                token_ids=ids[start_ids : start_ids + length],
                logprobs=logprobs[start_logprobs : start_logprobs + length],
                text=str(text.get("text", "")),
                finish_reason=str(text.get("finish_reason", "stop")),
            )
        )
        start_ids += length
        start_logprobs += length
    return ids[:prompt_len], completions


def pack_payload(rollout: Rollout, completion_texts: Sequence[dict[str, Any]]) -> bytes:
    """A group as a worker stores it: the packed rollout, then its texts (`texts`)."""
    packed = rollout.pack()
    texts_json = json.dumps(list(completion_texts), ensure_ascii=False, separators=(",", ":")).encode()
    return b"".join((_PAYLOAD_HEADER.pack(_PAYLOAD_MAGIC, len(packed)), packed, texts_json))


def unpack_payload(payload: bytes, *, arrays: bool = False) -> tuple[Sequence[int], list[Completion]]:
    """`(prompt_token_ids, completions)` of a stored payload (lists, or numpy arrays with
    `arrays`, as `decode`); RolloutFormatError when it is not one."""
    blob = memoryview(payload)
    if len(blob) < _PAYLOAD_HEADER.size:
        raise RolloutFormatError(f"a payload of {len(blob)} bytes is shorter than its header")
    magic, rollout_bytes = _PAYLOAD_HEADER.unpack_from(blob)
    if magic != _PAYLOAD_MAGIC:
        raise RolloutFormatError(f"a payload starts with {bytes(magic)!r}, not {_PAYLOAD_MAGIC!r} (layout version 1)")
    end = _PAYLOAD_HEADER.size + rollout_bytes
    if end > len(blob):
        raise RolloutFormatError(f"a payload of {len(blob)} bytes declares a rollout of {rollout_bytes}")
    try:
        texts = json.loads(bytes(blob[end:]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RolloutFormatError(f"a payload's texts are not JSON ({error})") from error
    if not isinstance(texts, list) or not all(isinstance(t, dict) for t in texts):
        raise RolloutFormatError("a payload's texts are not a list of objects")
    return decode(blob[_PAYLOAD_HEADER.size : end], texts, arrays=arrays)


def checksum(payload: bytes) -> str:
    """The checksum a worker records of the payload it stored ("sha256:<hex>")."""
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def _read(blob: bytes, typecode: str, offset: int, count: int) -> list:
    values = array(typecode)
    end = offset + values.itemsize * count
    if end > len(blob):
        raise RolloutFormatError(f"a rollout of {len(blob)} bytes ends before its {count} values at byte {offset}")
    values.frombytes(blob[offset:end])
    if _BIG_ENDIAN:  # pragma: no cover
        values.byteswap()
    return values.tolist()


_DTYPES = {"I": np.dtype("<u4"), "d": np.dtype("<f8")}


def _read_array(blob: bytes | memoryview, typecode: str, offset: int, count: int) -> np.ndarray:
    """`_read` as a numpy array: token ids ("I") widened to int64 (a trainer indexes
    embeddings with them; unsigned 32-bit is not a tensor type everywhere), log-probs ("d")
    a read-only view of the bytes."""
    dtype = _DTYPES[typecode]
    if offset + dtype.itemsize * count > len(blob):
        raise RolloutFormatError(f"a rollout of {len(blob)} bytes ends before its {count} values at byte {offset}")
    values = np.frombuffer(blob, dtype=dtype, count=count, offset=offset)
    return values.astype(np.int64) if typecode == "I" else values
