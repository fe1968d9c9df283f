"""The invariants of pre-rollout skipping (issue 15), over a run's `prompt_draws`.

- every place of every epoch the loader passed is recorded once, in its order, and holds the
  prompt that epoch's order puts there; the epochs and the cursor agree with the run's loader;
- each decision replays: its uniform is the seeded one of its place, its probability is the
  one its streak and exploration rate give (never above 1 - min_exploration), and it was
  skipped exactly when the uniform fell below it;
- no prompt is lost: the prompts taken (not skipped) are the prompts of the steps' slots and
  of the spare pool, each as many times;
- each released step's `skipped_prompts` counts the skips drawn for it; the run's adapted
  exploration rates lie within their bounds.
"""

from __future__ import annotations

import math
from collections import Counter

from sqlalchemy import func, select

from refill.admin.invariant_types import Context, Violation
from refill.models import decisions
from refill.models.dataloader import epoch_order, epoch_uniforms
from refill.models.skipping import SkipSettings
from refill.models.tables import Prompt, PromptDraw, Slot, SparePrompt, StepMetrics

NAME = "prompt_draws"


def check_prompt_draws(ctx: Context) -> list[Violation]:
    s, run, settings = ctx.session, ctx.run, ctx.settings
    skip = SkipSettings.from_config(run.config)
    draws = s.execute(
        select(PromptDraw, Prompt.position)
        .join(Prompt, Prompt.id == PromptDraw.prompt_id)
        .where(PromptDraw.run_id == run.id)
        .order_by(PromptDraw.epoch, PromptDraw.position)
    ).all()
    if not skip.enabled:
        if draws:
            return [ctx.violation(NAME, f"{len(draws)} loader draws recorded, but the run does not skip prompts")]
        return []
    out = _epochs(ctx, draws)
    out += _decisions(ctx, skip, draws)
    taken = Counter(d.prompt_id for d, _ in draws if not d.skipped)
    placed = Counter(s.scalars(select(Slot.prompt_id).where(Slot.run_id == run.id)))
    placed += Counter(s.scalars(select(SparePrompt.prompt_id).where(SparePrompt.run_id == run.id)))
    lost, unknown = taken - placed, placed - taken
    if unknown:
        out.append(ctx.violation(NAME, f"prompts in slots or the spare pool the loader never took: {_few(unknown)}"))
    if lost and (settings.needs_spare_pool or lost.total() >= settings.num_prompts_per_step):
        # Without a spare pool, the last partial batch (fewer than a step's prompts) is dropped.
        out.append(ctx.violation(NAME, f"prompts taken by the loader but in no slot and not in the spare pool: {_few(lost)}"))
    counted = dict(
        s.execute(
            select(PromptDraw.step, func.count())
            .where(PromptDraw.run_id == run.id, PromptDraw.skipped.is_(True))
            .group_by(PromptDraw.step)
        ).all()
    )
    for step, recorded in s.execute(
        select(StepMetrics.step, StepMetrics.skipped_prompts).where(StepMetrics.run_id == run.id)
    ):
        if recorded != counted.get(step, 0):
            out.append(
                ctx.violation(NAME, f"metrics say {recorded} prompts were skipped for the step, the draws {counted.get(step, 0)}", step=step)
            )
    for name in ("skip_exploration_solved", "skip_exploration_failed"):
        rate = getattr(run, name)
        if rate is not None and not skip.rate_min - 1e-12 <= rate <= skip.rate_max + 1e-12:
            out.append(ctx.violation(NAME, f"runs.{name}={rate} is outside [{skip.rate_min}, {skip.rate_max}]"))
    return out


def _epochs(ctx: Context, draws: list) -> list[Violation]:  # type: ignore[type-arg]
    """Each epoch's places 0..k-1, once each, k = every prompt for a finished epoch and the
    cursor for the current one; each place holds the prompt of the epoch's order."""
    run, settings, out = ctx.run, ctx.settings, []
    places: dict[int, list[int]] = {}
    for draw, position in draws:
        places.setdefault(draw.epoch, []).append(draw.position)
        order = epoch_order(run.num_prompts, settings.seed, draw.epoch, settings.shuffle)
        if not 0 <= draw.position < run.num_prompts or order[draw.position] != position:
            out.append(
                ctx.violation(
                    NAME,
                    f"epoch {draw.epoch}, place {draw.position}: prompt at data-set position {position}, "
                    "not the one that epoch's order puts there",
                )
            )
    for epoch in range(max([run.loader_epoch, *places]) + 1):
        expected = run.num_prompts if epoch < run.loader_epoch else run.loader_cursor if epoch == run.loader_epoch else 0
        got = places.get(epoch, [])
        if got != list(range(expected)):
            out.append(
                ctx.violation(
                    NAME,
                    f"epoch {epoch}: {len(got)} places recorded, expected places 0..{expected - 1} once each "
                    f"(the loader is at epoch {run.loader_epoch}, place {run.loader_cursor})",
                )
            )
    return out


def _decisions(ctx: Context, skip: SkipSettings, draws: list) -> list[Violation]:  # type: ignore[type-arg]
    run, settings, out = ctx.run, ctx.settings, []
    for draw, _ in draws:
        where = f"epoch {draw.epoch}, place {draw.position}"
        uniforms = epoch_uniforms(run.num_prompts, settings.seed, draw.epoch)
        if 0 <= draw.position < len(uniforms) and draw.uniform != uniforms[draw.position]:
            out.append(ctx.violation(NAME, f"{where}: uniform {draw.uniform} is not the seeded {uniforms[draw.position]}"))
        if draw.streak > 0 and draw.exploration is not None:
            expected = decisions.skip_probability(draw.streak, draw.exploration, skip.min_exploration)
        else:
            expected = 0.0
        if not math.isclose(draw.probability, expected, rel_tol=1e-9, abs_tol=1e-12):
            out.append(
                ctx.violation(
                    NAME,
                    f"{where}: skip probability {draw.probability}, but a streak of {draw.streak} at "
                    f"exploration rate {draw.exploration} gives {expected}",
                )
            )
        if draw.probability > 1 - skip.min_exploration + 1e-12:
            out.append(ctx.violation(NAME, f"{where}: skip probability {draw.probability} above 1 - min_exploration"))
        if bool(draw.skipped) != decisions.skipped(draw.uniform, draw.probability):
            out.append(
                ctx.violation(
                    NAME,
                    f"{where}: {'skipped' if draw.skipped else 'taken'} with uniform {draw.uniform} "
                    f"against probability {draw.probability}",
                )
            )
    return out


def _few(counts: Counter) -> str:  # type: ignore[type-arg]
    ids = sorted(counts.elements())
    return ", ".join(f"prompt {i}" for i in ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
