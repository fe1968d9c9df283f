"""Each prompt's history in a run (`refill prompts`): the numbers of the `prompt_history`
view (migration 0007, docs/sql.md), computed with the decisions' own functions so that the
streak shown is the one pre-rollout skipping reads (`refill.models.skipping.streaks`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.admin.snapshot import get_run
from refill.config import from_snapshot
from refill.models import decisions
from refill.models.skipping import SkipSettings, exploration_rates
from refill.models.tables import Attempt, Prompt, PromptDraw

#: The columns of one prompt's row, in the view's order.
COLUMNS = [
    "prompt_id",
    "position",
    "prompt_key",
    "attempts",
    "scored",
    "zero_variance_groups",
    "last_pass_rate",
    "streak_kind",
    "zero_variance_streak",
    "skip_state",
    "last_skip_probability",
    "draws",
    "skips",
    "last_seen_step",
    "last_seen_epoch",
]


def prompt_history(session: Session, run_id: int, *, skipped_only: bool = False) -> list[dict[str, Any]]:
    """One row per prompt of the run, in data-set order (`skipped_only`: those the loader
    skipped the last time it reached them). Raises NotFound for an unknown run."""
    run = get_run(session, run_id)
    field = from_snapshot(run.config).data.prompt_id_field
    key = Prompt.row[field] if field is not None else Prompt.position
    prompts = session.execute(
        select(Prompt.id, Prompt.position, key).where(Prompt.run_id == run_id).order_by(Prompt.position)
    ).all()
    tried = {
        prompt_id: (count, last_step)
        for prompt_id, count, last_step in session.execute(
            select(Attempt.prompt_id, func.count(), func.max(Attempt.origin_step))
            .where(Attempt.run_id == run_id)
            .group_by(Attempt.prompt_id)
        )
    }
    kinds: dict[int, list[decisions.GroupKind]] = {}
    last_rate: dict[int, float] = {}
    for prompt_id, zero_variance, reward_mean in session.execute(
        select(Attempt.prompt_id, Attempt.zero_variance, Attempt.reward_mean)
        .where(Attempt.run_id == run_id, Attempt.zero_variance.is_not(None))
        .order_by(Attempt.prompt_id, Attempt.id.desc())
    ):
        if prompt_id not in kinds:
            kinds[prompt_id] = []
            last_rate[prompt_id] = reward_mean
        kinds[prompt_id].append(decisions.group_kind(bool(zero_variance), float(reward_mean or 0.0)))
    draws: dict[int, dict[str, Any]] = {}
    for prompt_id, epoch, skipped, probability in session.execute(
        select(PromptDraw.prompt_id, PromptDraw.epoch, PromptDraw.skipped, PromptDraw.probability)
        .where(PromptDraw.run_id == run_id)
        .order_by(PromptDraw.epoch, PromptDraw.position)
    ):
        entry = draws.setdefault(prompt_id, {"draws": 0, "skips": 0})
        entry["draws"] += 1
        entry["skips"] += int(bool(skipped))
        # In (epoch, place) order: the last one seen is the latest.
        entry.update(epoch=epoch, state="skipped" if skipped else "tried", probability=probability)
    rows = []
    for prompt_id, position, prompt_key in prompts:
        history = kinds.get(prompt_id, [])
        kind, streak = decisions.zero_variance_streak(history)
        drawn = draws.get(prompt_id, {})
        count, last_step = tried.get(prompt_id, (0, None))
        row = {
            "prompt_id": prompt_id,
            "position": position,
            "prompt_key": str(position if prompt_key is None else prompt_key),
            "attempts": int(count),
            "scored": len(history),
            "zero_variance_groups": sum(1 for k in history if k is not decisions.GroupKind.MIXED),
            "last_pass_rate": last_rate.get(prompt_id),
            "streak_kind": None if kind is None else kind.value,
            "zero_variance_streak": streak,
            "skip_state": drawn.get("state"),
            "last_skip_probability": drawn.get("probability"),
            "draws": drawn.get("draws", 0),
            "skips": drawn.get("skips", 0),
            "last_seen_step": last_step,
            "last_seen_epoch": drawn.get("epoch"),
        }
        if not skipped_only or row["skip_state"] == "skipped":
            rows.append(row)
    return rows


def skipping_summary(session: Session, run_id: int) -> dict[str, Any]:
    """The run's skipping knobs and rates now, and what its loader did (for the command's
    header): places reached, skipped, and prompts skipped at their last draw."""
    run = get_run(session, run_id)
    settings = SkipSettings.from_config(run.config)
    reached, skipped = session.execute(
        select(func.count(), func.count().filter(PromptDraw.skipped.is_(True))).where(PromptDraw.run_id == run_id)
    ).one()
    rates = exploration_rates(run, settings)
    return {
        "enabled": settings.enabled,
        "exploration_solved": rates[decisions.GroupKind.SOLVED],
        "exploration_failed": rates[decisions.GroupKind.FAILED],
        "min_exploration": settings.min_exploration,
        "draws": int(reached or 0),
        "skipped": int(skipped or 0),
        "loader_epoch": run.loader_epoch,
    }
