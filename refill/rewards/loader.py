"""Resolve `module:function` names from config to Python objects.

Reward functions are named in config (`reward.function: package.module:function`) and are called
as `fn(completion: str, row: dict, **kwargs) -> float`. The same resolver imports a custom
sampler (`async_rl.sampler.import_path`), so both report a bad name the same way: which part
failed (the module, the attribute, the call signature) and what to write instead.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[..., float]


class ImportObjectError(ValueError):
    """A `module:attribute` name that does not resolve; `fix` says what to change."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}. Fix: {fix}")
        self.message = message
        self.fix = fix


def split_spec(spec: str) -> tuple[str, str]:
    """`pkg.mod:attr.sub` -> (`pkg.mod`, `attr.sub`); a colon-less dotted name splits at its last dot.

    The colon form is the documented one; the dotted form is accepted because that is how
    NeMo RL names custom samplers, and a user coming from there should not have to rewrite it.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ImportObjectError("the name is empty", "write it as package.module:name")
    spec = spec.strip()
    if ":" in spec:
        module, _, attr = spec.partition(":")
    else:
        module, _, attr = spec.rpartition(".")
    if not module or not attr or ":" in attr:
        raise ImportObjectError(
            f"{spec!r} is not of the form module:name", "write it as package.module:name"
        )
    return module, attr


def import_object(spec: str) -> Any:
    """Import the object that `spec` names, or raise `ImportObjectError` saying why not."""
    module_name, attr = split_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only a missing *named* module is a wrong name; a module that exists but fails to
        # import one of its own dependencies needs a different fix (install that dependency).
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise ImportObjectError(
                f"module {module_name!r} (from {spec!r}) cannot be found",
                "check the spelling, and that the module is installed or on PYTHONPATH",
            ) from exc
        raise ImportObjectError(
            f"module {module_name!r} (from {spec!r}) imports {missing!r}, which is not installed",
            f"install the package that provides {missing!r}",
        ) from exc
    except Exception as exc:
        # Whatever user code raises at import time is reported, not propagated as a crash.
        raise ImportObjectError(
            f"importing module {module_name!r} (from {spec!r}) raised "
            f"{type(exc).__name__}: {exc}",
            "fix the error in that module",
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            hint = f" (it defines: {', '.join(public[:12])})" if public else ""
            raise ImportObjectError(
                f"module {module_name!r} has no attribute {attr!r}{hint}",
                "name an attribute that the module defines",
            )
        obj = getattr(obj, part)
    return obj


def load_reward_fn(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """The reward function named by `spec`, with `kwargs` bound when given.

    The signature is checked against a call `fn(completion, row, **kwargs)` so that a
    misspelt keyword in `reward.kwargs` fails at setup rather than as a data failure on every
    attempt of the run.
    """
    fn = import_object(spec)
    if not callable(fn):
        raise ImportObjectError(
            f"{spec!r} is a {type(fn).__name__}, not a function",
            "name a function fn(completion: str, row: dict, **kwargs) -> float",
        )
    kwargs = dict(kwargs or {})
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        # Some builtins and C extensions expose no signature; they are called as they are.
        signature = None
    if signature is not None:
        try:
            signature.bind("", {}, **kwargs)
        except TypeError as exc:
            raise ImportObjectError(
                f"{spec!r} cannot be called as fn(completion, row, **reward.kwargs): {exc}",
                "make reward.kwargs match the function's keyword parameters, and let it take "
                "(completion, row) first",
            ) from exc
    return functools.partial(fn, **kwargs) if kwargs else fn
