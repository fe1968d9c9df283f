"""The cross-field checks (SPEC §5 setup errors), and the run-time checks that load what the run
will load (the reward function, the data set, the model's config).

Each check names the keys it reads and runs only when none of them failed validation, so one
bad value neither hides the other checks nor trips them with a default standing in for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from refill.config.errors import Problem
from refill.config.urls import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    broker_url_problem,
    database_url_problem,
)
from refill.models.dataset import DatasetError, load_dataset, template_fields

#: A check reads the sections that validated (and `environ`) and yields what is wrong.
Check = Callable[[SimpleNamespace], Iterable[Problem]]
CHECKS: list[tuple[tuple[str, ...], Check]] = []
RUNTIME_CHECKS: list[tuple[tuple[str, ...], Check]] = []


def _check(*reads: str, runtime: bool = False) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        (RUNTIME_CHECKS if runtime else CHECKS).append((reads, fn))
        return fn

    return register


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def can_run(reads: tuple[str, ...], sections: Mapping[str, Any], failed: set[str]) -> bool:
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


#: The temperatures vLLM samples at as asked: it refuses one above 2 (0.32 on, as each request's
#: SamplingParams is made) and samples below 0.01 at 0.01 (every version), where the trainer
#: would score at the configured one.
VLLM_TEMPERATURES = (0.01, 2.0)


@_check("generation.backend", "generation.temperature")
def _check_vllm_temperature(c: SimpleNamespace) -> Iterable[Problem]:
    g = c.generation
    low, high = VLLM_TEMPERATURES
    if g.backend == "vllm" and not low <= g.temperature <= high:
        yield Problem(
            "generation.temperature",
            f"({g.temperature}) is outside [{low}, {high}], the temperatures vLLM samples at as asked "
            "(it refuses one above 2 and raises one below 0.01 to 0.01, while the trainer would score "
            "at the configured one)",
            f"set it within [{low}, {high}]",
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


@_check("optimizer.groups_per_update", "grpo.num_prompts_per_step")
def _check_mini_batches(c: SimpleNamespace) -> Iterable[Problem]:
    size, prompts = c.optimizer.groups_per_update, c.grpo.num_prompts_per_step
    if size is not None and size > prompts:
        yield Problem(
            "optimizer.groups_per_update",
            f"({size}) is more than grpo.num_prompts_per_step ({prompts}): a step has at most "
            f"{prompts} groups, so its groups would always make a single mini-batch",
            f"set it to at most {prompts} (a divisor, such as {_largest_proper_divisor(prompts)}, "
            "splits each step into equal updates), or remove it for one update per step",
        )


def _largest_proper_divisor(n: int) -> int:
    return next((d for d in range(n // 2, 0, -1) if n % d == 0), 1)


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
    if i.database_url and (why := database_url_problem(i.database_url)):
        yield Problem("infra.database_url", why,
                      "use postgresql+psycopg://USER@HOST:5432/DB, or remove it for the embedded SQLite ledger")
    if i.broker_url and (why := broker_url_problem(i.broker_url)):
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
    for env_name, key, probe in ((DATABASE_URL_ENV, "infra.database_url", database_url_problem),
                                 (BROKER_URL_ENV, "infra.broker_url", broker_url_problem)):
        value = c.environ.get(env_name)
        if value and (why := probe(value)):
            yield Problem(key, f"{env_name} (which overrides it): {why}", f"correct {env_name}")

