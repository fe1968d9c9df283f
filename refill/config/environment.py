"""Fleet settings read from the environment (not a run's config: every process of a fleet sets
them alike), parsed one way: a value that is not what the setting takes is refused, naming it."""

from __future__ import annotations

import os


def positive_int(name: str, default: int, meaning: str) -> int:
    """The environment variable `name` as a positive integer, `default` when unset or empty;
    anything else is a ValueError naming the variable, its value and `meaning`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: must be a positive integer, {meaning} (default {default})")
    return value
