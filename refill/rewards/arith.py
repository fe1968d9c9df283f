"""Reward of the arithmetic task (``refill.data.arith``): exact match of the answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Where a completion's answer ends: a newline, or an end-of-sequence marker left in the text by
#: a back-end that does not strip special tokens.
DEFAULT_STOPS: tuple[str, ...] = (
    "\n",
    "<eos>",
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
)


def exact_match(
    completion: str,
    row: dict[str, Any],
    *,
    answer_key: str = "answer",
    stops: Sequence[str] = DEFAULT_STOPS,
) -> float:
    """1.0 when the completion, stripped and cut before any eos/newline, equals ``row[answer_key]``."""
    if answer_key not in row:
        raise KeyError(
            f"the row has no {answer_key!r} field to compare against (fields: {sorted(row)})"
        )
    text = completion.strip()
    for stop in stops:
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    return 1.0 if text.strip() == str(row[answer_key]).strip() else 0.0
