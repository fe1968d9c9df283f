"""The knobs the ledger reads, taken from a run's config snapshot.

The ledger stores the resolved config (a dict) with the run and must behave the same after a
restart, whatever the code's current defaults are; so it reads the snapshot, once per run,
into this flat, immutable view rather than re-validating the YAML schema on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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
    def from_config(cls, config: dict[str, Any]) -> LedgerSettings:
        def get(section: str, key: str, default: Any = None) -> Any:
            value = (config.get(section) or {}).get(key, default)
            return default if value is None else value

        grpo = config.get("grpo") or {}
        async_rl = config.get("async_rl") or {}
        sampler = async_rl.get("sampler") or {}
        over = async_rl.get("over_dispatch") or {}
        generation = config.get("generation") or {}
        sim = generation.get("sim") or {}
        n_prompts = int(grpo.get("num_prompts_per_step", 8))
        reserve = get("rollout_failure", "replacement_reserve_prompts", n_prompts)
        vocab = sim.get("vocab_size") if generation.get("backend") == "sim" else None
        return cls(
            seed=int(get("run", "seed", 0)),
            num_prompts_per_step=n_prompts,
            group_size=int(grpo.get("num_generations_per_prompt", 8)),
            max_num_steps=int(grpo.get("max_num_steps", 100)),
            max_num_epochs=grpo.get("max_num_epochs", 1),
            shuffle=bool(get("data", "shuffle", True)),
            use_dynamic_sampling=bool(grpo.get("use_dynamic_sampling", True)),
            filter_budget=int(grpo.get("dynamic_sampling_max_replacements_per_slot", 32)),
            zero_variance_tolerance=float(grpo.get("zero_variance_tolerance", 0.0)),
            max_lookahead_versions=int(async_rl.get("max_lookahead_versions", 1)),
            sampler_name=str(sampler.get("name", "in_order")),
            sampler_window=sampler.get("max_staleness_versions"),
            sampler_freshest_first=bool(sampler.get("freshest_first", False)),
            sampler_import_path=sampler.get("import_path"),
            over_dispatch=bool(over.get("enabled", True)),
            over_dispatch_sigmas=float(over.get("safety_sigmas", 2.0)),
            over_dispatch_max_fraction=float(over.get("max_extra_fraction", 1.0)),
            over_dispatch_tail_fraction=float(over.get("tail_fraction", 0.01)),
            max_attempts_per_prompt=int(get("rollout_failure", "max_attempts_per_prompt", 3)),
            retry_backoff_seconds=float(get("rollout_failure", "retry_backoff_seconds", 1.0)),
            retry_backoff_max_seconds=float(get("rollout_failure", "retry_backoff_max_seconds", 60.0)),
            on_dropped_prompt=str(get("rollout_failure", "on_dropped_prompt", "replace")),
            max_replacement_attempts=int(get("rollout_failure", "max_replacement_attempts", 1)),
            replacement_reserve_prompts=int(reserve),
            min_step_batch_fraction=float(get("rollout_failure", "min_step_batch_fraction", 0.9)),
            max_consecutive_dropped_prompts=int(
                get("rollout_failure", "max_consecutive_dropped_prompts", 16)
            ),
            temperature=float(generation.get("temperature", 1.0)),
            top_p=float(generation.get("top_p", 1.0)),
            max_new_tokens=int(generation.get("max_new_tokens", 16)),
            lease_seconds=float(generation.get("lease_seconds", 120.0)),
            queue_timeout_seconds=float(generation.get("queue_timeout_seconds", 600.0)),
            trainer_lease_seconds=float(get("infra", "trainer_lease_seconds", 600.0)),
            max_train_attempts=int(get("infra", "max_train_attempts", 3)),
            vocab_size=None if vocab is None else int(vocab),
            max_result_bytes=int(get("infra", "max_result_bytes", 64 * 1024 * 1024)),
        )


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


def settings_for(run: Any) -> LedgerSettings:
    """Settings of a `Run` row, parsed once per (run, config hash)."""
    key = (run.id, run.config_hash)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = LedgerSettings.from_config(run.config)
    return found
