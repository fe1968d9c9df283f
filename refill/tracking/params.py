"""A run's resolved config as tracker parameters, with its secrets hidden."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from refill.config.urls import REDACTED, redact_url

# Keys whose values are secrets whatever they look like (a reward function's kwargs may hold
# an API key, say): the whole key or its last `_` part, so `hf_token` is one and
# `max_new_tokens` is not.
_SECRET_KEY = re.compile(r"(^|_)(pass(word|wd)?|secret|token|api_?key|credentials?)$", re.IGNORECASE)


def redacted(value: Any, key: str = "") -> Any:
    """`value` with every URL password (refill.config's redaction) and every value of a
    secret-looking key replaced by `***`."""
    if isinstance(value, Mapping):
        return {str(k): redacted(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v, key) for v in value]
    if value is not None and _SECRET_KEY.search(key):
        return REDACTED
    if isinstance(value, str):
        return redact_url(value)
    return value


def flat_params(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The redacted config as `section.key` -> value (what MLflow and TensorBoard show)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(redacted(snapshot), "")
    return out
