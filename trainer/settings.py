"""The knobs the torch side reads: the run config's own sections, with the schema's defaults.

The trainer, the warm start and the self-check read a `RunConfig` (`refill.config`), whose
schema holds every knob's one default: there is no trainer-side copy of a default to disagree
with it. `read_settings` also takes any object with the same dotted attributes (a
`SimpleNamespace` in a test, a mapping): what it names is copied over the schema's defaults.
Either way the values the trainer cannot run with are then rejected, naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from refill.config import RunConfig

SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16", "auto")

#: The trainer's settings are the run config (the name the trainer's signatures use).
TrainerConfig = RunConfig

_MISSING = object()


def _copy_into(target: BaseModel, source: Any) -> None:
    """Copy the fields `source` names onto `target`, section by section, without validation:
    `validate` below names what the trainer cannot run with."""
    for name in type(target).model_fields:
        if isinstance(source, Mapping):
            value = source.get(name, _MISSING)
        else:
            value = getattr(source, name, _MISSING)
        if value is _MISSING:
            continue
        current = getattr(target, name)
        if isinstance(current, BaseModel) and not isinstance(value, BaseModel):
            _copy_into(current, value)
            continue
        if isinstance(current, tuple) and value is not None:
            value = tuple(value)
        setattr(target, name, value)


def read_settings(config: Any) -> RunConfig:
    """The trainer's knobs from `config` (a RunConfig, or any object with the dotted attributes,
    the schema's defaults standing for those it lacks), validated."""
    if isinstance(config, RunConfig):
        settings = config
    else:
        settings = RunConfig()
        _copy_into(settings, config)
    validate(settings)
    return settings


def validate(s: RunConfig) -> None:
    """Reject values the trainer cannot run with, naming the key and what would work."""
    problems = []
    if not 0 <= s.loss.ratio_clip_min < 1:
        problems.append(f"loss.ratio_clip_min={s.loss.ratio_clip_min}: must be in [0, 1)")
    if s.loss.ratio_clip_max < 0:
        problems.append(f"loss.ratio_clip_max={s.loss.ratio_clip_max}: must be >= 0")
    truncation = s.loss.truncated_importance_sampling_ratio
    if truncation is not None and truncation <= 0:
        problems.append(
            "loss.truncated_importance_sampling_ratio="
            f"{s.loss.truncated_importance_sampling_ratio}: must be > 0 (2.0 is usual)"
        )
    if s.loss.reference_policy_kl_penalty < 0:
        problems.append("loss.reference_policy_kl_penalty must be >= 0 (0 turns the KL off)")
    shaping = s.grpo.reward_shaping
    if shaping.enabled:
        max_len = shaping.max_response_length or s.generation.max_new_tokens
        if shaping.overlong_buffer_length <= 0 or shaping.overlong_buffer_length > max_len:
            problems.append(
                f"grpo.reward_shaping.overlong_buffer_length={shaping.overlong_buffer_length}: "
                f"must be in [1, max_response_length={max_len}]"
            )
    if s.optimizer.scheduler not in SCHEDULERS:
        problems.append(
            f"optimizer.scheduler={s.optimizer.scheduler!r}: use one of {', '.join(SCHEDULERS)}"
        )
    if s.optimizer.scheduler != "constant" and not s.grpo.max_num_steps:
        problems.append(
            f"optimizer.scheduler={s.optimizer.scheduler!r} decays to zero at "
            "grpo.max_num_steps, which is not set: set it or use scheduler 'constant'"
        )
    if s.optimizer.micro_batch_tokens < 1:
        problems.append("optimizer.micro_batch_tokens must be >= 1")
    if s.optimizer.groups_per_update is not None and s.optimizer.groups_per_update < 1:
        problems.append(
            f"optimizer.groups_per_update={s.optimizer.groups_per_update}: must be >= 1 "
            "(null: the whole step in one update)"
        )
    if s.optimizer.passes_per_step < 1:
        problems.append(f"optimizer.passes_per_step={s.optimizer.passes_per_step}: must be >= 1")
    if s.optimizer.warmup_steps < 0:
        problems.append("optimizer.warmup_steps must be >= 0")
    if s.model.dtype not in DTYPES:
        problems.append(f"model.dtype={s.model.dtype!r}: use one of {', '.join(DTYPES)}")
    if s.generation.temperature <= 0:
        problems.append("generation.temperature must be > 0 for sampled GRPO groups")
    if s.optimizer.keep_checkpoints < 1:
        problems.append("optimizer.keep_checkpoints must be >= 1 (resume needs the latest one)")
    if s.async_rl.max_lookahead_versions < 0:
        problems.append("async_rl.max_lookahead_versions must be >= 0")
    if problems:
        raise ValueError("invalid trainer settings:\n  " + "\n  ".join(problems))
