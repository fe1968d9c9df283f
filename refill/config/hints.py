"""Turning what pydantic reports into problems a user can act on: an unknown key gets the key
meant (or where refill keeps it, for keys NeMo RL keeps elsewhere), a value out of range gets
why the range is what it is and what to set."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from refill.config.errors import Problem
from refill.config.schema import all_field_paths, join_path, model_at

# Keys NeMo RL keeps somewhere else, or that refill has no equivalent for.
_MOVED: dict[str, tuple[str, str]] = {
    "async_rl.rollout_failure": (
        "refill keeps rollout_failure as a top-level section (fault tolerance is its own budget, "
        "separate from async settings and from the dynamic-sampling budget)",
        "move the block out of async_rl to the top level: rollout_failure.<key>",
    ),
    "async_rl.sampler.max_lookahead_versions": (
        "refill keeps max_lookahead_versions at async_rl.max_lookahead_versions, because the "
        "staleness gate applies to every sampler",
        "move it to async_rl.max_lookahead_versions",
    ),
    "token_capture": (
        "refill has no token-capture path (it returns token ids from every backend)",
        "remove it",
    ),
    "policy": (
        "refill splits NeMo RL's policy section: the model is model.name_or_path, sampling is "
        "generation, the optimizer is optimizer",
        "move each key to model, generation or optimizer",
    ),
    "loss_fn": ("refill calls this section loss", "rename loss_fn to loss"),
    "cluster": (
        "refill has no cluster section: generation workers are Celery processes, and the broker and "
        "ledger are set in infra",
        "remove it; set infra.database_url and infra.broker_url for a fleet",
    ),
    "checkpointing": (
        "refill keeps checkpoint settings in optimizer",
        "use optimizer.checkpoint_every_steps and optimizer.keep_checkpoints",
    ),
}


_FIELD_INDEX = all_field_paths()


def unknown_key(loc: list[str]) -> Problem:
    path = ".".join(loc)
    key = loc[-1]
    hint = _MOVED.get(path) or (_MOVED["token_capture"] if key == "token_capture" else None)
    if hint is not None:
        why, fix = hint
        return Problem(path, f"unknown key; {why}", fix)
    model = model_at(loc[:-1])
    valid = sorted(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return Problem(path, "unknown key", f"did you mean {join_path('.'.join(loc[:-1]), close[0])}?")
    elsewhere = [p for p in _FIELD_INDEX.get(key, []) if p != path]
    if elsewhere:
        return Problem(path, f"unknown key here; refill keeps {key} at {' and '.join(elsewhere)}",
                       f"move it to {elsewhere[0]}")
    where = f"under {'.'.join(loc[:-1])}" if len(loc) > 1 else "at the top level"
    return Problem(path, "unknown key", f"remove it; the keys {where} are: {', '.join(valid)}")


# Why a key has its range, and the fix to suggest, for the keys SPEC §5 names and the ones users
# most often get wrong.
_FIELD_HINTS: dict[str, tuple[str, str]] = {
    "grpo.dynamic_sampling_max_replacements_per_slot": (
        "it is how many filtered groups one slot may replace before the run fails; below 1 the "
        "first filtered group would fail it",
        "set it to at least 1; the default 32 keeps p**(budget+1) * num_prompts_per_step * "
        "max_num_steps small at any drop rate p seen in practice",
    ),
    "grpo.num_generations_per_prompt": (
        "a group needs completions to compare",
        "set it to 2 or more (8-16 is usual)",
    ),
    "async_rl.max_lookahead_versions": (
        "it is how many weight versions generation may run ahead of the trainer",
        "set it to 0 (strictly on-policy) or more; the default is 1",
    ),
    "rollout_failure.min_step_batch_fraction": (
        "it is the smallest share of num_prompts_per_step a step may train on",
        "set it in (0, 1]: 1.0 requires every step to be full, the default is 0.9",
    ),
    "rollout_failure.max_replacement_attempts": (
        "it is how many dropped prompts one slot may replace",
        "set it to 1 or more (0 only with on_dropped_prompt: shrink)",
    ),
    "rollout_failure.replacement_reserve_prompts": (
        "it is the spare pool's low-water mark",
        "set it to at least grpo.num_prompts_per_step, or remove it (it defaults to that)",
    ),
    "generation.top_p": ("it is the nucleus mass sampled from", "set it in (0, 1]; 1.0 disables nucleus sampling"),
    "generation.temperature": ("0 would divide the logits by zero", "set it above 0; 1.0 samples the model as it is"),
    "loss.ratio_clip_min": (
        "the lower clip bound is 1 - ratio_clip_min, which must stay positive",
        "set it in [0, 1); DAPO uses 0.2",
    ),
    "optimizer.betas": ("", "write two numbers in [0, 1), e.g. [0.9, 0.999]"),
}


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def describe(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict | list):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)


def error_to_problem(err: Mapping[str, Any], prefix: list[str]) -> Problem:
    kind = err["type"]
    if kind == "extra_forbidden":
        return unknown_key(prefix + [str(x) for x in err["loc"]])
    loc = prefix + [f"[{x}]" if isinstance(x, int) else str(x) for x in err["loc"]]
    # Pydantic adds validator and union names (e.g. "function-after[...]", "literal['arith']")
    # to a location; they name no key.
    loc = [part for part in loc if re.fullmatch(r"\[\d+\]", part) or not re.search(r"[\[\](),' ]", part)]
    path = re.sub(r"\.\[", "[", ".".join(loc or prefix))
    ctx = err.get("ctx") or {}
    got = describe(err.get("input"))
    why, fix = _FIELD_HINTS.get(path, ("", ""))
    why = f" ({why})" if why else ""
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = _number(next(iter(ctx.values())))
        must, to = {"greater_than": ("greater than", "above"), "greater_than_equal": ("at least", "to at least"),
                    "less_than": ("less than", "below"), "less_than_equal": ("at most", "to at most")}[kind]
        return Problem(path, f"must be {must} {bound}, got {got}{why}", fix or f"set it {to} {bound}")
    if kind == "value_error":
        return Problem(path, f"{ctx.get('error', err['msg'])}{why}", fix or "correct the value")
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        options = re.findall(r"'([^']*)'", expected)
        close = difflib.get_close_matches(str(err.get("input")), options, n=1, cutoff=0.5)
        fix = f"did you mean {close[0]!r}?" if close else f"use one of {expected}"
        return Problem(path, f"must be one of {expected}, got {got}", fix)
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return Problem(path, f"must be a whole number, got {got}", "write an integer such as 8")
    if kind in ("float_type", "float_parsing"):
        return Problem(path, f"must be a number, got {got}", "write a number such as 0.5")
    if kind in ("bool_type", "bool_parsing"):
        return Problem(path, f"must be true or false, got {got}", "write true or false")
    if kind == "string_type":
        return Problem(path, f"must be a string, got {got}", "quote the value")
    if kind in ("string_too_short",):
        return Problem(path, "must not be empty", "give it a value, or remove the key to use the default")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return Problem(path, f"must be a mapping of keys, got {got}", "write it as indented key: value lines")
    if kind == "missing" and loc and loc[-1].startswith("["):
        # A tuple shorter than its type: report it on the tuple, not on the absent element.
        parent = re.sub(r"\[\d+\]$", "", path)
        return Problem(parent, f"must be a pair of numbers, got {got}", "write it as [0.9, 0.999]")
    if kind == "missing":
        return Problem(path, "is required", "set it")
    if kind in ("tuple_type", "too_long", "too_short"):
        return Problem(path, f"must be a pair of numbers, got {got}", "write it as [0.9, 0.999]")
    return Problem(path, err["msg"], "correct the value")

