"""The dynamic-sampling and fault-tolerance budgets of a run: the measured zero-variance
fraction, per-slot budget use (`refill budget`) and the exhaustion risk the controller warns
about (SPEC §3.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.admin.snapshot import get_run, get_step
from refill.models.tables import Attempt, Slot, StepMetrics


def zero_variance_from_attempts(session: Session, run_id: int) -> tuple[int, int]:
    """(zero-variance groups, finished groups) over every attempt of the run so far."""
    zero, total = session.execute(
        select(func.count().filter(Attempt.zero_variance.is_(True)), func.count()).where(
            Attempt.run_id == run_id, Attempt.zero_variance.is_not(None)
        )
    ).one()
    return int(zero or 0), int(total or 0)


def budget_report(
    session: Session, run_id: int, *, step: int | None = None, every_slot: bool = False
) -> dict[str, Any]:
    """Per-slot use of the dynamic-sampling (filter) and fault-tolerance (drop) budgets, the
    measured zero-variance fraction p, and the risk that some slot exhausts its filter budget
    over the run: 1 - (1 - p**(budget+1))**(N * max_num_steps), with the expected number of
    exhausted slots p**(budget+1) * N * max_num_steps (SPEC §3.3)."""
    from refill.models import decisions
    from refill.models.settings import LedgerSettings

    run = get_run(session, run_id)
    if step is not None:
        get_step(session, run_id, step)
    settings = LedgerSettings.from_config(run.config)
    zero, total = zero_variance_from_attempts(session, run_id)
    p = zero / total if total else None
    budget = settings.filter_budget
    n_slots = settings.num_prompts_per_step
    risk = expected = suggested = None
    if p is not None and settings.use_dynamic_sampling:
        risk = decisions.exhaustion_probability(p, budget, n_slots, settings.max_num_steps)
        expected = decisions.expected_exhausted_slots(p, budget, n_slots, settings.max_num_steps)
        if p < 1:
            suggested = decisions.safe_budget(p, n_slots, settings.max_num_steps)
    stored = session.execute(
        select(StepMetrics.step, StepMetrics.budget_exhaustion_risk)
        .where(StepMetrics.run_id == run_id, StepMetrics.budget_exhaustion_risk.is_not(None))
        .order_by(StepMetrics.step.desc())
        .limit(1)
    ).first()
    where = [Slot.run_id == run_id]
    if step is not None:
        where.append(Slot.step == step)
    histogram = {
        int(k): int(v)
        for k, v in session.execute(
            select(Slot.filter_replacements, func.count())
            .where(*where)
            .group_by(Slot.filter_replacements)
            .order_by(Slot.filter_replacements)
        ).all()
    }
    totals = session.execute(
        select(
            func.count(),
            func.coalesce(func.max(Slot.filter_replacements), 0),
            func.coalesce(func.sum(Slot.filter_replacements), 0),
            func.coalesce(func.max(Slot.drop_replacements), 0),
            func.coalesce(func.sum(Slot.drop_replacements), 0),
            func.coalesce(func.sum(Slot.drops), 0),
            func.coalesce(func.sum(Slot.infra_failures), 0),
            func.coalesce(func.sum(Slot.data_failures), 0),
        ).where(*where)
    ).one()
    used = (
        (Slot.filtered > 0)
        | (Slot.filter_replacements > 0)
        | (Slot.drops > 0)
        | (Slot.drop_replacements > 0)
        | (Slot.infra_failures > 0)
        | (Slot.data_failures > 0)
    )
    query = select(Slot).where(*where)
    if not every_slot:
        query = query.where(used)
    slots = [
        {
            "step": s.step,
            "slot": s.idx,
            "status": s.status,
            "filtered": s.filtered,
            "filter_replacements": s.filter_replacements,
            "filter_budget": s.filter_budget,
            "filter_budget_left": s.filter_budget - s.filter_replacements,
            "infra_failures": s.infra_failures,
            "data_failures": s.data_failures,
            "drops": s.drops,
            "drop_replacements": s.drop_replacements,
            "drop_budget": s.drop_budget,
            "drop_budget_left": s.drop_budget - s.drop_replacements,
            "borrowed_in": s.borrowed_in,
            "lent_out": s.lent_out,
        }
        for s in session.scalars(query.order_by(Slot.step, Slot.idx))
    ]
    return {
        "run_id": run_id,
        "step": step,
        "use_dynamic_sampling": settings.use_dynamic_sampling,
        "filter_budget": budget,
        "drop_budget": settings.drop_budget,
        "on_dropped_prompt": settings.on_dropped_prompt,
        "num_prompts_per_step": n_slots,
        "max_num_steps": settings.max_num_steps,
        "zero_variance_groups": zero,
        "finished_groups": total,
        "p": p,
        "budget_exhaustion_risk": risk,
        "expected_exhausted_slots": expected,
        "budget_for_1pct_risk": suggested,
        "last_recorded_risk": (
            {"step": stored[0], "budget_exhaustion_risk": stored[1]} if stored else None
        ),
        "slots_total": int(totals[0]),
        "max_filter_replacements": int(totals[1]),
        "filter_replacements": int(totals[2]),
        "max_drop_replacements": int(totals[3]),
        "drop_replacements": int(totals[4]),
        "drops": int(totals[5]),
        "infra_failures": int(totals[6]),
        "data_failures": int(totals[7]),
        "filter_replacements_histogram": histogram,
        "slots": slots,
    }


@dataclass(frozen=True)
class BudgetRisk:
    step: int
    p: float
    budget: int
    probability: float
    expected_exhausted: float
    safe_budget: int | None


def budget_risk(session: Session, run_id: int) -> BudgetRisk | None:
    """The dynamic-sampling budget risk as of the latest released step (None before one)."""
    from refill.models import decisions
    from refill.models.settings import LedgerSettings

    latest = session.execute(
        select(StepMetrics.step, StepMetrics.budget_exhaustion_risk)
        .where(StepMetrics.run_id == run_id, StepMetrics.budget_exhaustion_risk.is_not(None))
        .order_by(StepMetrics.step.desc())
        .limit(1)
    ).first()
    if latest is None:
        return None
    run = get_run(session, run_id)
    settings = LedgerSettings.from_config(run.config)
    zero, total = zero_variance_from_attempts(session, run_id)
    p = zero / total if total else 0.0
    n, steps = settings.num_prompts_per_step, settings.max_num_steps
    return BudgetRisk(
        step=int(latest[0]),
        p=p,
        budget=settings.filter_budget,
        probability=float(latest[1]),
        expected_exhausted=decisions.expected_exhausted_slots(p, settings.filter_budget, n, steps),
        safe_budget=decisions.safe_budget(p, n, steps) if p < 1 else None,
    )
