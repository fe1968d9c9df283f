"""The invariants of a run's history: contiguous weight versions, the messages each step
needs, and the spare pool's takers.
"""

from __future__ import annotations

from sqlalchemy import and_, select

from refill.admin.invariant_types import Context, Violation
from refill.models.tables import (
    Attempt,
    Outbox,
    OutboxKind,
    RunStatus,
    SparePrompt,
    Step,
    StepMetrics,
    StepStatus,
    WeightVersion,
)

# --- weight versions -----------------------------------------------------------------------


def check_weight_versions(ctx: Context) -> list[Violation]:
    s, run, out = ctx.session, ctx.run, []
    name = "weight_versions"
    versions = s.execute(
        select(WeightVersion.version, WeightVersion.trained_step)
        .where(WeightVersion.run_id == run.id)
        .order_by(WeightVersion.version)
    ).all()
    numbers = [v for v, _ in versions]
    if numbers != list(range(run.weight_version + 1)):
        missing = sorted(set(range(run.weight_version + 1)) - set(numbers))
        extra = sorted(set(numbers) - set(range(run.weight_version + 1)))
        out.append(
            ctx.violation(
                name,
                f"run is at v{run.weight_version}; versions must be 0..{run.weight_version} without gaps "
                f"(missing {missing}, beyond the run's version {extra})",
            )
        )
    for version, trained_step in versions:
        expected = None if version == 0 else version - 1
        if trained_step != expected:
            out.append(
                ctx.violation(
                    name,
                    f"v{version} says it was trained from step {trained_step}, not {expected}",
                    step=trained_step,
                )
            )
    trained = list(
        s.scalars(
            select(Step.step)
            .where(Step.run_id == run.id, Step.status == StepStatus.TRAINED.value)
            .order_by(Step.step)
        )
    )
    for step in sorted(set(trained) ^ set(range(run.weight_version))):
        if step in trained:
            message = f"step is trained, but the run is at v{run.weight_version} (no version v{step + 1} for it)"
        else:
            message = f"v{step + 1} exists, but step {step} is not trained"
        out.append(ctx.violation(name, message, step=step))
    return out


# --- ledger consistency --------------------------------------------------------------------


def check_messages(ctx: Context) -> list[Violation]:
    """A released step has its metrics; while the run runs, a step due for training had a
    train_step message. (A pending attempt is its own generate message: nothing to check.)"""
    s, run, out = ctx.session, ctx.run, []
    name = "outbox"
    for step in s.scalars(
        select(Step.step)
        .outerjoin(StepMetrics, and_(StepMetrics.run_id == Step.run_id, StepMetrics.step == Step.step))
        .where(Step.run_id == run.id, Step.status != StepStatus.OPEN.value, StepMetrics.step.is_(None))
        .order_by(Step.step)
    ):
        out.append(ctx.violation(name, "released step has no metrics row", step=step))
    if run.status == RunStatus.RUNNING.value:
        queued = set(
            s.scalars(
                select(Outbox.step).where(Outbox.run_id == run.id, Outbox.kind == OutboxKind.TRAIN_STEP.value)
            )
        )
        for step, status in s.execute(
            select(Step.step, Step.status)
            .where(Step.run_id == run.id, Step.status != StepStatus.OPEN.value)
            .order_by(Step.step)
        ).all():
            due = status in (StepStatus.TRAINING.value, StepStatus.TRAINED.value) or step == run.weight_version
            if due and step not in queued:
                out.append(ctx.violation(name, f"{status} step never had a train_step message", step=step))
    return out


def check_spare_pool(ctx: Context) -> list[Violation]:
    """A taken spare prompt names the attempt that took it, and that attempt runs its prompt."""
    out = []
    for spare_id, prompt_id, attempt_id, attempt_prompt, step, idx in ctx.session.execute(
        select(
            SparePrompt.id,
            SparePrompt.prompt_id,
            SparePrompt.taken_by_attempt,
            Attempt.prompt_id,
            Attempt.step,
            Attempt.slot_idx,
        )
        .outerjoin(Attempt, Attempt.id == SparePrompt.taken_by_attempt)
        .where(SparePrompt.run_id == ctx.run.id, SparePrompt.taken_at.is_not(None))
        .order_by(SparePrompt.id)
    ).all():
        if attempt_prompt != prompt_id:
            taker = f"attempt {attempt_id} on prompt {attempt_prompt}" if attempt_prompt is not None else "no attempt"
            out.append(
                ctx.violation(
                    "spare_pool",
                    f"spare {spare_id} (prompt {prompt_id}) was taken by {taker}",
                    step=step,
                    slot=idx,
                    attempt=attempt_id,
                )
            )
    return out
