"""Run lifecycle in the ledger: create, start (or take over), stop, resume, complete."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.models.barrier import queue_training
from refill.models.context import SLOT_COLUMNS, RunContext, utcnow
from refill.models.driver import insert_rows
from refill.models.rows import RunRow, SlotRow
from refill.models.settings import LedgerSettings
from refill.models.slots import LIVE, cancel_live_attempts, dispatch
from refill.models.tables import (
    Attempt,
    AttemptReason,
    Prompt,
    Run,
    RunStatus,
    Slot,
    SlotStatus,
    Step,
    StepStatus,
    WeightVersion,
)


class RunStateError(RuntimeError):
    """The run is not in a state that allows what was asked (with what to do instead)."""


@dataclass(frozen=True)
class PromptRow:
    text: str
    row: dict[str, Any]
    line_no: int | None = None


def create_run(
    session: Session,
    *,
    name: str,
    config: dict[str, Any],
    config_hash: str,
    prompts: list[PromptRow],
    data_fingerprint: str,
    output_dir: str,
    now: datetime | None = None,
) -> Run:
    """Record a new run with its config snapshot and data set. Nothing is dispatched yet;
    publish weight version 0, then `start_run`."""
    now = now or utcnow()
    settings = LedgerSettings.from_config(config)
    if len(prompts) < settings.num_prompts_per_step:
        raise ValueError(
            f"the data set has {len(prompts)} prompts, fewer than grpo.num_prompts_per_step="
            f"{settings.num_prompts_per_step}: not even one step can be filled"
        )
    run = Run(
        name=name,
        status=RunStatus.CREATED.value,
        config=config,
        config_hash=config_hash,
        data_fingerprint=data_fingerprint,
        run_dir="",
        created_at=now,
        num_prompts_per_step=settings.num_prompts_per_step,
        group_size=settings.group_size,
        max_num_steps=settings.max_num_steps,
        max_lookahead_versions=settings.max_lookahead_versions,
        num_prompts=len(prompts),
        loader_epoch=0,
        loader_cursor=0,
        loader_exhausted=False,
        next_step=0,
        weight_version=0,
        consecutive_dropped=0,
        stop_requested=False,
    )
    session.add(run)
    session.flush()
    run.run_dir = os.path.join(output_dir, f"{name}-{run.id}")
    insert_rows(
        session,
        Prompt.__table__,
        [
            {"run_id": run.id, "position": i, "line_no": p.line_no, "text": p.text, "row": p.row}
            for i, p in enumerate(prompts)
        ],
    )
    return run


def publish_initial_weights(session: Session, run_id: int, path: str | None, now: datetime | None = None) -> None:
    """Record weight version 0 (the initial model) for a created run."""
    now = now or utcnow()
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    if session.get(WeightVersion, (run_id, 0)) is None:
        session.add(WeightVersion(run_id=run_id, version=0, path=path, trained_step=None, created_at=now))


def refuse_if_ended(run_id: int, status: str, end_reason: str | None, error: str | None) -> None:
    """Raise RunStateError for a run no controller may start again: completed, or failed for
    a reason other than its fleet (a fleet's failure is fixed outside the run, then resumed)."""
    if status == RunStatus.COMPLETED.value:
        raise RunStateError(f"run {run_id} is completed ({end_reason}); start a new run instead")
    if status == RunStatus.FAILED.value and end_reason != "fleet_failed":
        raise RunStateError(
            f"run {run_id} failed and cannot resume: {(error or '').splitlines()[0] if error else end_reason} — "
            "fix the config and start a new run"
        )


def start_run(
    session: Session,
    run_id: int,
    controller_id: str,
    *,
    takeover_after_seconds: float = 30.0,
    previous_controller: str | None = None,
    created_only: bool = False,
    now: datetime | None = None,
) -> RunRow:
    """Make `controller_id` the run's controller and the run `running`.

    `created_only`: this controller was sent to start a new run (`refill run start --detach`),
    not to resume one: a run that is no longer `created` is refused (stopped before any
    controller took it, or started by another), unless this same controller started it (its
    message delivered again after its worker died).

    Only one controller drives a run: another one that heartbeated within
    `takeover_after_seconds` keeps it, unless it is `previous_controller` handing over (a
    detached controller's next slice). A `running` run whose controller went silent (it
    crashed) and a `stopped` run are resumed; slots left without a live attempt get one.
    """
    with RunContext.open(session, run_id, now) as ctx:
        run = ctx.run
        if (
            previous_controller is not None
            and run.status == RunStatus.RUNNING.value
            and run.controller_id == previous_controller
        ):
            run.controller_id = controller_id[:200]
            run.controller_seen_at = ctx.now
            return run
        if created_only and run.status != RunStatus.CREATED.value and run.controller_id != controller_id[:200]:
            raise RunStateError(
                f"run {run_id} is {run.status}: this controller was sent to start it, not to resume it "
                f"(`refill run resume {run_id}` does)"
            )
        refuse_if_ended(run_id, run.status, run.end_reason, run.error)
        if session.get(WeightVersion, (run_id, 0)) is None:
            raise RunStateError(f"run {run_id} has no initial weights (version 0) yet")
        if (
            run.controller_id not in (None, controller_id)
            and run.status == RunStatus.RUNNING.value
            and run.controller_seen_at is not None
            and run.controller_seen_at > ctx.now - timedelta(seconds=takeover_after_seconds)
        ):
            raise RunStateError(
                f"run {run_id} is driven by controller {run.controller_id} (seen "
                f"{(ctx.now - run.controller_seen_at).total_seconds():.0f}s ago); stop it first or "
                f"wait {takeover_after_seconds:.0f}s after it died"
            )
        resumed = run.status != RunStatus.CREATED.value
        run.status = RunStatus.RUNNING.value
        run.stop_requested = False
        run.error = None
        run.end_reason = None
        run.finished_at = None
        run.consecutive_dropped = 0
        run.controller_id = controller_id[:200]
        run.controller_seen_at = ctx.now
        run.started_at = run.started_at or ctx.now
        if resumed:
            repair_open_slots(ctx)
            head = ctx.find_step(run.weight_version)
            if head is not None and head.status == StepStatus.RELEASED.value:
                # Its train_step message may have been drained by the relay or refused by a
                # trainer while the run was not running; nothing else sends it again. A repeat
                # is harmless: a claim of a claimed or trained step is a no-op.
                queue_training(ctx, head.step)
    return run


def repair_open_slots(ctx: RunContext) -> int:
    """Give every open slot of an open step that has no live attempt a new one (after a stop
    or a fleet failure cancelled them), on the slot's most recent prompt.

    Two reads, the open steps' slots and the attempts aimed at them, matched here: a `NOT
    EXISTS` over the slots' live attempts was planned as a walk of the step's live attempts for
    each slot (the square of the step's size at every resume), and a read of each orphan's last
    prompt was a round trip per slot (every slot is an orphan after a stop)."""
    ctx.flush()
    slots = ctx.rows.load(
        SlotRow,
        select(*SLOT_COLUMNS)
        .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
        .where(Slot.run_id == ctx.run.id, Slot.status == SlotStatus.OPEN.value, Step.status == StepStatus.OPEN.value)
        .order_by(Slot.step, Slot.idx),
    )
    if not slots:
        return 0
    aimed = ctx.session.execute(
        select(Attempt.step, Attempt.slot_idx, Attempt.prompt_id, Attempt.state)
        .where(Attempt.run_id == ctx.run.id, Attempt.step.in_(sorted({slot.step for slot in slots})), Attempt.slot_idx.is_not(None))
        .order_by(Attempt.id)
    ).all()
    live = {(step, idx) for step, idx, _, state in aimed if state in LIVE}
    # In id order, so each slot keeps its newest attempt's prompt.
    last_prompt = {(step, idx): prompt_id for step, idx, prompt_id, _ in aimed}
    orphans = [slot for slot in slots if (slot.step, slot.idx) not in live]
    for slot in orphans:
        dispatch(
            ctx,
            step=slot.step,
            slot=slot,
            prompt_id=last_prompt.get((slot.step, slot.idx), slot.prompt_id),
            reason=AttemptReason.RETRY,
        )
    return len(orphans)


def controller_heartbeat(session: Session, run_id: int, controller_id: str, now: datetime | None = None) -> RunRow:
    """Refresh the controller's claim; raises if another controller took the run over."""
    with RunContext.open(session, run_id, now) as ctx:
        if ctx.run.controller_id != controller_id[:200]:
            raise RunStateError(f"run {run_id} is now driven by controller {ctx.run.controller_id}")
        ctx.run.controller_seen_at = ctx.now
        return ctx.run


def request_stop(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    run.stop_requested = True
    return run


def stop_run(session: Session, run_id: int, now: datetime | None = None) -> int:
    """Stop a run whose stop was requested: cancel its live attempts. Resumable. A run that
    was created and never started is stopped too (it has nothing in flight): the first slice
    of a `--detach` start that is still queued then leaves it alone (`start_run`'s
    `created_only`), and `refill run resume` starts it."""
    with RunContext.open(session, run_id, now) as ctx:
        running = ctx.running
        if not running and ctx.run.status != RunStatus.CREATED.value:
            return 0
        ctx.run.status = RunStatus.STOPPED.value
        ctx.run.end_reason = "stopped"
        ctx.run.finished_at = ctx.now
        ctx.run.controller_id = None
        return cancel_live_attempts(ctx, "run stopped") if running else 0


def check_run(session: Session, run_id: int, now: datetime | None = None) -> str:
    """The controller's safety net: complete the run if nothing is left to do."""
    with RunContext.open(session, run_id, now) as ctx:
        check_completion(ctx)
        return ctx.run.status


def check_completion(ctx: RunContext) -> bool:
    """Complete the run once no step can be admitted and every admitted step is trained."""
    run = ctx.run
    if not ctx.running:
        return False
    admission_over = run.next_step >= ctx.settings.max_num_steps or run.loader_exhausted
    if not admission_over:
        return False
    ctx.flush()
    untrained = ctx.session.scalar(
        select(func.count()).where(Step.run_id == run.id, Step.status != StepStatus.TRAINED.value)
    )
    if untrained:
        return False
    run.status = RunStatus.COMPLETED.value
    run.end_reason = "max_num_steps" if run.next_step >= ctx.settings.max_num_steps else "end_of_data"
    run.finished_at = ctx.now
    cancel_live_attempts(ctx, "run completed")
    return True
