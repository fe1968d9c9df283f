"""The demo's real model on the fleet: `hf` generation workers and the torch trainer as
separate `celery worker` processes on Redis and PostgreSQL; every weight version the trainer
publishes is loaded by the generators before the groups that need it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from sqlalchemy import func, select

from refill.models.rollout_codec import decode, unpack_payload
from refill.models.tables import Attempt, Group, Run, WeightVersion
from tests.acceptance.runs import run_facts

MODEL_RUN = {
    "data": {"builtin": "arith", "builtin_size": 600},
    "model": {"name_or_path": "builtin:tiny-arith", "warm_start": {"enabled": True}},
    "generation": {"backend": "hf", "max_new_tokens": 4, "groups_in_flight": 8, "lease_seconds": 120},
    "reward": {"function": "refill.rewards.arith:exact_match"},
    "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 8, "max_num_steps": 4},
    "optimizer": {"lr": 5.0e-4},
    "infra": {"trainer": "torch"},
}


@pytest.mark.slow
def test_the_demo_model_trains_on_the_fleet(running_fleet, fleet_ledger) -> None:
    run_id = running_fleet.create_run(fleet_ledger, MODEL_RUN)
    assert running_fleet.drive(fleet_ledger, run_id, timeout=600) == "completed"
    with fleet_ledger.session() as session:
        facts = run_facts(session, run_id)
        versions = session.execute(
            select(WeightVersion.version, WeightVersion.path).where(WeightVersion.run_id == run_id).order_by(WeightVersion.version)
        ).all()
        used = session.execute(
            select(Attempt.step, func.max(Attempt.weight_version)).where(Attempt.run_id == run_id).group_by(Attempt.step)
        ).all()
        trained = session.execute(
            select(Group.rollout, Group.completion_texts, Group.payload_ref).where(
                Group.run_id == run_id, Group.trained_step.is_not(None)
            )
        ).all()
        run_dir = session.get(Run, run_id).run_dir
    assert facts.status == "completed" and facts.violations == []
    assert facts.trained_per_step == [8] * 4
    assert [v for v, _ in versions] == [0, 1, 2, 3, 4]
    assert all(path and (Path(path) / "model.safetensors").exists() for _, path in versions)
    # Generators moved to newer weights as the trainer published them.
    assert max(v for _, v in used if v is not None) >= 2
    # Real completions with sampling log-probs reached the trainer.
    completions = [
        c
        for g in trained
        for c in (
            decode(g.rollout, g.completion_texts)
            if g.payload_ref is None
            else unpack_payload(Path(run_dir, "payloads", g.payload_ref).read_bytes())
        )[1]
    ]
    assert len(completions) == 4 * 8 * 8 and all(len(c.token_ids) == len(c.logprobs) >= 1 for c in completions)
    assert all(math.isfinite(p) and p <= 1e-3 for c in completions for p in c.logprobs)
