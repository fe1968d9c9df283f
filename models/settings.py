"""The knobs the ledger reads, taken from a run's config snapshot.

The ledger stores the resolved config (a dict) with the run and must behave the same after a
restart; so it rebuilds the snapshot through the schema (`refill.config.from_snapshot`), once
per run, into this flat, immutable view. Every value comes from the validated config: the
knobs' defaults are the schema's alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from refill.config import RunConfig, from_snapshot
from refill.models.samplers import Sampler, make_sampler


@dataclass(frozen=True)
class LedgerSettings:
    seed: int
    num_prompts_per_step: int
    group_size: int
    max_num_steps: int
    max_num_epochs: int | None
    shuffle: bool
    use_dynamic_sampling: bool
    filter_budget: int
    zero_variance_tolerance: float
    max_lookahead_versions: int
    sampler_name: str
    sampler_window: int | None
    sampler_freshest_first: bool
    sampler_import_path: str | None
    over_dispatch: bool
    over_dispatch_sigmas: float
    over_dispatch_max_fraction: float
    over_dispatch_tail_fraction: float
    max_attempts_per_prompt: int
    retry_backoff_seconds: float
    retry_backoff_max_seconds: float
    on_dropped_prompt: str
    max_replacement_attempts: int
    replacement_reserve_prompts: int
    min_step_batch_fraction: float
    max_consecutive_dropped_prompts: int
    temperature: float
    top_p: float
    max_new_tokens: int
    lease_seconds: float
    queue_timeout_seconds: float
    trainer_lease_seconds: float
    max_train_attempts: int
    vocab_size: int | None
    max_result_bytes: int

    @property
    def drop_budget(self) -> int:
        return self.max_replacement_attempts if self.on_dropped_prompt == "replace" else 0

    @property
    def needs_spare_pool(self) -> bool:
        return self.use_dynamic_sampling or self.on_dropped_prompt == "replace"

    def sampler(self) -> Sampler:
        return _sampler(
            self.sampler_name,
            self.sampler_window,
            self.sampler_freshest_first,
            self.sampler_import_path,
            self.max_lookahead_versions,
        )

    @classmethod
    def from_config(cls, config: RunConfig | Mapping[str, Any]) -> LedgerSettings:
        """The settings of a run config, or of the snapshot a run stored (rebuilt through the
        schema, so a knob the snapshot lacks has the schema's default)."""
        if not isinstance(config, RunConfig):
            config = from_snapshot(config)
        values = {name: _knob(config, path) for name, path in KNOBS.items()}
        generation = config.generation
        # The vocabulary bounds token ids only where the run invents them (the sim back-end).
        vocab_size = generation.sim.vocab_size if generation.backend == "sim" else None
        return cls(**values, vocab_size=vocab_size)


#: Each setting and the knob of the run config it is: the knob's default, its one default, is
#: the schema's (refill.config.schema).
KNOBS: dict[str, str] = {
    "seed": "run.seed",
    "num_prompts_per_step": "grpo.num_prompts_per_step",
    "group_size": "grpo.num_generations_per_prompt",
    "max_num_steps": "grpo.max_num_steps",
    "max_num_epochs": "grpo.max_num_epochs",
    "shuffle": "data.shuffle",
    "use_dynamic_sampling": "grpo.use_dynamic_sampling",
    "filter_budget": "grpo.dynamic_sampling_max_replacements_per_slot",
    "zero_variance_tolerance": "grpo.zero_variance_tolerance",
    "max_lookahead_versions": "async_rl.max_lookahead_versions",
    "sampler_name": "async_rl.sampler.name",
    "sampler_window": "async_rl.sampler.max_staleness_versions",
    "sampler_freshest_first": "async_rl.sampler.freshest_first",
    "sampler_import_path": "async_rl.sampler.import_path",
    "over_dispatch": "async_rl.over_dispatch.enabled",
    "over_dispatch_sigmas": "async_rl.over_dispatch.safety_sigmas",
    "over_dispatch_max_fraction": "async_rl.over_dispatch.max_extra_fraction",
    "over_dispatch_tail_fraction": "async_rl.over_dispatch.tail_fraction",
    "max_attempts_per_prompt": "rollout_failure.max_attempts_per_prompt",
    "retry_backoff_seconds": "rollout_failure.retry_backoff_seconds",
    "retry_backoff_max_seconds": "rollout_failure.retry_backoff_max_seconds",
    "on_dropped_prompt": "rollout_failure.on_dropped_prompt",
    "max_replacement_attempts": "rollout_failure.max_replacement_attempts",
    # None in a config file means num_prompts_per_step; the schema resolves it on validation.
    "replacement_reserve_prompts": "rollout_failure.replacement_reserve_prompts",
    "min_step_batch_fraction": "rollout_failure.min_step_batch_fraction",
    "max_consecutive_dropped_prompts": "rollout_failure.max_consecutive_dropped_prompts",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "max_new_tokens": "generation.max_new_tokens",
    "lease_seconds": "generation.lease_seconds",
    "queue_timeout_seconds": "generation.queue_timeout_seconds",
    "trainer_lease_seconds": "infra.trainer_lease_seconds",
    "max_train_attempts": "infra.max_train_attempts",
    "max_result_bytes": "infra.max_result_bytes",
}


def _knob(config: RunConfig, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        node = getattr(node, part)
    return node


@lru_cache(maxsize=64)
def _sampler(name: str, window: int | None, freshest: bool, import_path: str | None, lookahead: int) -> Sampler:
    return make_sampler(
        name,
        max_staleness_versions=window,
        freshest_first=freshest,
        import_path=import_path,
        max_lookahead_versions=lookahead,
    )


_cache: dict[tuple[int, str], LedgerSettings] = {}


def cached_settings(run_id: int, config_hash: str) -> LedgerSettings | None:
    """The settings `settings_for` parsed for this run and config, or None if it has not yet
    (a caller that reads runs without their config asks first)."""
    return _cache.get((run_id, config_hash))


def settings_for(run: Any) -> LedgerSettings:
    """Settings of a `Run` row, parsed once per (run, config hash)."""
    key = (run.id, run.config_hash)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = LedgerSettings.from_config(run.config)
    return found
