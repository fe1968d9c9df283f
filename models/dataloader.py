"""The data loader and the spare pool, both kept in the ledger.

The loader's order within an epoch is a permutation seeded by (run seed, epoch), so its whole
state is (epoch, cursor) on the run row and a restarted controller draws exactly the prompts a
live one would have. The spare pool holds prompts drawn ahead to serve replacements; it is
topped up by one batch of `num_prompts_per_step` whenever it falls below
`rollout_failure.replacement_reserve_prompts`, in the same transaction that took from it, so
it can only be empty when the loader is exhausted (SPEC §3.4).

Under pre-rollout skipping (`data.prompt_skipping`, `refill.models.skipping`) the loader walks
the same order, and a prompt it skips costs its place in the epoch and no generation: a draw
of `count` prompts goes on past skipped ones until it has `count` (or the data ends), so the
spare pool's mark, `max_num_epochs` and the end of the data count what is generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from sqlalchemy import select

from refill.models import decisions, skipping, sql
from refill.models.context import RunContext
from refill.models.decisions import spare_refill_needed
from refill.models.driver import insert_rows
from refill.models.rows import AttemptRow, SpareRow
from refill.models.sql import ids_in
from refill.models.tables import Prompt, PromptDraw

#: Places read ahead per query under skipping: at least this many, else twice what is still
#: wanted (about what a half-skipping loader needs; more is read only when it runs short).
SKIP_WINDOW = 64


#: Epoch orders kept by a process: the current epoch and the next (a draw crosses into it) of
#: two runs. Each is the whole data set's order, so a process that kept every epoch it met
#: grew by one data set's worth of memory an epoch (`epoch_order`).
EPOCH_ORDERS_KEPT = 4


@lru_cache(maxsize=EPOCH_ORDERS_KEPT)
def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> Sequence[int]:
    """The data set's positions in epoch `epoch`'s order: a pure function of the run's seed, so
    a restarted controller draws exactly what a live one would have. A read-only view of
    machine integers (indexing it gives an int, slicing it a view): a tuple of Python ints took
    about 40 bytes a prompt, and the 32 epochs this cache used to keep held 25 MiB for a data
    set of 20,000 prompts, the whole of `bench scale`'s memory growth over a million attempts
    (bench/HISTORY.md, stop 42); a million prompts would have held 1.3 GB."""
    kind = np.int32 if num_prompts < 2**31 else np.int64
    if not shuffle:
        return _read_only(np.arange(num_prompts, dtype=kind))
    rng = np.random.default_rng([seed, epoch])
    return _read_only(rng.permutation(num_prompts).astype(kind))


#: Mixed into the seed of an epoch's uniforms, so they are not the epoch order's stream.
_UNIFORM_STREAM = 0x5C1B


@lru_cache(maxsize=EPOCH_ORDERS_KEPT)
def epoch_uniforms(num_prompts: int, seed: int, epoch: int) -> Sequence[float]:
    """The uniform of each place of epoch `epoch`'s order, which pre-rollout skipping compares
    with a prompt's skip probability (`refill.models.skipping`): a pure function of the run's
    seed, so a restarted controller decides exactly what a live one would have. A read-only
    view of doubles, kept as the orders are."""
    rng = np.random.default_rng([seed, epoch, _UNIFORM_STREAM])
    return _read_only(rng.random(num_prompts))


def _read_only(values: np.ndarray) -> memoryview:
    """`values` as a read-only memoryview: what a cache may hand to every caller."""
    return memoryview(values).toreadonly()


def draw(ctx: RunContext, count: int, step: int | None = None) -> list[int]:
    """Take up to `count` prompt ids from the loader (fewer only when it is exhausted), for
    step `step` (admission's), else for the spare pool."""
    run, settings = ctx.run, ctx.settings
    if skipping.skip_settings(run).enabled:
        return _draw_skipping(ctx, count, step)
    positions: list[int] = []
    while len(positions) < count and not run.loader_exhausted:
        order = epoch_order(run.num_prompts, settings.seed, run.loader_epoch, settings.shuffle)
        take = order[run.loader_cursor : run.loader_cursor + count - len(positions)]
        positions.extend(take)
        _advance(ctx, len(take))
    return _prompt_ids(ctx, positions)


def _advance(ctx: RunContext, places: int) -> None:
    """Move the cursor `places` on, into the next epoch at the end of one."""
    run, settings = ctx.run, ctx.settings
    run.loader_cursor += places
    if run.loader_cursor >= run.num_prompts:
        run.loader_epoch += 1
        run.loader_cursor = 0
        if settings.max_num_epochs is not None and run.loader_epoch >= settings.max_num_epochs:
            run.loader_exhausted = True


def _prompt_ids(ctx: RunContext, positions: Sequence[int]) -> list[int]:
    if not positions:
        return []
    # By the run's unique (run, position) key, the positions bound as one array: admission
    # asks for thousands, which written into the SQL took SQLAlchemy longer to render than
    # PostgreSQL to find.
    by_position = dict(
        ctx.session.execute(
            select(Prompt.position, Prompt.id).where(
                Prompt.run_id == ctx.run.id, ids_in(Prompt.position, sorted(set(positions)))
            )
        ).all()
    )
    return [by_position[p] for p in positions]


def _draw_skipping(ctx: RunContext, count: int, step: int | None) -> list[int]:
    """`draw` under pre-rollout skipping: each place reached is decided, recorded in
    `prompt_draws`, and skipped or taken (`refill.models.skipping`)."""
    run, settings = ctx.run, ctx.settings
    skip = skipping.skip_settings(run)
    # The history must hold the groups this transaction scored: a flush, once per draw.
    ctx.flush()
    if step is None:
        step = _spare_pool_step(ctx)
    rates = skipping.exploration_rates(run, skip)
    longest = decisions.saturating_streak(rates.values(), skip.min_exploration)
    kept: list[int] = []
    rows: list[dict] = []  # type: ignore[type-arg]
    while len(kept) < count and not run.loader_exhausted:
        epoch, start = run.loader_epoch, run.loader_cursor
        order = epoch_order(run.num_prompts, settings.seed, epoch, settings.shuffle)
        uniforms = epoch_uniforms(run.num_prompts, settings.seed, epoch)
        prompt_ids = _prompt_ids(ctx, order[start : start + max(SKIP_WINDOW, 2 * (count - len(kept)))])
        history = skipping.streaks(ctx.session, run.id, prompt_ids, longest)
        used = 0
        for offset, prompt_id in enumerate(prompt_ids):
            kind, streak = history.get(prompt_id, (None, 0))
            rate = rates[kind] if kind is not None else None
            probability = 0.0 if rate is None else decisions.skip_probability(streak, rate, skip.min_exploration)
            uniform = uniforms[start + offset]
            passed = decisions.skipped(uniform, probability)
            rows.append(
                {
                    "run_id": run.id,
                    "epoch": epoch,
                    "position": start + offset,
                    "prompt_id": prompt_id,
                    "step": step,
                    "skipped": passed,
                    "streak_kind": None if kind is None else kind.value,
                    "streak": streak,
                    "exploration": rate,
                    "probability": probability,
                    "uniform": uniform,
                    "drawn_at": ctx.now,
                }
            )
            used = offset + 1
            if not passed:
                kept.append(prompt_id)
                if len(kept) == count:
                    break
        _advance(ctx, used)
    if rows:
        insert_rows(ctx.session, PromptDraw.__table__, rows)
    return kept


def _spare_pool_step(ctx: RunContext) -> int:
    """The step a spare pool's draw is for: the earliest open one (its release counts what was
    skipped), else the next to be admitted."""
    earliest = ctx.session.scalar(select(sql.first_open_step()), {"run_id": ctx.run.id})
    return ctx.run.next_step if earliest is None else int(earliest)


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


def take_spare(ctx: RunContext) -> SpareRow | None:
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


def mark_taken(spare: SpareRow, attempt: AttemptRow) -> None:
    """Record which attempt took `spare`."""
    spare.taken_by_attempt = attempt.id
