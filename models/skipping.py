"""Pre-rollout skipping (issue 15): the data loader passes over the prompts the ledger predicts
are zero-variance, as GRESO does (arXiv 2506.02177), before anything is generated for them.

A prompt's history is its scored attempts, rows of the ledger across epochs and restarts: its
last `k` groups all solved (or all failed) make its skip probability
`1 - max(rate**k, min_exploration)` (`decisions.skip_probability`), with `rate` the exploration
rate of that kind. The draw compares it with a uniform seeded by (run seed, epoch, place in the
epoch's order), so the same history gives the same decision in a resumed run; every place the
loader reaches is recorded in `prompt_draws` with what decided it. After each released step,
from the second epoch on, each kind's rate moves toward its target share of the step's groups
(`decisions.adapted_exploration_rate`); the rates live on the run row, written in the same
transaction as the release.

This module holds the settings, the history and the adaptation; the loader's walk over the
epoch (`refill.models.dataloader`, which also holds each place's seeded uniform) asks it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, column, select, true, values
from sqlalchemy.orm import Session

from refill.config import RunConfig, from_snapshot
from refill.models import decisions
from refill.models.context import RunContext
from refill.models.decisions import GroupKind
from refill.models.sql import literal_in
from refill.models.tables import Attempt, Run


@dataclass(frozen=True)
class SkipSettings:
    """`data.prompt_skipping` of a run's config (the schema holds every default)."""

    enabled: bool
    exploration_rate: float
    min_exploration: float
    rate_step: float
    rate_min: float
    rate_max: float
    target_zero_variance: float
    target_solved_fraction: float

    @classmethod
    def from_config(cls, config: RunConfig | Mapping[str, Any]) -> SkipSettings:
        if not isinstance(config, RunConfig):
            config = from_snapshot(config)
        knobs = config.data.prompt_skipping
        return cls(
            enabled=knobs.enabled,
            exploration_rate=knobs.exploration_rate,
            min_exploration=knobs.min_exploration,
            rate_step=knobs.exploration_rate_step,
            rate_min=knobs.exploration_rate_min,
            rate_max=knobs.exploration_rate_max,
            target_zero_variance=knobs.target_zero_variance,
            target_solved_fraction=knobs.target_solved_fraction,
        )

    def target(self, kind: GroupKind) -> float:
        """The share of a step's groups aimed at for `kind` (GRESO: 1/3 : 2/3 of 0.25)."""
        solved = self.target_zero_variance * self.target_solved_fraction
        return solved if kind is GroupKind.SOLVED else self.target_zero_variance - solved


_cache: dict[tuple[int, str], SkipSettings] = {}


def skip_settings(run: Run) -> SkipSettings:
    """The skip settings of a run row, parsed once per (run, config hash)."""
    key = (run.id, run.config_hash)
    found = _cache.get(key)
    if found is None:
        found = _cache[key] = SkipSettings.from_config(run.config)
    return found


def exploration_rates(run: Run, settings: SkipSettings) -> dict[GroupKind, float]:
    """Each zero-variance kind's exploration rate now: as adapted, else the configured one."""
    return {
        GroupKind.SOLVED: settings.exploration_rate if run.skip_exploration_solved is None else run.skip_exploration_solved,
        GroupKind.FAILED: settings.exploration_rate if run.skip_exploration_failed is None else run.skip_exploration_failed,
    }


def streaks(
    session: Session, run_id: int, prompt_ids: Iterable[int], longest: int | None = None
) -> dict[int, tuple[GroupKind | None, int]]:
    """Each prompt's zero-variance streak (`decisions.zero_variance_streak`) from its scored
    attempts as stored, counted up to `longest` (`decisions.saturating_streak`: a longer one
    skips with the same probability); prompts with no scored attempt are left out (no streak).

    On PostgreSQL each prompt's newest `longest` scored attempts are read, walked back through
    the index of scored attempts by prompt and id: a prompt's whole history grows with every
    epoch (a run 1,000 steps of 16 prompts over 48 prompts read 2,100 buffers a draw). SQLite
    reads the whole history and counts the same way."""
    ids = sorted(set(prompt_ids))
    if not ids:
        return {}
    attempts = Attempt.__table__
    scored = (attempts.c.run_id == run_id, attempts.c.zero_variance.is_not(None))
    if longest is not None and session.get_bind().dialect.name == "postgresql":
        prompts = values(column("prompt_id", Integer), name="prompt", literal_binds=True).data([(i,) for i in ids])
        newest = (
            select(attempts.c.id, attempts.c.zero_variance, attempts.c.reward_mean)
            .where(*scored, attempts.c.prompt_id == prompts.c.prompt_id)
            .order_by(attempts.c.id.desc())
            .limit(longest)
            .lateral("newest")
        )
        statement = (
            select(prompts.c.prompt_id, newest.c.zero_variance, newest.c.reward_mean)
            .select_from(prompts.join(newest, true()))
            .order_by(prompts.c.prompt_id, newest.c.id.desc())
        )
    else:
        statement = (
            select(attempts.c.prompt_id, attempts.c.zero_variance, attempts.c.reward_mean)
            .where(*scored, literal_in(attempts.c.prompt_id, ids))
            .order_by(attempts.c.prompt_id, attempts.c.id.desc())
        )
    kinds: dict[int, list[GroupKind]] = {}
    for prompt_id, zero_variance, reward_mean in session.execute(statement):
        newest_first = kinds.setdefault(prompt_id, [])
        if longest is None or len(newest_first) < longest:
            newest_first.append(decisions.group_kind(bool(zero_variance), float(reward_mean or 0.0)))
    return {prompt_id: decisions.zero_variance_streak(each) for prompt_id, each in kinds.items()}


def adapt_exploration(ctx: RunContext, finished: int, solved: int, failed: int) -> dict[GroupKind, float] | None:
    """GRESO's adaptation at the release of a step whose attempts finished `finished` groups,
    `solved` and `failed` of them zero-variance; returns the rates after it (None when the run
    does not skip). The first epoch is left alone, as GRESO does: no prompt has a history
    yet, so the rates would only drift toward their floor before any skip."""
    settings = skip_settings(ctx.run)
    if not settings.enabled:
        return None
    rates = exploration_rates(ctx.run, settings)
    if ctx.run.loader_epoch >= 1 and finished > 0:
        for kind, count in ((GroupKind.SOLVED, solved), (GroupKind.FAILED, failed)):
            rates[kind] = decisions.adapted_exploration_rate(
                rates[kind],
                count / finished,
                settings.target(kind),
                settings.rate_step,
                settings.rate_min,
                settings.rate_max,
            )
        ctx.run.skip_exploration_solved = rates[GroupKind.SOLVED]
        ctx.run.skip_exploration_failed = rates[GroupKind.FAILED]
    return rates
