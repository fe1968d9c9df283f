"""Bad input for the fault suite: reward functions that fail for some prompts, and a custom
sampler that cannot assign steps. Named by `module:object` in run configs, so they are
imported by the fleet's workers (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import zlib
from typing import Any

from refill.rewards.sim import solved

#: One prompt in RAISE_EVERY makes the reward function raise, one in NAN_EVERY (of the rest)
#: makes it return NaN; the others score like the sim back-end's own reward.
RAISE_EVERY = 31
NAN_EVERY = 29


def _key(row: dict[str, Any]) -> int:
    return zlib.crc32(str(row.get("prompt", "")).encode())


def raises_or_nan(completion: str, row: dict[str, Any], **kwargs: Any) -> float:
    """`refill.rewards.sim:solved`, except for a fixed share of prompts."""
    key = _key(row)
    if key % RAISE_EVERY == 0:
        raise ValueError(f"reward function broke on prompt {row.get('prompt')!r}")
    if key % NAN_EVERY == 0:
        return float("nan")
    return solved(completion, row, **kwargs)


class PlaceOnly:
    """A custom sampler with `place` but no `lender`: it cannot assign borrowed groups."""

    def place(self, group, own, open_slots):  # type: ignore[no-untyped-def]
        return own
