"""The generation engine interface shared by the ``sim``, ``hf`` and ``vllm`` back-ends.

An engine turns a list of ``GenerationRequest`` (one prompt group each; declared in
``refill.models.payload``, since a generate message is one) into one entry per request: a
``GenerationOutput`` or an ``Exception``. An exception in the list fails that request
only; an exception raised by ``generate`` fails the whole list (the engine crashed).

Nothing here imports torch, transformers, vllm or Celery, nor any back-end: each back-end
imports this module, and ``refill.tasks.backends.make_engine`` picks one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

from refill.config import RunConfig, from_snapshot
from refill.models.payload import Completion, GenerationRequest


@dataclass
class GenerationOutput:
    """The group an engine produced for one request.

    ``weight_version`` is the version the completions were sampled with (stamped by
    ``BatchingEngine``, since the engine may load a newer one right after). ``generation_seconds``
    is the engine time of the batch the group was part of; the ``sim`` back-end sets it to the
    latency it simulated (in virtual mode it never slept it).
    """

    prompt_token_ids: list[int]
    completions: list[Completion]
    weight_version: int | None = None
    generation_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(RuntimeError):
    """An infrastructure failure of one request (the attempt is retried on the same prompt)."""


@runtime_checkable
class Engine(Protocol):
    weight_version: int | None

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]: ...

    def load_weights(self, version: int, path: str | None) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- config access


def engine_config(config: Any) -> RunConfig:
    """The run config a back-end reads, validated: a ``RunConfig`` as it is; a stored snapshot (a
    mapping) or a ``SimpleNamespace`` (tests) rebuilt through the schema, so that each knob it
    does not name has the schema's default, the only one (``refill.config.schema``)."""
    if isinstance(config, RunConfig):
        return config
    return from_snapshot(_plain(config), source="the engine's config")


def _plain(value: Any) -> Any:
    if isinstance(value, SimpleNamespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


# ---------------------------------------------------------------------------- helpers shared by back-ends


def stable_seed(*parts: object) -> int:
    """A 63-bit seed derived from values, identical across processes (unlike ``hash()``)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def encode_prompt(tokenizer: Any, prompt: str, use_chat_template: bool) -> list[int]:
    """Token ids of a prompt, the same way for every tokenizer-based back-end.

    With ``use_chat_template`` the prompt becomes one user message rendered by the tokenizer's
    template (with the generation prompt appended). The rendered text is encoded without adding
    special tokens, because templates already write their own BOS; encoding plain prompts does add
    them, as the model was trained with them.
    """
    if use_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "generation.use_chat_template is true but the tokenizer has no chat template; "
                "set generation.use_chat_template: false or use a tokenizer that ships one"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(
            "the prompt encodes to no tokens; a model needs at least one to condition on"
        )
    return ids


def eos_token_ids(*sources: Any) -> set[int]:
    """The end-of-sequence ids named by a tokenizer and/or generation/model configs."""
    ids: set[int] = set()
    for source in sources:
        if source is None:
            continue
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        if isinstance(value, Sequence):
            ids.update(int(v) for v in value)
        else:
            ids.add(int(value))
    return ids
