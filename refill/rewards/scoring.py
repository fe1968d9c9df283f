"""Scoring a group of completions with a reward function, turning its failures into data failures.

A reward function is ``fn(completion: str, row: dict, **kwargs) -> float``. SPEC §3.2: a reward
function that raises, or returns something that is not a finite number, makes the attempt a
*data* failure; it must never crash the worker. ``score_group`` enforces that contract and says
which completion broke it, so the ledger records a usable reason.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

RewardFn = Callable[..., float]

_PREVIEW = 120


class RewardError(Exception):
    """The reward function failed on completion ``index`` of a group (a data failure)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"reward of completion {index}: {message}")
        self.index = index


def _preview(text: str) -> str:
    return repr(text if len(text) <= _PREVIEW else text[:_PREVIEW] + "...")


def _name(fn: RewardFn) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}:{qualname}" if module else qualname


def score_group(
    fn: RewardFn,
    completions: Sequence[str],
    row: dict[str, Any],
    kwargs: Mapping[str, Any] | None = None,
) -> list[float]:
    """Raw rewards of ``completions`` in order, or ``RewardError`` naming the first bad one."""
    kwargs = dict(kwargs or {})
    rewards: list[float] = []
    for index, completion in enumerate(completions):
        try:
            value = fn(completion, row, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001
            # Reward libraries signal timeouts with BaseException subclasses (math-verify's
            # TimeoutException); for the worker those are this attempt's data failure too.
            raise RewardError(
                index,
                f"{_name(fn)} raised {type(exc).__name__}: {exc} (completion {_preview(completion)})",
            ) from exc
        # bool is a Real; True/False as 1/0 is a reasonable reward, so it passes.
        if not isinstance(value, numbers.Real):
            raise RewardError(
                index,
                f"{_name(fn)} returned {type(value).__name__} {value!r}, not a number",
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(index, f"{_name(fn)} returned {value}, not a finite number")
        rewards.append(value)
    return rewards
