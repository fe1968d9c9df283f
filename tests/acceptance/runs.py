"""What every finished fleet run must show, read from the ledger (shared by the fleet and
embedded acceptance tests)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.models.tables import Attempt, Group, Run, Slot, Step, StepMetrics
from tests.support.invariants import ledger_violations


@dataclass
class RunFacts:
    status: str
    error: str | None
    steps: int
    trained_per_step: list[int]
    zero_variance_trained: int
    max_staleness: int
    filtered: int
    filter_replacements: int
    borrowed_in: int
    lent_out: int
    zero_variance_fraction: float
    violations: list[str]


def run_facts(session: Session, run_id: int) -> RunFacts:
    run = session.get(Run, run_id)
    assert run is not None
    trained = session.execute(
        select(Slot.step, func.count())
        .where(Slot.run_id == run_id, Slot.status == "committed")
        .group_by(Slot.step)
        .order_by(Slot.step)
    ).all()
    groups = session.execute(
        select(Group.trained_step, Group.weight_version, Group.zero_variance).where(
            Group.run_id == run_id, Group.trained_step.is_not(None)
        )
    ).all()
    filtered = session.scalar(select(func.count()).where(Attempt.run_id == run_id, Attempt.state == "filtered"))
    finished = session.scalar(select(func.count()).where(Attempt.run_id == run_id, Attempt.zero_variance.is_not(None)))
    # A filtered slot's replacement is a spare prompt dispatched for it or a group borrowed
    # into it; either way it spends the slot's dynamic-sampling budget.
    replacements = session.scalar(
        select(func.coalesce(func.sum(Slot.filter_replacements), 0)).where(Slot.run_id == run_id)
    )
    borrowed, lent = session.execute(
        select(func.coalesce(func.sum(Slot.borrowed_in), 0), func.coalesce(func.sum(Slot.lent_out), 0)).where(
            Slot.run_id == run_id
        )
    ).one()
    steps = session.scalar(select(func.count()).where(Step.run_id == run_id, Step.status == "trained"))
    assert session.scalar(select(func.count()).where(StepMetrics.run_id == run_id)) == steps
    return RunFacts(
        status=run.status,
        error=run.error,
        steps=int(steps or 0),
        trained_per_step=[int(c) for _, c in trained],
        zero_variance_trained=sum(1 for _, _, zv in groups if zv),
        max_staleness=max((s - v for s, v, _ in groups), default=0),
        filtered=int(filtered or 0),
        filter_replacements=int(replacements or 0),
        borrowed_in=int(borrowed),
        lent_out=int(lent),
        zero_variance_fraction=(filtered or 0) / finished if finished else 0.0,
        violations=ledger_violations(session, run_id),
    )


def assert_healthy_dynamic_sampling_run(facts: RunFacts, *, steps: int, n_prompts: int, lookahead: int) -> None:
    assert facts.status == "completed", facts.error
    assert facts.steps == steps
    assert facts.trained_per_step == [n_prompts] * steps
    assert facts.zero_variance_trained == 0
    assert facts.max_staleness <= lookahead
    # The filter fired, at about the configured rate, and its replacements are in the ledger.
    assert 0.25 <= facts.zero_variance_fraction <= 0.55, facts.zero_variance_fraction
    assert facts.filtered > 0 and facts.filter_replacements > 0
    assert facts.violations == []
