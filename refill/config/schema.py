"""The run configuration's schema: every knob, declared once, with its one default.

Each section is a pydantic model that forbids unknown keys and is strict; `RunConfig` holds
them all. Everything else reads a validated `RunConfig`: `load_config` / `config_from_dict`
build one from YAML (with every check), and `from_snapshot` rebuilds one from the snapshot a
run stored in the ledger, so a knob missing from an older snapshot gets the default below.
Knob names follow NeMo RL where it has them (SPEC §5).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from refill.config.urls import redact_url, url_has_password
from refill.config.warnings import config_warnings

MiB = 1024 * 1024

# ---------------------------------------------------------------------------------------------
# The sections. Every model forbids unknown keys and is strict: YAML's `yes` or `8.0` for a
# count is a mistake worth reporting, not coercing.


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


def _expand_user(value: Any) -> Any:
    # The trainer and workers open these paths as given; expanding `~` here means the checked
    # path and the used path are the same string.
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


PathStr = Annotated[str, BeforeValidator(_expand_user)]


class RunSection(_Section):
    name: str | None = None  # load_config fills in the YAML file's stem
    seed: int = 0
    output_dir: PathStr = "runs"
    # This run's weight when runs share one fleet: the relay keeps at most
    # share * REFILL_QUEUED_PER_SHARE of its attempts waiting on the broker, so runs that all
    # have work get the generation workers in proportion to their shares (refill.tasks.relay).
    share: float = Field(1.0, gt=0, le=1000)


class PromptSkippingConfig(_Section):
    """GRESO's pre-rollout skipping (arXiv 2506.02177): a prompt whose last `k` groups were all
    solved (or all failed) is generated with probability `max(rate**k, min_exploration)` when the
    data loader reaches it, and skipped (no generation; recorded in `prompt_draws`) otherwise.
    `rate` is the exploration rate of its kind, adapted after each step as GRESO does."""

    enabled: bool = False
    # GRESO's p_easy / p_hard at the start: each kind's exploration rate before any adaptation.
    exploration_rate: float = Field(0.5, gt=0, le=1)
    # The floor of a prompt's chance to be generated: no prompt is skipped with probability
    # above 1 - min_exploration, so every prompt is tried again in time (GRESO: 0.01).
    min_exploration: float = Field(0.01, gt=0, le=1)
    # After each released step (from the second epoch on), a kind's rate falls by
    # exploration_rate_step when its share of the step's groups is at or above its target, and
    # rises by it otherwise, within [exploration_rate_min, exploration_rate_max] (GRESO: 0.01
    # within [0.05, 0.95]).
    exploration_rate_step: float = Field(0.01, ge=0, le=1)
    exploration_rate_min: float = Field(0.05, gt=0, le=1)
    exploration_rate_max: float = Field(0.95, gt=0, le=1)
    # The share of zero-variance groups aimed at; all-solved groups get target_solved_fraction of
    # it and all-failed ones the rest (GRESO: 0.25, split 1/3 : 2/3 since a failed prompt is the
    # likelier to become useful while the reward rises).
    target_zero_variance: float = Field(0.25, ge=0, le=1)
    target_solved_fraction: float = Field(1 / 3, ge=0, le=1)

    @model_validator(mode="after")
    def _rates_in_order(self) -> PromptSkippingConfig:
        if not self.exploration_rate_min <= self.exploration_rate <= self.exploration_rate_max:
            raise ValueError(
                f"exploration_rate={self.exploration_rate} must lie within exploration_rate_min="
                f"{self.exploration_rate_min} and exploration_rate_max={self.exploration_rate_max}"
            )
        return self


class DataConfig(_Section):
    train_path: PathStr | None = None
    builtin: Literal["arith"] | None = None
    builtin_size: int = Field(4000, ge=1)
    prompt_key: str = Field("prompt", min_length=1)
    # Formatted with the row's fields (str.format); when unset it becomes "{<prompt_key>}".
    prompt_template: str = "{prompt}"
    shuffle: bool = True
    max_rows: int | None = Field(None, ge=1)
    # A row field holding each prompt's id (a string or an integer, distinct per row), shown by
    # `refill prompts`. None: a prompt is known by its row's position in the data set.
    prompt_id_field: str | None = Field(None, min_length=1)
    prompt_skipping: PromptSkippingConfig = Field(default_factory=PromptSkippingConfig)


# Warm-start defaults live here so the trainer can tune them in one place.
WARM_START_STEPS = 400
WARM_START_LR = 3e-3
WARM_START_BATCH_SIZE = 64


class WarmStartConfig(_Section):
    enabled: bool = False
    steps: int = Field(WARM_START_STEPS, ge=1)
    lr: float = Field(WARM_START_LR, gt=0)
    batch_size: int = Field(WARM_START_BATCH_SIZE, ge=1)
    cache_dir: PathStr | None = None
    seed: int = 1234  # seeds the random init and the warm-start data; part of the cache key
    # Share of warm-start answers taught with a stray "." before the end of sequence: the model
    # then knows most answers but not the format, so GRPO has something to learn quickly.
    format_noise: float = Field(0.6, ge=0, le=1)


class ModelConfig(_Section):
    name_or_path: PathStr = Field("builtin:tiny-arith", min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)


class SimLatencyConfig(_Section):
    distribution: Literal["constant", "lognormal", "exponential"] = "constant"
    mean_seconds: float = Field(0.0, ge=0)
    sigma: float = Field(0.5, ge=0)


class SimLearningConfig(_Section):
    # The share of prompts (chosen by their key) whose solve rate rises with the weight version:
    # r_v = 1 - (1 - r_0) * (1 - rate)**v. 0.0: no prompt learns (fixed difficulty).
    share: float = Field(0.0, ge=0, le=1)
    rate: float = Field(0.05, ge=0, le=1)


class SimConfig(_Section):
    # When set, overrides the two Beta parameters; reachable only in (2**(1 - n), 1).
    zero_variance_fraction: float | None = Field(None, gt=0, lt=1)
    solve_rate_alpha: float = Field(1.0, gt=0)
    solve_rate_beta: float = Field(1.0, gt=0)
    latency: SimLatencyConfig = Field(default_factory=SimLatencyConfig)
    learning: SimLearningConfig = Field(default_factory=SimLearningConfig)
    failure_rate: float = Field(0.0, ge=0, le=1)
    tokens_per_completion: int = Field(8, ge=1)
    vocab_size: int = Field(100, ge=2)
    seed: int | None = None
    key_field: str | None = None  # a row field naming the prompt; None keys by the prompt text
    virtual: bool = False  # report sampled latency without sleeping (virtual-time benchmarks)
    # Fault tests: the share of groups returned one completion short (a data failure in the ledger).
    wrong_group_size_rate: float = Field(0.0, ge=0, le=1)
    # Fault tests: the share of groups padded past infra.max_result_bytes (refused by the worker).
    oversized_rate: float = Field(0.0, ge=0, le=1)


class VllmConfig(_Section):
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)
    enforce_eager: bool = False
    dtype: str = "auto"


class HFConfig(_Section):
    # "auto" is cuda when one is available, else cpu; anything else is a torch device name.
    device: str = Field("auto", min_length=1)


class GenerationConfig(_Section):
    backend: Literal["hf", "vllm", "sim"] = "hf"
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    use_chat_template: bool = False
    groups_in_flight: int = Field(8, ge=1)  # per engine
    max_batch_wait_ms: float = Field(10, ge=0)
    lease_seconds: float = Field(120, gt=0)
    heartbeat_seconds: float = Field(10, gt=0)
    queue_timeout_seconds: float = Field(600, gt=0)
    sim: SimConfig = Field(default_factory=SimConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    hf: HFConfig = Field(default_factory=HFConfig)


class RewardConfig(_Section):
    function: str = Field("refill.rewards.arith:exact_match", min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RewardShapingConfig(_Section):
    enabled: bool = False
    overlong_buffer_length: int = Field(0, ge=0)
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    # None means generation.max_new_tokens (the longest a completion can be).
    max_response_length: int | None = Field(None, ge=1)


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(8, ge=1)
    num_generations_per_prompt: int = Field(8, ge=1)
    max_num_steps: int = Field(100, ge=1)
    max_num_epochs: int | None = Field(1, ge=1)  # None cycles the data
    use_dynamic_sampling: bool = True
    # Expected exhausted slots over a run: p**(budget+1) * num_prompts_per_step * max_num_steps,
    # with p the zero-variance fraction the run reports.
    dynamic_sampling_max_replacements_per_slot: int = Field(32, ge=1)
    # A group whose raw rewards spread (max - min) by at most this has no GRPO signal. The
    # default judges floating-point noise as no spread: 0.1 + 0.2 and 0.3 differ by 5.6e-17, and
    # float32 rounding at reward scale 1 by about 6e-8; a spread that small, normalised by the
    # group's standard deviation, would train on noise as if it were a full +-1 advantage.
    zero_variance_tolerance: float = Field(1e-6, ge=0)
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    # NeMo RL's synchronous path reads these; refill accepts them so a copied config loads, and
    # warns that they do nothing here.
    dynamic_sampling_max_gen_batches: int | None = None
    batch_multiplier: float | None = None


class LossConfig(_Section):
    ratio_clip_min: float = Field(0.2, ge=0, lt=1)
    ratio_clip_max: float = Field(0.28, ge=0)
    token_level_loss: bool = True
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    use_importance_sampling_correction: bool = Field(
        True,
        description=(
            "Weight each token's policy-gradient term by pi_old / pi_sampling (AReaL's "
            "decoupled PPO: the behaviour-to-proximal weight), pi_old scored with the engine's "
            "temperature and top-p. NeMo RL: loss_fn.use_importance_sampling_correction."
        ),
    )
    truncated_importance_sampling_ratio: float | None = Field(
        2.0,
        gt=0,
        description=(
            "Cap of that weight (null: no cap). NeMo RL: "
            "loss_fn.truncated_importance_sampling_ratio."
        ),
    )


class OptimizerConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # The schedule counts training steps (one per step, however many updates it makes), as
    # verl's does, so warmup_steps and grpo.max_num_steps are in the same unit.
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    micro_batch_tokens: int = Field(4096, ge=1)
    groups_per_update: int | None = Field(
        None,
        ge=1,
        description=(
            "Groups (prompts) per optimizer update: a training step's groups are split, in "
            "order, into mini-batches of this many groups, one update each, all scored against "
            "the weights the step started from, so the clip (and clip-higher) acts from the "
            "second update on. null: the whole step in one update. verl: "
            "actor.ppo_mini_batch_size (in prompts); NeMo RL: policy.train_global_batch_size "
            "(in sequences) = this x grpo.num_generations_per_prompt."
        ),
    )
    passes_per_step: int = Field(
        1,
        ge=1,
        description=(
            "Passes over a training step's mini-batches (updates per step = mini-batches x "
            "passes). verl: actor.ppo_epochs; NeMo RL has no counterpart (one pass)."
        ),
    )
    checkpoint_every_steps: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)

    @field_validator("betas", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        # YAML has no tuples; accept its list form while keeping the elements strict.
        return tuple(value) if isinstance(value, list) else value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


class DistributedConfig(_Section):
    # A trainer of several ranks (`refill worker train --nproc N`, or the same under torchrun):
    # FSDP2 shards the policy, its gradients and its optimizer state over the ranks. A trainer
    # of one process ignores this section.
    # auto: bf16 parameters and compute with fp32 gradient reductions and fp32 master weights
    # on a GPU that has bf16, full precision elsewhere (the CPU); bf16: refuse to run without.
    mixed_precision: Literal["auto", "bf16", "off"] = "auto"
    # Recompute each block's activations in the backward pass instead of keeping them: less
    # memory for about a third more compute.
    activation_checkpointing: bool = False


class SamplerConfig(_Section):
    name: Literal["in_order", "ready_first", "weight_fifo", "windowed", "custom"] = "in_order"
    max_staleness_versions: int | None = Field(None, ge=0)  # windowed; <= max_lookahead_versions
    freshest_first: bool = False  # windowed
    import_path: str | None = None  # custom: module:object providing place and lender


class OverDispatchConfig(_Section):
    enabled: bool = True
    safety_sigmas: float = Field(2.0, ge=0)
    max_extra_fraction: float = Field(1.0, ge=0)
    # A step whose open slots are at most this fraction of its slots (at least one) is in its
    # tail: a group may fill one of them although it displaces an attempt generating with
    # weights too old for a later step (that attempt's group is then likely lost). Higher
    # fills a step sooner and wastes more (bench/README.md, `bench fill --refill tail=X`).
    tail_fraction: float = Field(0.01, ge=0, le=1)


class AsyncRLConfig(_Section):
    max_lookahead_versions: int = Field(1, ge=0)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    over_dispatch: OverDispatchConfig = Field(default_factory=OverDispatchConfig)


class RolloutFailureConfig(_Section):
    max_attempts_per_prompt: int = Field(3, ge=1)
    retry_backoff_seconds: float = Field(1.0, ge=0)
    retry_backoff_max_seconds: float = Field(60.0, ge=0)
    on_dropped_prompt: Literal["replace", "shrink"] = "replace"
    max_replacement_attempts: int = Field(1, ge=0)
    # Low-water mark of the spare pool (refilled one data-loader batch at a time when below it);
    # filtered groups draw on it under "shrink" too. None resolves to grpo.num_prompts_per_step.
    replacement_reserve_prompts: int | None = Field(None, ge=0)
    min_step_batch_fraction: float = Field(0.9, gt=0, le=1)
    max_consecutive_dropped_prompts: int = Field(16, ge=1)


class PayloadsConfig(_Section):
    # Where a group's rollout goes from the generation worker to the trainer. "files": the
    # claim check, stored under the run's directory (`<run_dir>/payloads`, shared by every
    # worker and the trainer, as the weights are), the result message carries its name, size
    # and checksum (a few hundred bytes at any rollout length). "inline": in the result
    # message itself (JSON through the broker; the message grows with the rollout).
    store: Literal["files", "inline"] = "files"
    # The controller removes the stored payloads no committed group holds (a worker that died
    # after storing one, a consumer that died before removing a discarded one) this often.
    sweep_interval_seconds: float = Field(60.0, gt=0)
    # A finished run's payloads: "keep" them until `refill gc RUN`, or "delete" them when the
    # run completes or fails (a stopped run keeps them: it may resume).
    retention: Literal["keep", "delete"] = "keep"


class InfraConfig(_Section):
    # REFILL_DATABASE_URL / REFILL_BROKER_URL override these; see resolved_urls().
    database_url: str | None = None
    broker_url: str | None = None
    trainer: Literal["torch", "null"] = "torch"
    null_trainer_delay_seconds: float = Field(0.0, ge=0)
    consumer_batch_size: int = Field(64, ge=1)
    consumer_batch_wait_ms: float = Field(20, ge=0)
    max_result_bytes: int = Field(64 * MiB, ge=1024)
    payloads: PayloadsConfig = Field(default_factory=PayloadsConfig)
    # The controller's loop: relay what is due every relay interval; admit, reap expired leases
    # and check the run's end every reaper interval.
    relay_interval_seconds: float = Field(0.05, gt=0)
    reaper_interval_seconds: float = Field(1.0, gt=0)
    trainer_lease_seconds: float = Field(600, gt=0)
    # A step whose training fails (an exception, or a trainer that dies) this many times fails
    # the run with the last error instead of being retried forever.
    max_train_attempts: int = Field(3, ge=1)


class TensorBoardConfig(_Section):
    enabled: bool = False
    # None: <run_dir>/tensorboard. Set: <dir>/<run name>-<run id>, so runs can share one
    # `tensorboard --logdir <dir>`.
    dir: PathStr | None = None


class WandbConfig(_Section):
    enabled: bool = False
    project: str = Field("refill", min_length=1)
    entity: str | None = None
    # "offline" writes the run under WANDB_DIR (else the run directory) and needs no network;
    # `wandb sync` uploads it later.
    mode: Literal["online", "offline"] = "online"


class MlflowConfig(_Section):
    enabled: bool = False
    # None: MLflow's own choice (MLFLOW_TRACKING_URI, else its default store).
    tracking_uri: str | None = None
    experiment: str = Field("refill", min_length=1)

    @field_validator("tracking_uri")
    @classmethod
    def _no_password(cls, value: str | None) -> str | None:
        # The config is stored in the ledger and logged as the run's parameters.
        if url_has_password(value):
            raise ValueError(
                "must not hold a password (the ledger stores the config); put the credentials "
                "in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD"
            )
        return value


class LoggingConfig(_Section):
    """Experiment trackers: each trained step's metrics, logged by the run's controller."""

    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)


SECTIONS: dict[str, type[_Section]] = {
    "run": RunSection,
    "data": DataConfig,
    "model": ModelConfig,
    "generation": GenerationConfig,
    "reward": RewardConfig,
    "grpo": GRPOConfig,
    "loss": LossConfig,
    "optimizer": OptimizerConfig,
    "async_rl": AsyncRLConfig,
    "rollout_failure": RolloutFailureConfig,
    "infra": InfraConfig,
    "logging": LoggingConfig,
    "distributed": DistributedConfig,
}


class RunConfig(_Section):
    """A whole run. Build it with `load_config` / `config_from_dict`, which run every check;
    constructing it directly checks only types and ranges."""

    run: RunSection = Field(default_factory=RunSection)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    async_rl: AsyncRLConfig = Field(default_factory=AsyncRLConfig)
    rollout_failure: RolloutFailureConfig = Field(default_factory=RolloutFailureConfig)
    infra: InfraConfig = Field(default_factory=InfraConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    # Warnings only the loader can know (what the file said before ${VAR} expansion).
    _load_warnings: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _resolve(self) -> RunConfig:
        resolve_sections(self)
        return self

    def warnings(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Things that will run but probably not as meant, each saying what to set."""
        return list(self._load_warnings) + config_warnings(self, os.environ if environ is None else environ)

    def snapshot(self) -> dict[str, Any]:
        """The resolved config as JSON-able data, URL passwords hidden: what the ledger stores."""
        data = self.model_dump(mode="json")
        for key in ("database_url", "broker_url"):
            data["infra"][key] = redact_url(data["infra"][key])
        return data

    def config_hash(self) -> str:
        """sha256 (hex) of the snapshot; equal resolved configs hash equal on any machine."""
        canonical = json.dumps(self.snapshot(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def resolve_sections(cfg: Any) -> None:
    """Fill in defaults that depend on other knobs, so the resolved config shows real values.

    Works on a RunConfig or on a namespace holding only the sections that validated.
    """
    rf, grpo, data = (getattr(cfg, k, None) for k in ("rollout_failure", "grpo", "data"))
    if rf is not None and grpo is not None and rf.replacement_reserve_prompts is None:
        rf.replacement_reserve_prompts = grpo.num_prompts_per_step
    if data is not None and "prompt_template" not in data.model_fields_set and data.prompt_key != "prompt":
        # Setting prompt_key alone should be enough to read a file whose field is not "prompt".
        data.prompt_template = "{" + data.prompt_key + "}"



# ---------------------------------------------------------------------------------------------
# Finding a key's place in the schema (for the loader's hints and its env expansion)


def join_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def field_model(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (through Optional and the like), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = field_model(arg)
        if found is not None:
            return found
    return None


def model_at(names: Iterable[str]) -> type[BaseModel] | None:
    """The model of the section at a key path (`["generation", "sim"]`), or None if none is."""
    model: type[BaseModel] | None = RunConfig
    for name in names:
        if model is None or name not in model.model_fields:
            return None
        model = field_model(model.model_fields[name].annotation)
    return model


def all_field_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, list[str]]:
    """Every key name and the dotted paths where the schema has it."""
    index: dict[str, list[str]] = {}
    for name, info in model.model_fields.items():
        path = join_path(prefix, name)
        index.setdefault(name, []).append(path)
        sub = field_model(info.annotation)
        if sub is not None:
            for key, paths in all_field_paths(sub, path).items():
                index.setdefault(key, []).extend(paths)
    return index
