"""The budget risk a healthy run reports (SPEC §8: before it fails), as the controller reads it."""

from __future__ import annotations

from refill.admin.budget_queries import budget_risk
from refill.models import decisions
from tests.support.driver import FLAT, SPREAD, Driver


def test_budget_risk_follows_the_measured_zero_variance_fraction(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"dynamic_sampling_max_replacements_per_slot": 3}})
    d.admit()
    assert d.query(lambda s: budget_risk(s, d.run_id)) is None  # nothing released yet
    # Half of the groups are zero-variance: p = 0.5 with a budget of 3 over 3 steps x 4 slots.
    for idx in range(4):
        d.filter_slot(0, idx, FLAT)
    d.fill_step(0, SPREAD)
    risk = d.query(lambda s: budget_risk(s, d.run_id))
    assert risk is not None and risk.step == 0 and risk.budget == 3
    assert risk.p == d.query(lambda s: _p(s, d.run_id))
    assert risk.probability == d.metrics(0).budget_exhaustion_risk
    assert risk.expected_exhausted == decisions.expected_exhausted_slots(risk.p, 3, 4, 3)
    assert risk.safe_budget == decisions.safe_budget(risk.p, 4, 3)
    assert risk.safe_budget > 3


def _p(session, run_id):  # type: ignore[no-untyped-def]
    from refill.admin.budget_queries import zero_variance_from_attempts

    zero, total = zero_variance_from_attempts(session, run_id)
    return zero / total
