"""The data loader and the spare pool, both kept in the ledger.

The loader's order within an epoch is a permutation seeded by (run seed, epoch), so its whole
state is (epoch, cursor) on the run row and a restarted controller draws exactly the prompts a
live one would have. The spare pool holds prompts drawn ahead to serve replacements; it is
topped up by one batch of `num_prompts_per_step` whenever it falls below
`rollout_failure.replacement_reserve_prompts`, in the same transaction that took from it, so
it can only be empty when the loader is exhausted (SPEC §3.4).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from sqlalchemy import select

from refill.models.context import RunContext
from refill.models.decisions import spare_refill_needed
from refill.models.tables import Attempt, Prompt, SparePrompt


@lru_cache(maxsize=32)
def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> tuple[int, ...]:
    if not shuffle:
        return tuple(range(num_prompts))
    rng = np.random.default_rng([seed, epoch])
    return tuple(int(i) for i in rng.permutation(num_prompts))


def draw(ctx: RunContext, count: int) -> list[int]:
    """Take up to `count` prompt ids from the loader (fewer only when it is exhausted)."""
    run, settings = ctx.run, ctx.settings
    positions: list[int] = []
    while len(positions) < count and not run.loader_exhausted:
        order = epoch_order(run.num_prompts, settings.seed, run.loader_epoch, settings.shuffle)
        take = order[run.loader_cursor : run.loader_cursor + count - len(positions)]
        positions.extend(take)
        run.loader_cursor += len(take)
        if run.loader_cursor >= run.num_prompts:
            run.loader_epoch += 1
            run.loader_cursor = 0
            if settings.max_num_epochs is not None and run.loader_epoch >= settings.max_num_epochs:
                run.loader_exhausted = True
    if not positions:
        return []
    by_position = dict(
        ctx.session.execute(
            select(Prompt.position, Prompt.id).where(
                Prompt.run_id == run.id, Prompt.position.in_(positions)
            )
        ).all()
    )
    return [by_position[p] for p in positions]


def refill_spare_pool(ctx: RunContext) -> int:
    """Top the pool up by one loader batch if it is below the low-water mark."""
    settings = ctx.settings
    if not settings.needs_spare_pool:
        return 0
    if not spare_refill_needed(ctx.spare_count, settings.replacement_reserve_prompts, ctx.run.loader_exhausted):
        return 0
    prompt_ids = draw(ctx, settings.num_prompts_per_step)
    add_to_pool(ctx, prompt_ids)
    return len(prompt_ids)


def add_to_pool(ctx: RunContext, prompt_ids: list[int]) -> None:
    ctx.add_spares(
        [
            {"run_id": ctx.run.id, "prompt_id": pid, "epoch": ctx.run.loader_epoch, "added_at": ctx.now}
            for pid in prompt_ids
        ]
    )


def take_spare(ctx: RunContext) -> SparePrompt | None:
    """The oldest spare prompt, or None when the pool is dry and the loader exhausted."""
    if ctx.spare_count == 0:
        # Only reachable when the mark is below one batch and the last take emptied the pool
        # while the loader still has prompts; draw now rather than shrink a step needlessly.
        if ctx.run.loader_exhausted:
            return None
        add_to_pool(ctx, draw(ctx, ctx.settings.num_prompts_per_step))
    spare = ctx.next_spare()
    if spare is None:
        return None
    spare.taken_at = ctx.now
    ctx.spare_taken()
    refill_spare_pool(ctx)
    return spare


def mark_taken(spare: SparePrompt, attempt: Attempt) -> None:
    """Record which attempt took `spare`."""
    if attempt.id is not None:
        # Its id was drawn in advance (PostgreSQL): a plain column, which the batch's bulk
        # UPDATE writes with the other spares (`bulk_update.py`) instead of a statement each.
        spare.taken_by_attempt = attempt.id
    else:
        spare.taken_by = attempt  # the unit of work fills the id in when it inserts the attempt
