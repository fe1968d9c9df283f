"""Admitting steps: a step's slots and first attempts are created once the weights are
recent enough for it (the staleness gate of SPEC §4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from refill.models import decisions
from refill.models.context import RunContext
from refill.models.dataloader import add_to_pool, draw, refill_spare_pool
from refill.models.driver import insert_rows
from refill.models.overdispatch import top_up
from refill.models.rows import StepRow
from refill.models.slots import attempt_values
from refill.models.tables import Attempt, AttemptReason, Slot, SlotStatus, StepStatus


@dataclass
class Admitted:
    steps: list[int] = field(default_factory=list)


def admit_steps(session: Session, run_id: int, now: datetime | None = None) -> Admitted:
    """Admit every step the gate allows; draw the spare pool up to its mark."""
    with RunContext.open(session, run_id, now) as ctx:
        steps = admit(ctx)
    return Admitted(steps=steps)


def admit(ctx: RunContext) -> list[int]:
    """Admission inside an open unit of work (the trainer calls it right after publishing a
    weight version, so the next step's generation does not wait for a controller tick)."""
    steps: list[int] = []
    run, settings = ctx.run, ctx.settings
    if not ctx.running or run.stop_requested:
        return steps
    while (
        run.next_step < settings.max_num_steps
        and not run.loader_exhausted
        and decisions.admissible(run.next_step, run.weight_version, settings.max_lookahead_versions)
    ):
        prompt_ids = draw(ctx, settings.num_prompts_per_step, step=run.next_step)
        if len(prompt_ids) < settings.num_prompts_per_step:
            # A partial batch cannot make a step; its prompts still serve replacements.
            if settings.needs_spare_pool:
                add_to_pool(ctx, prompt_ids)
            break
        open_step(ctx, run.next_step, prompt_ids)
        steps.append(run.next_step)
        run.next_step += 1
    refill_spare_pool(ctx)
    if steps:
        top_up(ctx)
    return steps


def open_step(ctx: RunContext, step: int, prompt_ids: list[int]) -> StepRow:
    """The step's row, its slots and each slot's first attempt (pending: its generate message).

    The slots and attempts are written as two bulk inserts without ORM
    objects: for a step of thousands of prompts, building and flushing an object per row was
    most of the cost of admission (`python -m bench overhead --profile admission`). What reads
    them later in the transaction (over-dispatch's top-up) loads them from the database, as
    it does rows written by earlier transactions.
    """
    settings, run_id, now = ctx.settings, ctx.run.id, ctx.now
    row = ctx.rows.new(
        StepRow,
        {
            "run_id": run_id,
            "step": step,
            "status": StepStatus.OPEN.value,
            "num_slots": len(prompt_ids),
            "committed": 0,
            "shrunk": 0,
            "dropped_shrunk": 0,
            "admitted_at": now,
            "train_claims": 0,
            "extras": 0,
        },
    )
    ctx.steps_changed = True
    # The step must be in the database before its slots.
    ctx.flush()
    insert_rows(
        ctx.session,
        Slot.__table__,
        [
            {
                "run_id": run_id,
                "step": step,
                "idx": idx,
                "status": SlotStatus.OPEN.value,
                "prompt_id": prompt_id,
                "filter_budget": settings.filter_budget,
                "drop_budget": settings.drop_budget,
                "attempts": 1,  # its first attempt, inserted below
            }
            for idx, prompt_id in enumerate(prompt_ids)
        ],
    )
    ctx.made_attempts.extend(
        ctx.ids.insert(
            Attempt.__table__,
            [
                attempt_values(ctx, step=step, slot_idx=idx, prompt_id=prompt_id, reason=AttemptReason.FIRST, available=now)
                for idx, prompt_id in enumerate(prompt_ids)
            ],
        )
    )
    return row
