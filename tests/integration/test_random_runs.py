"""Seeded random walks of a whole run: a fleet that commits, filters, fails, loses leases and
trains in random order, with every sampler and both drop policies, on a data set small enough
to end. The ledger's invariants are checked after every operation, and the run must end
completed or failed for a reason SPEC §3 gives."""

from __future__ import annotations

import random

import pytest

from refill.models.results import Outcome
from tests.support.driver import FLAT, Driver
from tests.support.invariants import ledger_violations

CASES = [
    # (seed, sampler, lookahead, on_dropped_prompt, ledger): each walk runs on one ledger (an
    # invariant check after every operation makes them the costliest tests), both are covered
    (1, {"name": "in_order"}, 1, "replace", "postgresql"),
    (2, {"name": "in_order"}, 2, "shrink", "sqlite"),
    (3, {"name": "ready_first"}, 1, "replace", "sqlite"),
    (4, {"name": "weight_fifo"}, 2, "replace", "postgresql"),
    (5, {"name": "windowed", "max_staleness_versions": 0}, 1, "shrink", "postgresql"),
    (6, {"name": "windowed", "max_staleness_versions": 1, "freshest_first": True}, 2, "replace", "sqlite"),
]


def walk(d: Driver, rng: random.Random, max_ops: int) -> int:
    """Random fleet behaviour until the run ends; the number of operations done."""
    for op in range(max_ops):
        run = d.run()
        if run.status != "running":
            return op
        d.admit()
        head = d.step(run.weight_version) if run.weight_version < run.next_step else None
        if head is not None and head.status == "released" and rng.random() < 0.5:
            assert d.train(head.step)
        # a worker waits for the weights an attempt needs: only those it can run now
        live = [a for a in d.live() if a.slot_idx is not None and a.min_weight_version <= run.weight_version]
        roll = rng.random()
        if not live or roll < 0.06:
            d.tick(61)
            d.reap()
        elif roll < 0.08:
            d.stop()
            d.resume()
        elif roll < 0.11:
            # a redelivered or late result of an attempt that is no longer in flight
            done = [a for a in d.attempts() if a.state not in ("pending", "queued", "running")]
            if done:
                old = rng.choice(done)
                outcome = d.record(d.result(old.id, [0.0, 1.0, 0.0, 1.0], old.weight_version or 0)).outcomes[0]
                assert outcome.outcome in (Outcome.DUPLICATE, Outcome.LATE), (old.state, outcome)
        else:
            attempt = rng.choice(live)
            lease = d.start(attempt.id) if attempt.state != "running" else None
            floor = lease.min_weight_version if lease is not None else attempt.min_weight_version
            version = rng.randint(floor, run.weight_version)
            action = rng.random()
            if action < 0.55:
                rewards = [float(rng.random() < 0.5) for _ in range(3)] + [0.5]
                outcome = d.record(d.result(attempt.id, rewards, version)).outcomes[0]
                assert outcome.outcome in (Outcome.COMMITTED, Outcome.FAILED)
            elif action < 0.80:
                outcome = d.record(d.result(attempt.id, FLAT, version)).outcomes[0]
                filtering = d.config["grpo"]["use_dynamic_sampling"]
                assert outcome.outcome in ((Outcome.FILTERED,) if filtering else (Outcome.COMMITTED, Outcome.FAILED))
            elif action < 0.92:
                d.fail(attempt.id, "infra", "worker lost")
            elif action < 0.96:
                d.fail(attempt.id, "data", "reward function raised")
            # else: it runs on, and may lose its lease at the next reap
        with d.ledger.session() as s:
            problems = ledger_violations(s, d.run_id)
        assert not problems, f"after operation {op}: {problems}"
    return max_ops


@pytest.mark.parametrize(("seed", "sampler", "lookahead", "on_dropped", "backend"), CASES)
def test_random_run_keeps_every_invariant(request, seed: int, sampler: dict, lookahead: int, on_dropped: str, backend: str) -> None:  # type: ignore[no-untyped-def]
    ledger = request.getfixturevalue("pg_ledger" if backend == "postgresql" else "sqlite_ledger")
    d = Driver(
        ledger,
        {
            "grpo": {"max_num_steps": 8, "dynamic_sampling_max_replacements_per_slot": 6},
            "async_rl": {"max_lookahead_versions": lookahead, "sampler": sampler},
            "rollout_failure": {
                "on_dropped_prompt": on_dropped,
                "max_replacement_attempts": 2,
                "min_step_batch_fraction": 0.25,
                "max_consecutive_dropped_prompts": 50,
            },
        },
        num_prompts=28,
    )
    ops = walk(d, random.Random(seed), max_ops=400)
    run = d.run()
    assert ops < 400, f"run still {run.status} after 400 operations: it stalled"
    assert run.status in ("completed", "failed"), run.status
    if run.status == "completed":
        assert run.end_reason in ("end_of_data", "max_num_steps")
        assert all(s.status == "trained" for s in d.steps())
        assert run.weight_version == len(d.steps())
    else:
        assert run.end_reason in ("budget_exhausted", "short_step"), run.error
