"""Warnings: a config that will run, but probably not as meant; each says what to set.

This module reads a `RunConfig` it is handed and imports no schema, so the schema can offer
`RunConfig.warnings()` without an import circle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refill.config.urls import (
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    EMBEDDED_BROKER_URL,
    redact_url,
    resolved_urls,
    url_has_password,
)

if TYPE_CHECKING:
    from refill.config.schema import RunConfig


def config_warnings(cfg: RunConfig, environ: Mapping[str, str]) -> list[str]:
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
    if gen.backend != "hf" and gen.hf.model_fields_set:
        out.append("generation.hf: is set but generation.backend is "
                   f"{gen.backend}; it is read only by the hf backend. Remove it or set backend: hf.")
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


def password_warnings(raw: Any) -> list[str]:
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

