"""How far a run got, read by the controller's progress display, `refill tail` and the
metrics commands: the run's position and open steps, and the per-step metrics rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.models import sql
from refill.models.tables import Run, SparePrompt, Step, StepMetrics, StepStatus


@dataclass
class StepProgress:
    step: int
    status: str
    committed: int
    target: int


@dataclass
class RunProgress:
    run_id: int
    name: str
    status: str
    end_reason: str | None
    error: str | None
    max_num_steps: int
    trained_steps: int
    weight_version: int
    spare_pool: int
    open_steps: list[StepProgress] = field(default_factory=list)
    #: the newest trained steps' metrics (at most RECENT_STEPS), in step order
    recent_metrics: list[dict[str, Any]] = field(default_factory=list)


#: How many of the newest trained steps' metrics a progress snapshot carries: more steps than
#: train between two of the controller's snapshots (half a second apart), so that a log of
#: `refill run start` has a line for every step, not only for the newest each snapshot saw.
RECENT_STEPS = 16


def run_progress(session: Session, run_id: int) -> RunProgress:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    # Polled every second or so: the trained steps counted as the steps admitted less those
    # not trained yet (the partial index of unfinished steps, 'trained' written as a literal for
    # it), in one statement so that both counts see one snapshot. Counting the trained ones
    # walked every step the run ever trained (tests/integration/test_run_length.py).
    unfinished = select(func.count()).where(Step.run_id == run_id, Step.status != sql.literal(StepStatus.TRAINED.value))
    trained = session.scalar(select(Run.next_step - unfinished.scalar_subquery()).where(Run.id == run_id))
    spare = session.scalar(
        select(func.count()).where(SparePrompt.run_id == run_id, SparePrompt.taken_at.is_(None))
    )
    open_steps = [
        StepProgress(s.step, s.status, s.committed, s.num_slots - s.shrunk)
        for s in session.execute(*sql.unfinished_steps(run_id))
    ]
    newest = session.scalars(
        select(StepMetrics)
        .join(Step, (Step.run_id == StepMetrics.run_id) & (Step.step == StepMetrics.step))
        .where(StepMetrics.run_id == run_id, Step.status == StepStatus.TRAINED.value)
        .order_by(StepMetrics.step.desc())
        .limit(RECENT_STEPS)
    ).all()
    return RunProgress(
        run_id=run.id,
        name=run.name,
        status=run.status,
        end_reason=run.end_reason,
        error=run.error,
        max_num_steps=run.max_num_steps,
        trained_steps=int(trained or 0),
        weight_version=run.weight_version,
        spare_pool=int(spare or 0),
        open_steps=open_steps,
        recent_metrics=[metrics_dict(row) for row in reversed(newest)],
    )


METRIC_COLUMNS = [c.key for c in StepMetrics.__table__.columns if c.key not in ("run_id", "extra")]


def metrics_dict(row: StepMetrics) -> dict[str, Any]:
    out = {key: getattr(row, key) for key in METRIC_COLUMNS}
    out.update(row.extra or {})
    return out


def step_metrics(session: Session, run_id: int, *, last: int | None = None) -> list[dict[str, Any]]:
    """The run's step metrics in step order; with `last`, its newest `last` steps' only (what a
    poll shows, read through the key from the end rather than the run's every step)."""
    statement = select(StepMetrics).where(StepMetrics.run_id == run_id)
    if last is None:
        return [metrics_dict(row) for row in session.scalars(statement.order_by(StepMetrics.step))]
    newest = session.scalars(statement.order_by(StepMetrics.step.desc()).limit(last))
    return [metrics_dict(row) for row in reversed(list(newest))]
