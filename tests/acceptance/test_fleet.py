"""The fleet end to end: real `celery worker` processes on Redis and PostgreSQL, the `sim`
back-end, the controller in this process (issue 3, "Must show")."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from refill.models.tables import Slot
from tests.acceptance.runs import assert_healthy_dynamic_sampling_run, run_facts

N_PROMPTS = 16


def test_twenty_step_run_with_dynamic_sampling(running_fleet, fleet_ledger) -> None:
    run_id = running_fleet.create_run(fleet_ledger)
    assert running_fleet.drive(fleet_ledger, run_id) == "completed"
    with fleet_ledger.session() as session:
        facts = run_facts(session, run_id)
    assert_healthy_dynamic_sampling_run(facts, steps=20, n_prompts=N_PROMPTS, lookahead=1)
    # With the next step admitted ahead (max_lookahead_versions=1), filtered slots take groups
    # committed for the following step instead of waiting a generation.
    assert facts.borrowed_in > 0


@pytest.mark.parametrize(
    "sampler",
    [
        {"name": "ready_first"},
        {"name": "weight_fifo"},
        {"name": "windowed", "max_staleness_versions": 1, "freshest_first": True},
        {"name": "custom", "import_path": "tests.support.samplers:LatestFirst"},
    ],
    ids=lambda s: s["name"],
)
def test_every_sampler_with_dynamic_sampling(running_fleet, fleet_ledger, sampler) -> None:
    run_id = running_fleet.create_run(
        fleet_ledger, {"grpo": {"max_num_steps": 6}, "async_rl": {"sampler": sampler}}
    )
    assert running_fleet.drive(fleet_ledger, run_id) == "completed"
    with fleet_ledger.session() as session:
        facts = run_facts(session, run_id)
    assert_healthy_dynamic_sampling_run(facts, steps=6, n_prompts=N_PROMPTS, lookahead=1)


def test_a_budget_too_small_fails_with_the_spec_message(running_fleet, fleet_ledger) -> None:
    run_id = running_fleet.create_run(
        fleet_ledger,
        {
            "generation": {"sim": {"zero_variance_fraction": 0.85}},
            "grpo": {"dynamic_sampling_max_replacements_per_slot": 1, "max_num_steps": 50},
        },
    )
    assert running_fleet.drive(fleet_ledger, run_id) == "failed"
    with fleet_ledger.session() as session:
        facts = run_facts(session, run_id)
        exhausted = session.scalars(
            select(Slot).where(Slot.run_id == run_id, Slot.filtered == Slot.filter_budget + 1)
        ).all()
    error = facts.error or ""
    assert "dynamic_sampling_max_replacements_per_slot=1" in error
    assert "p**(budget+1) * num_prompts_per_step * max_num_steps" in error
    assert "p=0." in error
    # The ledger shows which slot exhausted it, and the message names that slot.
    assert len(exhausted) == 1
    slot = exhausted[0]
    assert f"step {slot.step}, index {slot.idx}" in error
    assert slot.filter_replacements == 1
    assert facts.violations == []
