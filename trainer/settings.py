"""The knobs the torch side reads from the run config, with their defaults.

The run config is a pydantic model owned by `refill.config`; the trainer only needs a
few of its fields. `read_settings` copies them, by the same dotted names, from any object that
has them as attributes (the pydantic config, these dataclasses, a `SimpleNamespace` in a test),
and falls back to the defaults below for a field the object does not have. The defaults here
are the ones the config schema should carry, so a run behaves the same whichever object built
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class LossSettings:
    ratio_clip_min: float = 0.2  # eps_low
    ratio_clip_max: float = 0.28  # eps_high (DAPO's clip-higher)
    token_level_loss: bool = True
    reference_policy_kl_penalty: float = 0.0
    use_importance_sampling_correction: bool = False
    # None: no truncation (the plain importance ratio; unbounded variance, not advised).
    truncated_importance_sampling_ratio: float | None = 2.0


@dataclass
class RewardShapingSettings:
    enabled: bool = False
    overlong_buffer_length: int = 0
    overlong_buffer_penalty: float = 1.0
    # None: use generation.max_new_tokens, the length at which the engine cuts a completion.
    max_response_length: int | None = None


@dataclass
class GRPOSettings:
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    reward_shaping: RewardShapingSettings = field(default_factory=RewardShapingSettings)
    # Only read by the `linear` and `cosine` schedules, which decay to zero at this step.
    max_num_steps: int | None = None


@dataclass
class OptimizerSettings:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    scheduler: str = "constant"
    micro_batch_tokens: int = 4096
    # How many trainer checkpoints (optimizer, scheduler, RNG) to keep on disk.
    keep_checkpoints: int = 2


@dataclass
class WarmStartSettings:
    # None: on when the model directory holds no weights (a randomly initialised model solves
    # nothing, so every group would be zero-variance), off for a pretrained checkpoint.
    enabled: bool | None = None
    steps: int = 400
    lr: float = 3e-3
    batch_size: int = 64
    # None: $REFILL_CACHE_DIR/warmstart, else ~/.cache/refill/warmstart.
    cache_dir: str | None = None
    # Fraction of warm-start answers followed by a stray "." before <eos>. The model then knows
    # many answers but often ends them untidily, which exact match counts wrong: the gap
    # between knowing and answering in the expected format that GRPO closes first on real
    # models, and one it closes within a few dozen steps here.
    format_noise: float = 0.6
    # Seeds the random init and the warm-start data; part of the cache key.
    seed: int = 1234


@dataclass
class ModelSettings:
    name_or_path: str = "builtin:tiny-arith"
    dtype: str = "float32"
    warm_start: WarmStartSettings = field(default_factory=WarmStartSettings)


@dataclass
class RunSettings:
    seed: int = 0


@dataclass
class AsyncRLSettings:
    max_lookahead_versions: int = 0


@dataclass
class GenerationSettings:
    # The trainer scores tokens under the same temperature the engine sampled with, so its
    # log-probs and the engine's are of one distribution (what importance weights compare).
    temperature: float = 1.0
    max_new_tokens: int = 8


@dataclass
class DataSettings:
    # `str.format` template over the dataset row; the warm start formats its prompts with it
    # so the model is warm-started on exactly the text the engines will be given.
    prompt_template: str = "{prompt}"


@dataclass
class TrainerConfig:
    """The subset of the run config the trainer, the warm start and the self-check read."""

    loss: LossSettings = field(default_factory=LossSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    run: RunSettings = field(default_factory=RunSettings)
    async_rl: AsyncRLSettings = field(default_factory=AsyncRLSettings)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    data: DataSettings = field(default_factory=DataSettings)


_MISSING = object()


def _copy_into(target: Any, source: Any, where: str) -> None:
    for f in fields(target):
        value = getattr(source, f.name, _MISSING) if source is not None else _MISSING
        current = getattr(target, f.name)
        if is_dataclass(current):
            _copy_into(current, None if value is _MISSING else value, f"{where}{f.name}.")
            continue
        if value is _MISSING:
            continue
        if isinstance(current, tuple) and value is not None:
            value = tuple(value)
        setattr(target, f.name, value)


def read_settings(config: Any) -> TrainerConfig:
    """The trainer's knobs from `config` (any object with the dotted attributes), validated."""
    if isinstance(config, TrainerConfig):
        settings = config
    else:
        settings = TrainerConfig()
        _copy_into(settings, config, "")
    validate(settings)
    return settings


def validate(s: TrainerConfig) -> None:
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
