"""Builders shared by the config tests."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from refill.config import ConfigError, Problem, RunConfig, config_from_dict

BASE: dict[str, Any] = {"data": {"builtin": "arith"}}


def merged(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """BASE with `overrides` merged in section by section (a None value deletes the key)."""
    raw = copy.deepcopy(BASE)
    for section, values in (overrides or {}).items():
        if isinstance(values, dict) and isinstance(raw.get(section), dict):
            raw[section].update(values)
        else:
            raw[section] = values
    return raw


def build(overrides: dict[str, Any] | None = None, *, runtime: bool = False, **kwargs: Any) -> RunConfig:
    kwargs.setdefault("environ", {})
    return config_from_dict(merged(overrides), check_runtime=runtime, **kwargs)


def problems(overrides: dict[str, Any] | None = None, *, runtime: bool = False, **kwargs: Any) -> list[Problem]:
    with pytest.raises(ConfigError) as caught:
        build(overrides, runtime=runtime, **kwargs)
    return caught.value.problems


def problem_at(path: str, overrides: dict[str, Any] | None = None, **kwargs: Any) -> Problem:
    found = problems(overrides, **kwargs)
    at = [p for p in found if p.path == path]
    assert at, f"no problem at {path}; got: {[str(p) for p in found]}"
    return at[0]
