"""The barrier (SPEC §1, §3.5): a full step is released to the trainer exactly once.

A step is full when its committed and shrunk slots cover all of them
(`decisions.step_is_full`). Releasing it records its metrics and, when the trainer's weights
have reached the step, queues its `train_step` message; otherwise the trainer's finish of the
step before it does (`training.finish_training`). The other senders of that message resend it
for a step already released: a failed or expired training claim, a lost message, a resume.
"""

from __future__ import annotations

from refill.models import decisions, metrics
from refill.models.context import RunContext
from refill.models.rows import StepRow
from refill.models.tables import OutboxKind, StepStatus

# A plain string: an enum member's `.value` is a Python property call, once per committed group.
_STEP_OPEN = StepStatus.OPEN.value


def maybe_release(ctx: RunContext, step: StepRow) -> bool:
    """The barrier: release a full step exactly once and queue its training.

    Exactly once because every writer of the run's slots holds the run's row lock (see
    `RunContext.open`), and the step leaves 'open' here and nowhere else; the database's
    CHECK that a step out of 'open' is full catches any path that would break that.
    """
    if step.status != _STEP_OPEN or not decisions.step_is_full(
        step.committed, step.num_slots, step.shrunk
    ):
        return False
    step.status = StepStatus.RELEASED.value
    step.released_at = ctx.now
    ctx.steps_changed = True
    # Looked up on the module at each call so that `python -m bench overhead` can time the
    # metrics apart from the rest of the release.
    metrics.record_release_metrics(ctx, step)
    if ctx.run.weight_version == step.step:
        queue_training(ctx, step.step)
    return True


def queue_training(ctx: RunContext, step: int, delay_seconds: float = 0.0) -> None:
    """The outbox row of step `step`'s `train_step` message."""
    ctx.new_outbox(
        {
            "run_id": ctx.run.id,
            "kind": OutboxKind.TRAIN_STEP.value,
            "step": step,
            "payload": {"run_id": ctx.run.id, "step": step},
            "created_at": ctx.now,
            "available_at": ctx.later(delay_seconds),
        }
    )
