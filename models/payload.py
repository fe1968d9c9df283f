"""The data shapes that cross a process boundary, as plain JSON-able dataclasses.

Nothing here imports Celery or torch: the generation worker, the results consumer and the
trainer all agree on these shapes, and the wire format is JSON only (never pickle).

A result body has a version (`"v"`). Version 1 (no `"v"` key: what every worker sent before
the claim check) carries the group inline: token ids, log-probs and texts. Version 2
(`ClaimCheckResult`) carries what the consumer decides on (rewards, lengths) and where the
worker stored the group (`PayloadRef`: a name in the run's payload store, its size and
checksum), a few hundred bytes whatever the rollout's length. Consumers read both, so they are
upgraded before the workers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

#: The result body versions this code reads; it writes 2 for a stored payload, 1 inline.
RESULT_VERSIONS = (1, 2)
#: A payload's name in its run's store: `<attempt id // PAYLOAD_BUCKET>/<attempt id>.<16 hex>.rfp`
#: (relative, no `..`: a message names a file of its own attempt and nothing else).
PAYLOAD_BUCKET = 4096
_PAYLOAD_NAME = re.compile(r"(\d{1,16})/(\d{1,19})\.[0-9a-f]{16}\.rfp")
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")
#: The longest error text a result carries (an engine's traceback can be any length; the wire
#: stays small, and the ledger keeps about this much of it anyway).
MAX_ERROR_CHARS = 1000


class PayloadError(ValueError):
    """A message that does not have the shape its queue expects."""


def _require(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in body:
        raise PayloadError(f"missing field {key!r}")
    value = body[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PayloadError(f"field {key!r} has type {type(value).__name__}")
    return value


@dataclass
class Completion:
    """One completion of a group. An engine may hand its token ids and log-probs as 1-D numpy
    arrays rather than lists (the sim back-end does: the worker packs them for the payload
    store without making a Python number of each); `ResultMessage.to_json` writes lists."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"

    def __eq__(self, other: object) -> bool:
        # The dataclass's own would compare numpy arrays element-wise (an array, not a bool).
        if not isinstance(other, Completion):
            return NotImplemented
        return (
            self.text == other.text
            and self.finish_reason == other.finish_reason
            and as_list(self.token_ids) == as_list(other.token_ids)
            and as_list(self.logprobs) == as_list(other.logprobs)
        )

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Completion:
        if not isinstance(body, dict):
            raise PayloadError("a completion must be an object")
        token_ids = body.get("token_ids")
        logprobs = body.get("logprobs")
        if type(token_ids) is not list or type(logprobs) is not list:
            # the slow path, for its message
            token_ids = _require(body, "token_ids", list)
            logprobs = _require(body, "logprobs", list)
        if len(token_ids) != len(logprobs):
            raise PayloadError(
                f"completion has {len(token_ids)} token ids but {len(logprobs)} log-probs"
            )
        return cls(
            token_ids=token_ids,
            logprobs=logprobs,
            text=str(body.get("text", "")),
            finish_reason=str(body.get("finish_reason", "stop")),
        )


@dataclass
class GenerationRequest:
    """One attempt as an engine sees it: ``n`` completions of ``prompt``, sampled with these
    parameters. The generate queue's message is this plus the run (``GenerateMessage``), so the
    fields are declared once for both sides of the boundary."""

    attempt_id: int
    prompt: str
    row: dict[str, Any]
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    min_weight_version: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise PayloadError(f"attempt {self.attempt_id}: n must be at least 1, not {self.n}")
        if self.max_new_tokens < 1:
            raise PayloadError(
                f"attempt {self.attempt_id}: max_new_tokens must be at least 1, not {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise PayloadError(f"attempt {self.attempt_id}: temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise PayloadError(
                f"attempt {self.attempt_id}: top_p must be in (0, 1], not {self.top_p}"
            )


def generate_body(
    *,
    run_id: int,
    attempt_id: int,
    prompt: str,
    row: dict[str, Any],
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    min_weight_version: int,
) -> dict[str, Any]:
    """The body of a `refill.generate` task (`GenerateMessage.to_json`), by hand, in the order
    the wire has always had (run_id first; asdict would put the subclass's run_id last).

    The relay builds its bodies with this, not through a `GenerateMessage`: 7,700 a step, of
    values from a run's validated config, which a worker's `GenerateMessage.from_json` checks
    again on receipt."""
    return {
        "run_id": run_id,
        "attempt_id": attempt_id,
        "prompt": prompt,
        "row": row,
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "min_weight_version": min_weight_version,
    }


@dataclass
class GenerateMessage(GenerationRequest):
    """Body of the `refill.generate` task: one attempt of run `run_id`, which a worker hands
    to its engine as it is (a `GenerationRequest`)."""

    # Keyword-only: a subclass field after the defaulted min_weight_version.
    run_id: int = field(kw_only=True)

    def to_json(self) -> dict[str, Any]:
        return generate_body(
            run_id=self.run_id,
            attempt_id=self.attempt_id,
            prompt=self.prompt,
            row=self.row,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            min_weight_version=self.min_weight_version,
        )

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> GenerateMessage:
        if not isinstance(body, dict):
            raise PayloadError("a generate message must be an object")
        return cls(
            run_id=_require(body, "run_id", int),
            attempt_id=_require(body, "attempt_id", int),
            prompt=_require(body, "prompt", str),
            row=_require(body, "row", dict),
            n=_require(body, "n", int),
            temperature=float(_require(body, "temperature", (int, float))),
            top_p=float(_require(body, "top_p", (int, float))),
            max_new_tokens=_require(body, "max_new_tokens", int),
            seed=_require(body, "seed", int),
            min_weight_version=_require(body, "min_weight_version", int),
        )


@dataclass
class ResultMessage:
    """Body of the `refill.record_result` task: what a worker saw for one attempt.

    `error_kind` is None for a finished generation, "infra" when the engine failed (retried on
    the same prompt) and "data" when the output or its scoring is unusable (a reward function
    that raised, a non-finite reward).
    """

    run_id: int
    attempt_id: int
    worker: str
    weight_version: int | None
    prompt_token_ids: list[int] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    error_kind: str | None = None
    error: str | None = None
    generation_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        # By hand: dataclasses.asdict deep-copies every token list of every completion.
        return {
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "worker": self.worker,
            "weight_version": self.weight_version,
            "prompt_token_ids": as_list(self.prompt_token_ids),
            "completions": [
                {
                    "token_ids": as_list(c.token_ids),
                    "logprobs": as_list(c.logprobs),
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                }
                for c in self.completions
            ],
            "rewards": self.rewards,
            "error_kind": self.error_kind,
            "error": self.error,
            "generation_seconds": self.generation_seconds,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ResultMessage:
        """Decode a result of either body version (a `ClaimCheckResult` for version 2). Shape
        errors raise PayloadError; value checks (group size, finite rewards, token range) are
        the ledger's job because they need the run's config."""
        if not isinstance(body, dict):
            raise PayloadError("a result message must be an object")
        version = body.get("v", 1)
        if version == 2:
            return ClaimCheckResult.from_json(body)
        if version != 1:
            raise PayloadError(
                f"result body version {version!r}: this consumer reads versions "
                f"{', '.join(map(str, RESULT_VERSIONS))} (upgrade the consumers before the workers)"
            )
        completions = body.get("completions") or []
        if not isinstance(completions, list):
            raise PayloadError("'completions' and 'rewards' must be lists")
        return cls(
            **_common_fields(body),
            prompt_token_ids=list(body.get("prompt_token_ids") or []),
            completions=[Completion.from_json(c) for c in completions],
        )

    def estimated_bytes(self) -> int:
        """The size `infra.max_result_bytes` bounds: an upper estimate of the group's JSON
        inline, the stored payload's size for a claim check."""
        return estimated_result_bytes(self)


def as_list(values: Any) -> list[Any]:
    """Token ids or log-probs as a list of Python numbers (what JSON carries, what a list-based
    trainer builds from): a list as it is, a numpy array by its `tolist` (at C speed)."""
    if type(values) is list:
        return values
    tolist = getattr(values, "tolist", None)
    return tolist() if tolist is not None else list(values)


def estimated_result_bytes(result: Any) -> int:
    """A cheap upper estimate of the JSON size of a group inline (anything with
    `prompt_token_ids` and `completions`: an engine's output, a result), without encoding it."""
    size = 256 + 8 * len(result.prompt_token_ids)
    for completion in result.completions:
        size += 128 + 8 * len(completion.token_ids) + 24 * len(completion.logprobs) + 2 * len(completion.text)
    return size


@dataclass(frozen=True)
class PayloadRef:
    """Where a generation worker stored a group's rollout for the trainer
    (`refill.models.payload_store`): `name` in the run's payload store, and the `size` in bytes
    and `checksum` ("sha256:<hex>") of what it wrote, which the trainer's claim verifies."""

    name: str
    size: int
    checksum: str

    @property
    def attempt_id(self) -> int:
        return int(self.name.split("/")[1].split(".")[0])

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.name, "bytes": self.size, "checksum": self.checksum}

    @classmethod
    def from_json(cls, body: Any, attempt_id: int) -> PayloadRef:
        if not isinstance(body, dict):
            raise PayloadError("'payload' must be an object")
        ref = cls(
            name=_require(body, "ref", str),
            size=_require(body, "bytes", int),
            checksum=_require(body, "checksum", str),
        )
        problem = payload_name_problem(ref.name, attempt_id)
        if problem is not None:
            raise PayloadError(problem)
        if ref.size < 0:
            raise PayloadError(f"payload of attempt {attempt_id} has {ref.size} bytes")
        if _CHECKSUM.fullmatch(ref.checksum) is None:
            raise PayloadError(f"payload checksum {ref.checksum[:80]!r} is not 'sha256:' and 64 hex digits")
        return ref


def payload_name(attempt_id: int, nonce: str) -> str:
    """The store name of a payload of `attempt_id` (`nonce`: 16 hex digits, one per write, so
    that no two writes ever share a name)."""
    name = f"{attempt_id // PAYLOAD_BUCKET}/{attempt_id}.{nonce}.rfp"
    problem = payload_name_problem(name, attempt_id)
    if problem is not None:
        raise ValueError(problem)
    return name


def payload_name_problem(name: str, attempt_id: int) -> str | None:
    """Why `name` cannot be attempt `attempt_id`'s payload (None when it can): the consumer
    removes the payloads it discards by name, so a name must be one the store makes for this
    very attempt, never a path of its own."""
    found = _PAYLOAD_NAME.fullmatch(name)
    if found is None:
        return f"payload name {name[:80]!r} is not '<bucket>/<attempt>.<16 hex>.rfp'"
    bucket, owner = int(found.group(1)), int(found.group(2))
    if owner != attempt_id or bucket != attempt_id // PAYLOAD_BUCKET:
        return f"payload name {name!r} is not one of attempt {attempt_id}'s"
    return None


#: Why a claim check may name no payload without being a failure (`ClaimCheckResult.unstored`).
UNSTORED_ZERO_VARIANCE = "zero_variance"


@dataclass
class ClaimCheckResult(ResultMessage):
    """A result whose group waits in the run's payload store (body version 2): what the
    consumer decides on (rewards; the prompt's and each completion's length) and the stored
    payload's `PayloadRef` (None for a failure, which has no group). `prompt_token_ids` and
    `completions` stay empty: the trainer reads them from the payload.

    `unstored` (`"zero_variance"`): the worker stored no payload because the run filters the
    group (its rewards are all equal, within the run's tolerance, under dynamic sampling), so
    nothing would ever read it; the consumer checks that it does filter it. Consumers that
    read this field are deployed before workers that write it, as for every body change."""

    payload: PayloadRef | None = field(default=None, kw_only=True)
    prompt_length: int = field(default=0, kw_only=True)
    lengths: list[int] = field(default_factory=list, kw_only=True)
    unstored: str | None = field(default=None, kw_only=True)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": 2,
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "worker": self.worker,
            "weight_version": self.weight_version,
            "rewards": self.rewards,
            "prompt_length": self.prompt_length,
            "lengths": self.lengths,
            "payload": None if self.payload is None else self.payload.to_json(),
            "error_kind": self.error_kind,
            "error": None if self.error is None else self.error[:MAX_ERROR_CHARS],
            "generation_seconds": self.generation_seconds,
        } | ({"unstored": self.unstored} if self.unstored is not None else {})

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ClaimCheckResult:
        if not isinstance(body, dict):
            raise PayloadError("a result message must be an object")
        common = _common_fields(body)
        lengths = body.get("lengths") or []
        if not isinstance(lengths, list) or not _are_counts(lengths):
            raise PayloadError("'lengths' must be a list of non-negative integers")
        prompt_length = body.get("prompt_length", 0)
        if not _is_count(prompt_length):
            raise PayloadError("'prompt_length' must be a non-negative integer")
        payload = body.get("payload")
        unstored = body.get("unstored")
        if unstored is not None and unstored != UNSTORED_ZERO_VARIANCE:
            raise PayloadError(f"'unstored' must be null or {UNSTORED_ZERO_VARIANCE!r}, not {unstored!r}")
        if unstored is not None and (payload is not None or common["error_kind"] is not None):
            raise PayloadError(f"result of attempt {common['attempt_id']} says its group was not stored, but names a payload or an error")
        if payload is None and common["error_kind"] is None and unstored is None:
            raise PayloadError(f"result of attempt {common['attempt_id']} has neither a payload nor an error")
        return cls(
            **common,
            payload=None if payload is None else PayloadRef.from_json(payload, common["attempt_id"]),
            prompt_length=prompt_length,
            lengths=lengths,
            unstored=unstored,
        )

    def estimated_bytes(self) -> int:
        return 0 if self.payload is None else self.payload.size


def _common_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The fields both result body versions share, checked."""
    error_kind = body.get("error_kind")
    if error_kind not in (None, "infra", "data"):
        raise PayloadError(f"error_kind must be null, 'infra' or 'data', not {error_kind!r}")
    weight_version = body.get("weight_version")
    if weight_version is not None and (
        not isinstance(weight_version, int) or isinstance(weight_version, bool)
    ):
        raise PayloadError("field 'weight_version' must be an integer or null")
    rewards = body.get("rewards") or []
    if not isinstance(rewards, list):
        raise PayloadError("'completions' and 'rewards' must be lists")
    return {
        "run_id": _require(body, "run_id", int),
        "attempt_id": _require(body, "attempt_id", int),
        "worker": str(body.get("worker", "?")),
        "weight_version": weight_version,
        "rewards": _as_rewards(rewards),
        "error_kind": error_kind,
        "error": None if body.get("error") is None else str(body.get("error")),
        "generation_seconds": float(body.get("generation_seconds") or 0.0),
    }


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _are_counts(values: list[Any]) -> bool:
    # Every result's 16 lengths are checked: plain ints (what json reads) in one pass first.
    if set(map(type, values)) <= _INT:
        return not values or min(values) >= 0
    return all(_is_count(n) for n in values)


def estimated_body_bytes(body: dict[str, Any]) -> int:
    """A cheap upper estimate of a result body's JSON size, either version, without encoding
    it (the worker's ResultSender cuts its bundles by it)."""
    size = 256 + 8 * len(body.get("prompt_token_ids") or ())
    for completion in body.get("completions") or ():
        size += 128 + 8 * len(completion.get("token_ids") or ()) + 24 * len(completion.get("logprobs") or ())
        size += 2 * len(completion.get("text") or "")
    # A version 2 body: its rewards and lengths (a reward's repr is at most 24 characters), and
    # the payload's name and checksum.
    size += 26 * len(body.get("rewards") or ()) + 21 * len(body.get("lengths") or ())
    if body.get("payload") is not None:
        size += 160
    return size + len(str(body.get("worker") or "")) + 2 * len(body.get("error") or "")


_INT, _FLOAT = {int}, {float}


def _as_rewards(values: list[Any]) -> list[float]:
    # Every result's rewards are checked: plain floats (what json reads) in one pass first.
    if set(map(type, values)) <= _FLOAT:
        return list(values)
    return [_as_reward(value) for value in values]


def _as_reward(value: Any) -> float:
    # JSON has no NaN/inf literals, but Python's json module writes and reads them; keep them
    # as floats here so the ledger can record the attempt as a data failure rather than a
    # decode error that would lose which attempt it was.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PayloadError(f"reward {value!r} is not a number")
    return float(value)


def is_finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)


@dataclass
class TrainGroup:
    """One committed group as the trainer sees it.

    As the trainer's claim reads them from the ledger or the payload store, the prompt's and
    each completion's token ids are 1-D numpy arrays of int64 and the log-probs read-only 1-D
    views of float64 over the payload's bytes, not lists: a group of 16 x 8,192 tokens is
    then a few array slices, not 260,000 Python numbers that a trainer turns into tensors
    anyway. `as_list` gives lists; `len(...)` (never truthiness) asks for emptiness."""

    attempt_id: int
    prompt_token_ids: list[int]
    completions: list[Completion]
    rewards: list[float]
    weight_version: int
