"""The data shapes that cross a process boundary, as plain JSON-able dataclasses.

Nothing here imports Celery or torch: the generation worker, the results consumer and the
trainer all agree on these shapes, and the wire format is JSON only (never pickle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


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
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"

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


@dataclass
class GenerateMessage(GenerationRequest):
    """Body of the `refill.generate` task: one attempt of run `run_id`, which a worker hands
    to its engine as it is (a `GenerationRequest`)."""

    # Keyword-only: a subclass field after the defaulted min_weight_version.
    run_id: int = field(kw_only=True)

    def to_json(self) -> dict[str, Any]:
        # By hand, in the order the wire has always had (run_id first); asdict would put the
        # subclass's run_id last.
        return {
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "prompt": self.prompt,
            "row": self.row,
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "min_weight_version": self.min_weight_version,
        }

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
            "prompt_token_ids": self.prompt_token_ids,
            "completions": [
                {
                    "token_ids": c.token_ids,
                    "logprobs": c.logprobs,
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
        """Decode a result. Shape errors raise PayloadError; value checks (group size, finite
        rewards, token range) are the ledger's job because they need the run's config."""
        if not isinstance(body, dict):
            raise PayloadError("a result message must be an object")
        error_kind = body.get("error_kind")
        if error_kind not in (None, "infra", "data"):
            raise PayloadError(f"error_kind must be null, 'infra' or 'data', not {error_kind!r}")
        weight_version = body.get("weight_version")
        if weight_version is not None and (
            not isinstance(weight_version, int) or isinstance(weight_version, bool)
        ):
            raise PayloadError("field 'weight_version' must be an integer or null")
        completions = body.get("completions") or []
        rewards = body.get("rewards") or []
        if not isinstance(completions, list) or not isinstance(rewards, list):
            raise PayloadError("'completions' and 'rewards' must be lists")
        return cls(
            run_id=_require(body, "run_id", int),
            attempt_id=_require(body, "attempt_id", int),
            worker=str(body.get("worker", "?")),
            weight_version=weight_version,
            prompt_token_ids=list(body.get("prompt_token_ids") or []),
            completions=[Completion.from_json(c) for c in completions],
            rewards=[_as_reward(r) for r in rewards],
            error_kind=error_kind,
            error=None if body.get("error") is None else str(body.get("error")),
            generation_seconds=float(body.get("generation_seconds") or 0.0),
        )


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
    """One committed group as the trainer sees it."""

    attempt_id: int
    prompt_token_ids: list[int]
    completions: list[Completion]
    rewards: list[float]
    weight_version: int
