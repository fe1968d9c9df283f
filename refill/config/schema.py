"""The run configuration: pydantic models loaded from YAML, validated at setup.

`load_config(path)` returns a `RunConfig` or raises `ConfigError` whose `problems` list every
problem found (not only the first), each as `key.path: message. Fix: ...`. Knob names follow
NeMo RL where it has them (SPEC §5), so a user of its dynamic sampling feels at home; keys that
NeMo RL keeps elsewhere get a hint that says where refill keeps them.

Validation runs in three passes so that one mistake does not hide the others:
1. each section is validated on its own (types, ranges, unknown keys);
2. cross-field checks run over every section that passed 1 (the SPEC §5 setup errors);
3. run-time checks (`check_runtime=True`) import the reward function, read the data set and load
   the model's config; unit tests of pure validation switch them off to stay fast.

Values may use `${VAR}` / `${VAR:-default}` to read the environment (see `_expand_env`), so a
shipped template can name machine-specific paths without being edited.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from refill.models.dataset import DatasetError, load_dataset, template_fields

MiB = 1024 * 1024

DATABASE_URL_ENV = "REFILL_DATABASE_URL"
BROKER_URL_ENV = "REFILL_BROKER_URL"
EMBEDDED_BROKER_URL = "memory://"


# ---------------------------------------------------------------------------------------------
# Problems and errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (`path`), what (`message`) and what to do (`fix`)."""

    path: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{where}{self.message.rstrip('.')}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A config that cannot run; `problems` holds every problem found."""

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        count = len(self.problems)
        body = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{head}{count} problem{'s' if count != 1 else ''} in the config:\n{body}")


class ConfigFileError(ConfigError):
    """The file itself cannot be read: missing, unreadable, or not YAML. One line, no key path."""

    def __init__(self, message: str, source: str | None = None) -> None:
        self.message = message
        ValueError.__init__(self, message)
        self.problems = [Problem("", message, "correct the file")]
        self.source = source


# ---------------------------------------------------------------------------------------------
# URLs and secrets

# Mirrors SQLAlchemy's URL grammar: the password runs from the first ':' after the user to the
# first '@', so a password holding '/' (not percent-encoded) is still hidden as a whole.
_URL_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.\-]*://[^:/@\s;,]*:)(?P<secret>[^@\s]*)(?P<at>@)")
_URL_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:password|passwd|pass|sslpassword|secret|token|api_key)=)(?P<secret>[^&#\s]*)",
    re.IGNORECASE,
)
REDACTED = "***"


def redact_url(url: str | None) -> str | None:
    """`url` with any password replaced by `***` (SQLAlchemy, redis, amqp and kombu URL lists)."""
    if not url:
        return url

    def hide(match: re.Match[str]) -> str:
        if not match.group("secret"):
            return match.group(0)
        return match.group("head") + REDACTED + (match.groupdict().get("at") or "")

    return _URL_QUERY_SECRET.sub(hide, _URL_USERINFO.sub(hide, url))


def url_has_password(url: str | None) -> bool:
    return bool(url) and redact_url(url) != url


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


class DataConfig(_Section):
    train_path: PathStr | None = None
    builtin: Literal["arith"] | None = None
    builtin_size: int = Field(4000, ge=1)
    prompt_key: str = Field("prompt", min_length=1)
    # Formatted with the row's fields (str.format); when unset it becomes "{<prompt_key>}".
    prompt_template: str = "{prompt}"
    shuffle: bool = True
    max_rows: int | None = Field(None, ge=1)


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


class SimConfig(_Section):
    # When set, overrides the two Beta parameters; reachable only in (2**(1 - n), 1).
    zero_variance_fraction: float | None = Field(None, gt=0, lt=1)
    solve_rate_alpha: float = Field(1.0, gt=0)
    solve_rate_beta: float = Field(1.0, gt=0)
    latency: SimLatencyConfig = Field(default_factory=SimLatencyConfig)
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
    zero_variance_tolerance: float = Field(0.0, ge=0)
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
    use_importance_sampling_correction: bool = True
    truncated_importance_sampling_ratio: float | None = Field(2.0, gt=0)


class OptimizerConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    micro_batch_tokens: int = Field(4096, ge=1)
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


class InfraConfig(_Section):
    # REFILL_DATABASE_URL / REFILL_BROKER_URL override these; see resolved_urls().
    database_url: str | None = None
    broker_url: str | None = None
    trainer: Literal["torch", "null"] = "torch"
    null_trainer_delay_seconds: float = Field(0.0, ge=0)
    consumer_batch_size: int = Field(64, ge=1)
    consumer_batch_wait_ms: float = Field(20, ge=0)
    max_result_bytes: int = Field(64 * MiB, ge=1024)
    # The controller's loop: relay the outbox every relay interval; admit, reap expired leases
    # and check the run's end every reaper interval.
    relay_interval_seconds: float = Field(0.05, gt=0)
    reaper_interval_seconds: float = Field(1.0, gt=0)
    trainer_lease_seconds: float = Field(600, gt=0)
    # A step whose training fails (an exception, or a trainer that dies) this many times fails
    # the run with the last error instead of being retried forever.
    max_train_attempts: int = Field(3, ge=1)


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

    # Warnings only the loader can know (what the file said before ${VAR} expansion).
    _load_warnings: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _resolve(self) -> RunConfig:
        _resolve_sections(self)
        return self

    def warnings(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Things that will run but probably not as meant, each saying what to set."""
        return list(self._load_warnings) + _config_warnings(self, os.environ if environ is None else environ)

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


def _resolve_sections(cfg: Any) -> None:
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
# URLs in effect


def resolved_urls(config: RunConfig, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(database URL, broker URL) in effect: environment, then config, then the embedded default.

    `postgresql://` and `postgres://` become `postgresql+psycopg://`: refill ships psycopg 3,
    while SQLAlchemy's bare scheme means psycopg2, and a URL copied from elsewhere should work.
    """
    env = os.environ if environ is None else environ
    db = env.get(DATABASE_URL_ENV) or config.infra.database_url
    broker = env.get(BROKER_URL_ENV) or config.infra.broker_url
    if not db:
        db = f"sqlite:///{config.run.output_dir}/refill.db"
    db = re.sub(r"^postgres(?:ql)?://", "postgresql+psycopg://", db)
    return db, broker or EMBEDDED_BROKER_URL


def is_embedded(config: RunConfig, environ: Mapping[str, str] | None = None) -> bool:
    """True when neither a database nor a broker URL is set: every role runs in one process."""
    env = os.environ if environ is None else environ
    return not (
        env.get(DATABASE_URL_ENV) or env.get(BROKER_URL_ENV)
        or config.infra.database_url or config.infra.broker_url
    )


_BROKER_SCHEMES = ("redis", "rediss", "memory", "amqp", "amqps", "pyamqp", "sentinel")


def _database_url_problem(url: str) -> str | None:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    base = scheme.split("+", 1)[0]
    if base not in ("sqlite", "postgresql", "postgres"):
        return f"{redact_url(url)!r} is not a PostgreSQL or SQLite URL"
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ArgumentError as exc:
        return f"{redact_url(url)!r} cannot be parsed: {redact_url(str(exc))}"
    return None


def _broker_url_problem(url: str) -> str | None:
    for part in re.split(r"[;]", url):
        scheme = part.split("://", 1)[0] if "://" in part else ""
        if scheme not in _BROKER_SCHEMES:
            return f"{redact_url(url)!r} is not a broker URL refill supports ({', '.join(_BROKER_SCHEMES)})"
    return None


# ---------------------------------------------------------------------------------------------
# Reading YAML

_ENV_TOKEN = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_ENV_BODY = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?$", re.DOTALL)
_NULLS = {"null", "Null", "NULL", "~"}


def _expand_env(
    value: Any,
    path: str,
    environ: Mapping[str, str],
    problems: list[Problem],
    origins: dict[str, str] | None = None,
) -> Any:
    """Expand `${VAR}` and `${VAR:-default}` in string values (`$${` is a literal `${`).

    `:-` takes the default when the variable is unset or empty, as in the shell. A value that is
    exactly one `${...}` and expands to a number, boolean or null is read as that type, so
    `max_num_steps: ${STEPS:-20}` stays an integer.
    """
    if isinstance(value, dict):
        return {k: _expand_env(v, _join(path, k), environ, problems, origins) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{path}[{i}]", environ, problems, origins) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    if origins is not None:
        origins[path] = value

    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "$${":
            return "${"
        if match.group(1) is None:
            problems.append(Problem(path, "has an unterminated '${'", "close it: ${NAME} or ${NAME:-default}"))
            return token
        body = _ENV_BODY.match(match.group(1))
        if body is None:
            problems.append(
                Problem(path, f"'{token}' is not a variable reference", "write ${NAME} or ${NAME:-default}")
            )
            return token
        name, default = body.group("name"), body.group("default")
        current = environ.get(name)
        if default is not None:
            return current if current else default
        if current is None:
            problems.append(
                Problem(path, f"environment variable {name} is not set",
                        f"export {name}=..., or give a default: ${{{name}:-value}}")
            )
            return token
        return current

    expanded = _ENV_TOKEN.sub(replace, value)
    if _ENV_TOKEN.fullmatch(value) and value != "$${" and not _takes_text(path):
        return _scalar(expanded)
    return expanded


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)", re.IGNORECASE)


def _scalar(text: str) -> Any:
    """`text` read as a YAML-ish scalar: null, boolean, integer or number, else the text itself."""
    stripped = text.strip()
    if stripped in _NULLS or stripped == "":
        return None
    if stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if _INT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    return text


def _takes_text(path: str) -> bool:
    """Whether the field at `path` holds a string, so an expanded value must stay text."""
    parts = [p for p in re.split(r"\.|\[\d+\]", path) if p]
    model = _model_at(parts[:-1]) if parts else None
    if model is None or parts[-1] not in model.model_fields:
        return True  # unknown key: leave it as written; validation reports it
    return _accepts_str(model.model_fields[parts[-1]].annotation)


def _accepts_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    if get_origin(annotation) is Annotated:
        return _accepts_str(get_args(annotation)[0])
    return any(_accepts_str(a) for a in get_args(annotation) if get_origin(annotation) is not tuple)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _duplicate_keys(node: yaml.Node, path: str = "") -> list[Problem]:
    """Keys given twice in one mapping: PyYAML keeps the last one silently, losing settings."""
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or key == "<<":
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(
                    Problem(_join(path, key), f"is given twice (lines {seen[key]} and {line}); the "
                            "second would silently replace the first", "keep one of them")
                )
            else:
                seen[key] = line
            problems += _duplicate_keys(value_node, _join(path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{path}[{i}]")
    return problems


def read_yaml(path: str | os.PathLike[str]) -> tuple[Any, list[Problem]]:
    """The parsed YAML document and any duplicate-key problems; raises `ConfigFileError`."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"{source}: no such file", source) from None
    except IsADirectoryError:
        raise ConfigFileError(f"{source}: is a directory, not a YAML file", source) from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})", source) from None
    except OSError as exc:
        raise ConfigFileError(f"{source}: cannot be read ({exc.strerror})", source) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigFileError(f"{source}{where}: invalid YAML: {what}", source) from None
    return data, (_duplicate_keys(node) if node is not None else [])


# ---------------------------------------------------------------------------------------------
# Turning pydantic errors into problems

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


def _field_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _field_model(arg)
        if found is not None:
            return found
    return None


def _model_at(names: Iterable[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = RunConfig
    for name in names:
        if model is None or name not in model.model_fields:
            return None
        model = _field_model(model.model_fields[name].annotation)
    return model


def _all_field_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for name, info in model.model_fields.items():
        path = _join(prefix, name)
        index.setdefault(name, []).append(path)
        sub = _field_model(info.annotation)
        if sub is not None:
            for key, paths in _all_field_paths(sub, path).items():
                index.setdefault(key, []).extend(paths)
    return index


_FIELD_INDEX = _all_field_paths()


def _unknown_key(loc: list[str]) -> Problem:
    path = ".".join(loc)
    key = loc[-1]
    hint = _MOVED.get(path) or (_MOVED["token_capture"] if key == "token_capture" else None)
    if hint is not None:
        why, fix = hint
        return Problem(path, f"unknown key; {why}", fix)
    model = _model_at(loc[:-1])
    valid = sorted(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return Problem(path, "unknown key", f"did you mean {_join('.'.join(loc[:-1]), close[0])}?")
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


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict | list):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)


def _error_to_problem(err: Mapping[str, Any], prefix: list[str]) -> Problem:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key(prefix + [str(x) for x in err["loc"]])
    loc = prefix + [f"[{x}]" if isinstance(x, int) else str(x) for x in err["loc"]]
    # Pydantic adds validator and union names (e.g. "function-after[...]", "literal['arith']")
    # to a location; they name no key.
    loc = [part for part in loc if re.fullmatch(r"\[\d+\]", part) or not re.search(r"[\[\](),' ]", part)]
    path = re.sub(r"\.\[", "[", ".".join(loc or prefix))
    ctx = err.get("ctx") or {}
    got = _describe(err.get("input"))
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


# ---------------------------------------------------------------------------------------------
# Cross-field checks (SPEC §5). Each names the keys it reads and runs only when none of them
# failed validation, so one bad value neither hides the other checks nor trips them with a default
# standing in for it.

Check = Callable[[SimpleNamespace], Iterable[Problem]]
_CHECKS: list[tuple[tuple[str, ...], Check]] = []
_RUNTIME_CHECKS: list[tuple[tuple[str, ...], Check]] = []


def _check(*reads: str, runtime: bool = False) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        (_RUNTIME_CHECKS if runtime else _CHECKS).append((reads, fn))
        return fn

    return register


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _can_run(reads: tuple[str, ...], sections: Mapping[str, Any], failed: set[str]) -> bool:
    return all(
        r.split(".", 1)[0] in sections and not any(_overlaps(r, f) for f in failed) for r in reads
    )


@_check("grpo.use_dynamic_sampling", "grpo.num_generations_per_prompt")
def _check_dynamic_sampling(c: SimpleNamespace) -> Iterable[Problem]:
    g = c.grpo
    if g.use_dynamic_sampling and g.num_generations_per_prompt < 2:
        yield Problem(
            "grpo.num_generations_per_prompt",
            f"is {g.num_generations_per_prompt} with grpo.use_dynamic_sampling on: a group of one "
            "completion has no reward spread, so every group would be filtered",
            "set it to 2 or more (8-16 is usual), or set grpo.use_dynamic_sampling: false",
        )


@_check("rollout_failure.on_dropped_prompt", "rollout_failure.max_replacement_attempts")
def _check_drop_replacements(c: SimpleNamespace) -> Iterable[Problem]:
    rf = c.rollout_failure
    if rf.on_dropped_prompt == "replace" and rf.max_replacement_attempts < 1:
        yield Problem(
            "rollout_failure.max_replacement_attempts",
            "is 0 under on_dropped_prompt: replace, so a dropped prompt could never be replaced",
            "set it to at least 1, or set rollout_failure.on_dropped_prompt: shrink",
        )


@_check("grpo.use_dynamic_sampling", "grpo.num_prompts_per_step",
        "rollout_failure.replacement_reserve_prompts", "rollout_failure.on_dropped_prompt")
def _check_spare_pool(c: SimpleNamespace) -> Iterable[Problem]:
    g, rf = c.grpo, c.rollout_failure
    reserve = rf.replacement_reserve_prompts
    if g.use_dynamic_sampling and reserve is not None and reserve < 1:
        yield Problem(
            "rollout_failure.replacement_reserve_prompts",
            f"is {reserve} with grpo.use_dynamic_sampling on: filtered groups are replaced from the "
            f"spare pool under on_dropped_prompt: {rf.on_dropped_prompt} too, and a low-water mark "
            "of 0 is met by an empty pool, so every filtered group would shrink its step",
            "set it to at least grpo.num_prompts_per_step, or remove it (it defaults to that)",
        )


@_check("rollout_failure.retry_backoff_seconds", "rollout_failure.retry_backoff_max_seconds")
def _check_backoff(c: SimpleNamespace) -> Iterable[Problem]:
    rf = c.rollout_failure
    if rf.retry_backoff_max_seconds < rf.retry_backoff_seconds:
        yield Problem(
            "rollout_failure.retry_backoff_max_seconds",
            f"({rf.retry_backoff_max_seconds}) is below retry_backoff_seconds ({rf.retry_backoff_seconds})",
            "set it to at least retry_backoff_seconds",
        )


@_check("async_rl.sampler", "async_rl.max_lookahead_versions")
def _check_window(c: SimpleNamespace) -> Iterable[Problem]:
    a = c.async_rl
    s = a.sampler
    if s.name == "windowed" and s.max_staleness_versions is not None \
            and s.max_staleness_versions > a.max_lookahead_versions:
        yield Problem(
            "async_rl.sampler.max_staleness_versions",
            f"({s.max_staleness_versions}) exceeds async_rl.max_lookahead_versions "
            f"({a.max_lookahead_versions}): generation is never admitted that far ahead, and the "
            "trainer never trains a group staler than the lookahead",
            f"set it to at most {a.max_lookahead_versions}, or raise async_rl.max_lookahead_versions",
        )


@_check("generation.backend", "generation.sim", "grpo.num_generations_per_prompt")
def _check_sim(c: SimpleNamespace) -> Iterable[Problem]:
    p = c.generation.sim.zero_variance_fraction
    n = c.grpo.num_generations_per_prompt
    if c.generation.backend == "sim" and p is not None and n >= 1 and p <= 2 ** (1 - n):
        yield Problem(
            "generation.sim.zero_variance_fraction",
            f"({p}) cannot be reached with groups of {n}: even the most spread solve rates give "
            f"all-equal groups with probability above 2**(1 - n) = {2 ** (1 - n):.3g}",
            f"set it above {2 ** (1 - n):.3g}, or raise grpo.num_generations_per_prompt",
        )


@_check("async_rl.sampler")
def _check_custom_sampler(c: SimpleNamespace) -> Iterable[Problem]:
    if c.async_rl.sampler.name == "custom":
        yield from _custom_sampler_problems(c.async_rl.sampler.import_path)


def _custom_sampler_problems(import_path: str | None) -> Iterable[Problem]:
    path = "async_rl.sampler.import_path"
    if not import_path:
        yield Problem(path, "is required with sampler name: custom",
                      "set it to module:object, an object with callables place and lender")
        return
    from refill.rewards.loader import ImportObjectError, import_object

    if ":" not in import_path:
        yield Problem(path, f"{import_path!r} is not of the form module:Name",
                      "write it as package.module:Name")
        return
    try:
        # Resolved first with the shared resolver for its precise message (which module, which
        # attribute, which missing dependency) ...
        import_object(import_path)
    except ImportObjectError as exc:
        yield Problem(path, exc.message, exc.fix)
        return
    # ... then built exactly as the run will build it, so what passes here is what runs.
    from refill.models.samplers import SamplerError, load_custom

    fix = ("give it callable place and lender (see refill.models.samplers.Sampler) and a "
           "constructor that needs no arguments, or use a builtin sampler")
    try:
        load_custom(import_path)
    except SamplerError as exc:
        yield Problem(path, str(exc), fix)
    except Exception as exc:
        # Whatever the sampler's constructor raises means the run could not build it either.
        yield Problem(path, f"{import_path!r} cannot be built: {type(exc).__name__}: {exc}", fix)


@_check("data.train_path", "data.builtin")
def _check_data_source(c: SimpleNamespace) -> Iterable[Problem]:
    d = c.data
    if bool(d.train_path) == bool(d.builtin):
        given = "both are set" if d.train_path else "neither is set"
        yield Problem("data", f"needs exactly one of data.train_path and data.builtin; {given}",
                      "set data.train_path: FILE.jsonl, or data.builtin: arith for the demo task")


@_check("data.prompt_template", "data.prompt_key")
def _check_template(c: SimpleNamespace) -> Iterable[Problem]:
    d = c.data
    try:
        fields = template_fields(d.prompt_template)
    except ValueError as exc:
        yield Problem("data.prompt_template", f"cannot be formatted: {exc}",
                      "name row fields in braces, e.g. '{prompt}', and double literal braces: "
                      "'\\boxed{{}}'")
        return
    if not fields:
        yield Problem("data.prompt_template", "reads no row field, so every prompt would be the same text",
                      f"include the prompt field, e.g. '{{{d.prompt_key}}}'")


@_check("generation.heartbeat_seconds", "generation.lease_seconds")
def _check_generation(c: SimpleNamespace) -> Iterable[Problem]:
    g = c.generation
    if g.heartbeat_seconds >= g.lease_seconds:
        yield Problem(
            "generation.heartbeat_seconds",
            f"({g.heartbeat_seconds}) is not below generation.lease_seconds ({g.lease_seconds}): a "
            "lease would expire before its heartbeat renews it, and healthy attempts would be reaped",
            "set it to a fraction of lease_seconds (a tenth is usual)",
        )


@_check("grpo.reward_shaping", "generation.max_new_tokens")
def _check_shaping(c: SimpleNamespace) -> Iterable[Problem]:
    rs = c.grpo.reward_shaping
    limit = rs.max_response_length or c.generation.max_new_tokens
    if rs.enabled and rs.overlong_buffer_length >= limit:
        yield Problem(
            "grpo.reward_shaping.overlong_buffer_length",
            f"({rs.overlong_buffer_length}) is not below the max response length ({limit}), so every "
            "completion would be penalised",
            "make it smaller than grpo.reward_shaping.max_response_length (or generation.max_new_tokens)",
        )


@_check("loss.truncated_importance_sampling_ratio")
def _check_loss(c: SimpleNamespace) -> Iterable[Problem]:
    tis = c.loss.truncated_importance_sampling_ratio
    if tis is not None and tis < 1:
        yield Problem("loss.truncated_importance_sampling_ratio",
                      f"is {tis}: a cap below 1 shrinks the weight of every on-policy token",
                      "set it to 1 or more (2.0 is usual), or null to disable truncation")


@_check("reward.function")
def _check_reward_name(c: SimpleNamespace) -> Iterable[Problem]:
    from refill.rewards.loader import ImportObjectError, split_spec

    if ":" not in c.reward.function:
        yield Problem("reward.function", f"{c.reward.function!r} is not of the form module:function",
                      "write it as package.module:function, e.g. refill.rewards.arith:exact_match")
        return
    try:
        split_spec(c.reward.function)
    except ImportObjectError as exc:
        yield Problem("reward.function", exc.message, exc.fix)


@_check("infra.database_url", "infra.broker_url")
def _check_urls(c: SimpleNamespace) -> Iterable[Problem]:
    i = c.infra
    if i.database_url and (why := _database_url_problem(i.database_url)):
        yield Problem("infra.database_url", why,
                      "use postgresql+psycopg://USER@HOST:5432/DB, or remove it for the embedded SQLite ledger")
    if i.broker_url and (why := _broker_url_problem(i.broker_url)):
        yield Problem("infra.broker_url", why,
                      "use redis://HOST:6379/0, or remove it for the embedded in-process broker")


# --- run-time checks -------------------------------------------------------------------------


@_check("reward.function", "reward.kwargs", runtime=True)
def _check_reward_loads(c: SimpleNamespace) -> Iterable[Problem]:
    from refill.rewards.loader import ImportObjectError, load_reward_fn

    if ":" not in c.reward.function:
        return  # already reported by the pure check
    try:
        load_reward_fn(c.reward.function)
    except ImportObjectError as exc:
        yield Problem("reward.function", exc.message, exc.fix)
        return
    if c.reward.kwargs:
        # The function itself loads, so a failure now is about the keywords given to it.
        try:
            load_reward_fn(c.reward.function, c.reward.kwargs)
        except ImportObjectError as exc:
            yield Problem("reward.kwargs", exc.message, exc.fix)


@_check("run.seed", "data", runtime=True)
def _check_dataset_loads(c: SimpleNamespace) -> Iterable[Problem]:
    d = c.data
    if bool(d.train_path) == bool(d.builtin):
        return  # already reported by the pure check
    try:
        template_fields(d.prompt_template)
    except ValueError:
        return  # already reported by the pure check
    path = "data.train_path" if d.train_path else "data.builtin"
    try:
        load_dataset(c)
    except DatasetError as exc:
        for problem in exc.problems[:20]:
            where = f"{exc.source} line {problem.line}" if problem.line is not None else exc.source
            fix = ("correct or remove the row" if problem.line is not None else
                   "point data.train_path at an existing JSONL file, or use data.builtin: arith")
            yield Problem(path, f"{where} {problem.message}", fix)
        if len(exc.problems) > 20:
            yield Problem(path, f"... and {len(exc.problems) - 20} more bad rows", "correct or remove them")


@_check("model.name_or_path", "generation.backend", "infra.trainer", runtime=True)
def _check_model_loads(c: SimpleNamespace) -> Iterable[Problem]:
    if c.generation.backend == "sim" and c.infra.trainer == "null":
        return  # nothing loads the model: the sim backend invents tokens and the null trainer waits
    yield from _model_problems(c.model.name_or_path)


def _model_problems(name_or_path: str) -> Iterable[Problem]:
    from refill.assets import resolve_model_path

    key = "model.name_or_path"
    try:
        resolved = resolve_model_path(name_or_path)
    except FileNotFoundError as exc:
        yield Problem(key, str(exc), "use a shipped builtin name or a model directory")
        return
    path = Path(resolved)
    download = ("download it, e.g. `huggingface-cli download Qwen/Qwen2.5-Math-1.5B --local-dir DIR`, "
                "and point model.name_or_path at DIR")
    if path.is_file():
        yield Problem(key, f"{resolved} is a file, not a model directory", download)
        return
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            yield Problem(key, f"{resolved} has no config.json, so no model can be built from it",
                          f"point it at a Hugging Face model directory; {download}")
            return
        try:
            json.loads(config_file.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:
            yield Problem(key, f"{config_file} is not readable JSON: {exc}", "restore the file")
            return
    elif resolved.startswith(("/", ".", "~")) or resolved.count("/") > 1 or "\\" in resolved:
        # An explicit filesystem path that is not there; the Hub cache cannot hold it.
        where = "" if Path(resolved).is_absolute() else f" (relative to the working directory {Path.cwd()})"
        yield Problem(key, f"{resolved} does not exist{where}", download)
        return
    try:
        # Imported here: transformers takes seconds to import and only this check needs it.
        from transformers import AutoConfig

        AutoConfig.from_pretrained(resolved, local_files_only=True)
    except Exception as exc:
        # transformers raises OSError, ValueError or KeyError depending on what is wrong; each is
        # a model that will not load, reported with transformers' own words.
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if path.is_dir():
            yield Problem(key, f"transformers cannot load {resolved}/config.json: {first_line}",
                          "fix config.json (model_type must be one transformers knows)")
        else:
            yield Problem(key, f"{resolved!r} is neither a directory nor a model in the local Hugging "
                          "Face cache", download)


@_check(runtime=True)
def _check_env_urls(c: SimpleNamespace) -> Iterable[Problem]:
    for env_name, key, probe in ((DATABASE_URL_ENV, "infra.database_url", _database_url_problem),
                                 (BROKER_URL_ENV, "infra.broker_url", _broker_url_problem)):
        value = c.environ.get(env_name)
        if value and (why := probe(value)):
            yield Problem(key, f"{env_name} (which overrides it) holds {why}", f"correct {env_name}")


# ---------------------------------------------------------------------------------------------
# Warnings


def _config_warnings(cfg: RunConfig, environ: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    g, rf, gen = cfg.grpo, cfg.rollout_failure, cfg.generation
    n_prompts = g.num_prompts_per_step
    reserve = rf.replacement_reserve_prompts if rf.replacement_reserve_prompts is not None else n_prompts
    if g.use_dynamic_sampling and 1 <= reserve < n_prompts:
        # The pool needs N*p/(1-p) spares per batch at drop rate p; N covers every p up to 0.5,
        # and p is only known once the run reports zero_variance_fraction.
        out.append(
            f"rollout_failure.replacement_reserve_prompts: {reserve} is below "
            f"grpo.num_prompts_per_step ({n_prompts}). The spare pool is checked for a refill once "
            "per data-loader batch, so between two checks it can empty and filtered groups then "
            f"shrink their steps. Set it to at least num_prompts_per_step ({n_prompts})."
        )
    for knob, instead in (("dynamic_sampling_max_gen_batches", "grpo.dynamic_sampling_max_replacements_per_slot"),
                          ("batch_multiplier", "async_rl.over_dispatch")):
        if getattr(g, knob) is not None:
            out.append(
                f"grpo.{knob}: is set, but only NeMo RL's synchronous path reads it; refill does not. "
                f"Remove it (the matching knob here is {instead})."
            )
    if not g.use_dynamic_sampling and g.num_generations_per_prompt < 2:
        out.append(
            "grpo.num_generations_per_prompt: 1 gives every completion a zero group-relative "
            "advantage, so nothing is learned. Set it to 2 or more."
        )
    rs = g.reward_shaping
    if rs.enabled and rs.overlong_buffer_length == 0:
        out.append("grpo.reward_shaping: enabled with overlong_buffer_length 0 does nothing. "
                   "Set overlong_buffer_length, or disable reward shaping.")
    p = gen.sim.zero_variance_fraction
    if gen.backend == "sim" and g.use_dynamic_sampling and p is not None and 0 < p < 1:
        budget = g.dynamic_sampling_max_replacements_per_slot
        expected = p ** (budget + 1) * n_prompts * g.max_num_steps
        if expected >= 0.05:
            out.append(
                f"grpo.dynamic_sampling_max_replacements_per_slot: at the simulated zero-variance "
                f"fraction {p} a run expects {expected:.2g} slots to exhaust a budget of {budget} "
                f"(p**(budget+1) * num_prompts_per_step * max_num_steps), and the first one fails the "
                f"run. Raise it to at least {_budget_for(p, n_prompts * g.max_num_steps)}."
            )
    if gen.backend != "sim" and gen.sim.model_fields_set:
        out.append("generation.sim: is set but generation.backend is "
                   f"{gen.backend}; it is read only by the sim backend. Remove it or set backend: sim.")
    if gen.backend != "vllm" and gen.vllm.model_fields_set:
        out.append("generation.vllm: is set but generation.backend is "
                   f"{gen.backend}; it is read only by the vllm backend. Remove it or set backend: vllm.")
    s = cfg.async_rl.sampler
    if s.name != "windowed" and ("max_staleness_versions" in s.model_fields_set or s.freshest_first):
        out.append(f"async_rl.sampler: max_staleness_versions and freshest_first are read only by the "
                   f"windowed sampler, not {s.name}. Remove them or set name: windowed.")
    if s.name != "custom" and s.import_path:
        out.append(f"async_rl.sampler.import_path: is read only by the custom sampler, not {s.name}. "
                   "Remove it or set name: custom.")
    if cfg.infra.trainer != "null" and cfg.infra.null_trainer_delay_seconds:
        out.append("infra.null_trainer_delay_seconds: is read only by the null trainer. "
                   "Remove it or set infra.trainer: null.")
    if cfg.optimizer.warmup_steps > g.max_num_steps:
        out.append(f"optimizer.warmup_steps: {cfg.optimizer.warmup_steps} exceeds grpo.max_num_steps "
                   f"({g.max_num_steps}), so the run ends before the learning rate is reached. "
                   "Lower warmup_steps.")
    if not (gen.backend == "sim" and cfg.infra.trainer == "null") and not cfg.model.warm_start.enabled \
            and _has_no_weights(cfg.model.name_or_path):
        out.append(
            f"model.warm_start.enabled: {cfg.model.name_or_path} holds a config but no weights, so the "
            "model starts from random initialisation, solves nothing, and every group is filtered as "
            "zero-variance. Set model.warm_start.enabled: true."
        )
    db, broker = resolved_urls(cfg, environ)
    if db.startswith("sqlite") and broker != EMBEDDED_BROKER_URL:
        out.append(f"infra.database_url: the broker is {redact_url(broker)} but the ledger is a SQLite "
                   "file, which workers on other machines cannot reach. Set infra.database_url (or "
                   f"{DATABASE_URL_ENV}) to a PostgreSQL URL.")
    return out


def _has_no_weights(name_or_path: str) -> bool:
    from refill.assets import resolve_model_path

    try:
        path = Path(resolve_model_path(name_or_path))
    except FileNotFoundError:
        return False  # reported by the run-time model check
    weights = ("*.safetensors", "*.bin", "*.pt", "*.pth")
    return path.is_dir() and not any(next(path.glob(pattern), None) for pattern in weights)


def _budget_for(p: float, draws: int) -> int:
    """Smallest budget whose expected number of exhausted slots is below 0.05."""
    return max(1, math.floor(math.log(0.05 / draws) / math.log(p)))


def _password_warnings(raw: Any) -> list[str]:
    out = []
    infra = raw.get("infra") if isinstance(raw, dict) else None
    if isinstance(infra, dict):
        for key, env_name in (("database_url", DATABASE_URL_ENV), ("broker_url", BROKER_URL_ENV)):
            value = infra.get(key)
            if isinstance(value, str) and url_has_password(value):
                out.append(
                    f"infra.{key}: the file holds a password ({redact_url(value)}). Secrets belong in "
                    f"the environment: remove it from the file and set {env_name}, or write "
                    f"${{{env_name}}} as the value."
                )
    return out


# ---------------------------------------------------------------------------------------------
# Entry points


def config_from_dict(
    raw: Any,
    *,
    name: str | None = None,
    check_runtime: bool = False,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
    _problems: list[Problem] | None = None,
) -> RunConfig:
    """Validate a parsed config (`${VAR}` expanded, every check run); raises `ConfigError`.

    `name` is the default for `run.name`. Run-time checks are off by default here: this is the
    entry point for tests and for code that builds configs in memory.
    """
    env = os.environ if environ is None else environ
    problems: list[Problem] = list(_problems or [])
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            problems + [Problem("", f"the config must be a mapping of sections, got {_describe(raw)}",
                                "start the file with sections such as `grpo:` and `data:`")],
            source,
        )
    load_warnings = _password_warnings(raw)
    env_problems: list[Problem] = []
    origins: dict[str, str] = {}
    raw = _expand_env(raw, "", env, env_problems, origins)
    problems += env_problems
    # Keys whose value is unusable; checks that read them are skipped (see _can_run).
    failed: set[str] = {".".join(re.split(r"[.\[]", p.path)[:2]) for p in env_problems}

    sections: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in SECTIONS:
            problems.append(_unknown_key([str(key)]))
            continue
        if value is None:
            value = {}  # an empty section (`grpo:` with nothing under it) means its defaults
        if key == "run" and name is not None and isinstance(value, dict) and value.get("name") is None:
            value = {**value, "name": name}
        section, section_problems, bad_keys = _validate_section(key, value)
        problems += section_problems
        failed |= {f"{key}.{k}" for k in bad_keys}
        if section is not None:
            sections[key] = section
        else:
            failed.add(key)
    for key, cls in SECTIONS.items():
        if key not in raw:
            sections[key] = cls(name=name) if key == "run" else cls()

    ns = SimpleNamespace(**sections, environ=env)
    _resolve_sections(ns)
    checks = _CHECKS + (_RUNTIME_CHECKS if check_runtime else [])
    for reads, check in checks:
        if _can_run(reads, sections, failed):
            problems.extend(check(ns))
    if problems:
        raise ConfigError(
            _dedupe([p if p in env_problems else _with_origin(p, origins) for p in problems]), source
        )
    cfg = RunConfig.model_validate(sections)
    cfg._load_warnings = load_warnings
    return cfg


def _with_origin(problem: Problem, origins: Mapping[str, str]) -> Problem:
    """Name the `${VAR}` a bad value came from, since the file alone does not show the value."""
    written = origins.get(problem.path)
    if written is None:
        return problem
    names = [m.group(1).split(":-", 1)[0] for m in _ENV_TOKEN.finditer(written) if m.group(1)]
    if not names:
        return problem
    return Problem(
        problem.path,
        f"{problem.message} (the file says {written})",
        f"{problem.fix}; or set {' / '.join(names)} in the environment",
    )


def _validate_section(key: str, value: Any) -> tuple[Any | None, list[Problem], set[str]]:
    """(section or None, problems, keys that failed).

    A section with bad keys is validated again without them, so that cross-field checks on its
    good keys still run; the bad keys are reported once, from the first pass.
    """
    cls = SECTIONS[key]
    try:
        return cls.model_validate(value), [], set()
    except ValidationError as exc:
        errors = exc.errors()
    problems = [_error_to_problem(err, [key]) for err in errors]
    if not isinstance(value, dict) or any(not err["loc"] for err in errors):
        return None, problems, set()
    bad = {str(err["loc"][0]) for err in errors}
    try:
        return cls.model_validate({k: v for k, v in value.items() if str(k) not in bad}), problems, bad
    except ValidationError:
        # Only a validator that couples two keys could fail here; treat the section as unusable.
        return None, problems, bad


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    return [p for p in problems if not (p in seen or seen.add(p))]


def load_config(
    path: str | os.PathLike[str],
    *,
    check_runtime: bool = True,
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Read, expand and validate a YAML config; `run.name` defaults to the file's stem.

    Raises `ConfigFileError` (a `ConfigError`) when the file cannot be read or parsed, and
    `ConfigError` listing every problem otherwise.
    """
    raw, duplicates = read_yaml(path)
    return config_from_dict(
        raw,
        name=Path(path).stem,
        check_runtime=check_runtime,
        environ=environ,
        source=str(path),
        _problems=duplicates,
    )
