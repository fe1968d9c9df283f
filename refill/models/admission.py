"""Admitting steps: a step's slots and first attempts are created once the weights are
recent enough for it (the staleness gate of SPEC §4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from refill.models import decisions
from refill.models.context import RunContext
from refill.models.dataloader import add_to_pool, draw, refill_spare_pool
from refill.models.slots import dispatch
from refill.models.tables import AttemptReason, Slot, Step, StepStatus


@dataclass
class Admitted:
    steps: list[int] = field(default_factory=list)
    outbox_ids: list[int] = field(default_factory=list)


def admit_steps(session: Session, run_id: int, now: datetime | None = None) -> Admitted:
    """Admit every step the gate allows; draw the spare pool up to its mark."""
    ctx = RunContext.open(session, run_id, now)
    result = Admitted(steps=admit(ctx))
    session.flush()
    result.outbox_ids = ctx.outbox_ids
    return result


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
        prompt_ids = draw(ctx, settings.num_prompts_per_step)
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
        from refill.models.overdispatch import top_up

        top_up(ctx)
    return steps


def open_step(ctx: RunContext, step: int, prompt_ids: list[int]) -> Step:
    settings = ctx.settings
    row = Step(
        run_id=ctx.run.id,
        step=step,
        status=StepStatus.OPEN.value,
        num_slots=len(prompt_ids),
        committed=0,
        shrunk=0,
        dropped_shrunk=0,
        admitted_at=ctx.now,
        train_claims=0,
    )
    ctx.session.add(row)
    # The tables have no ORM relationships (rows are addressed by key), so the unit of work
    # does not know to insert a step before its slots and slots before their attempts.
    ctx.session.flush()
    slots = []
    for idx, prompt_id in enumerate(prompt_ids):
        slot = Slot(
            run_id=ctx.run.id,
            step=step,
            idx=idx,
            prompt_id=prompt_id,
            filter_budget=settings.filter_budget,
            drop_budget=settings.drop_budget,
            needs_replacement=False,
            filtered=0,
            filter_replacements=0,
            infra_failures=0,
            data_failures=0,
            drops=0,
            drop_replacements=0,
            borrowed_in=0,
            lent_out=0,
            attempts=0,
        )
        slots.append(slot)
    ctx.session.add_all(slots)
    ctx.session.flush()
    for slot in slots:
        dispatch(ctx, step=step, slot=slot, prompt_id=slot.prompt_id, reason=AttemptReason.FIRST)
    return row
