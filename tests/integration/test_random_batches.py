"""Seeded random walks in which results arrive in batches, as the consumer records them: a
batch mixes commits, filtered groups, failures, extras, repeated copies of one result and
results redelivered after their attempt settled, with adaptive over-dispatch on, so extras fill
slots whose attempts finish in the same transaction. The ledger's invariants are checked after
every batch."""

from __future__ import annotations

import random

import pytest

from refill.models.payload import ResultMessage
from refill.models.results import Outcome
from tests.support.driver import FLAT, Driver
from tests.support.invariants import ledger_violations

CASES = [
    # (seed, sampler, lookahead, ledger)
    (11, {"name": "in_order"}, 1, "postgresql"),
    (12, {"name": "ready_first"}, 2, "postgresql"),
    (13, {"name": "in_order"}, 0, "sqlite"),
    (14, {"name": "weight_fifo"}, 1, "sqlite"),
]


def a_result(d: Driver, rng: random.Random, attempt_id: int, version: int) -> ResultMessage:
    roll = rng.random()
    if roll < 0.5:
        return d.result(attempt_id, [float(rng.random() < 0.5) for _ in range(3)] + [0.5], version)
    if roll < 0.85:
        return d.result(attempt_id, FLAT, version)
    kind = "infra" if roll < 0.95 else "data"
    return ResultMessage(
        run_id=d.run_id, attempt_id=attempt_id, worker=d.worker, weight_version=version, error_kind=kind, error=f"{kind} fault"
    )


def walk(d: Driver, rng: random.Random, max_ops: int) -> int:
    for op in range(max_ops):
        run = d.run()
        if run.status != "running":
            return op
        d.admit()
        head = d.step(run.weight_version) if run.weight_version < run.next_step else None
        if head is not None and head.status == "released" and rng.random() < 0.6:
            assert d.train(head.step)
        ready = [a for a in d.live() if a.min_weight_version <= run.weight_version]
        if not ready or rng.random() < 0.04:
            d.tick(61)
            d.reap()
            continue
        chosen = rng.sample(ready, min(len(ready), rng.randint(1, 12)))
        d.start_all([a.id for a in chosen])
        batch = []
        for attempt in chosen:
            batch.append(a_result(d, rng, attempt.id, rng.randint(attempt.min_weight_version, run.weight_version)))
            if rng.random() < 0.1:
                batch.append(batch[-1])  # delivered twice in one batch
        if rng.random() < 0.3:
            # a redelivered result of an attempt settled in an earlier batch
            done = [a for a in d.attempts() if a.state not in ("pending", "queued", "running")]
            if done:
                old = rng.choice(done)
                batch.append(d.result(old.id, FLAT, old.weight_version or 0))
        rng.shuffle(batch)
        outcomes = d.record(*batch).outcomes
        firsts = {}
        for recorded in outcomes:
            firsts.setdefault(recorded.attempt_id, recorded.outcome)
        assert all(o is not Outcome.UNKNOWN for o in firsts.values()), outcomes
        with d.ledger.session() as s:
            problems = ledger_violations(s, d.run_id)
        assert not problems, f"after batch {op} ({len(batch)} results): {problems}"
    return max_ops


@pytest.mark.parametrize(("seed", "sampler", "lookahead", "backend"), CASES)
def test_random_batches_keep_every_invariant(request, seed: int, sampler: dict, lookahead: int, backend: str) -> None:  # type: ignore[no-untyped-def]
    ledger = request.getfixturevalue("pg_ledger" if backend == "postgresql" else "sqlite_ledger")
    d = Driver(
        ledger,
        {
            "grpo": {"max_num_steps": 8, "num_prompts_per_step": 8, "dynamic_sampling_max_replacements_per_slot": 8},
            "async_rl": {
                "max_lookahead_versions": lookahead,
                "sampler": sampler,
                "over_dispatch": {"enabled": True, "safety_sigmas": 1.0, "max_extra_fraction": 1.0},
            },
            "rollout_failure": {
                "max_attempts_per_prompt": 3,
                "max_replacement_attempts": 3,
                "min_step_batch_fraction": 0.25,
                "max_consecutive_dropped_prompts": 50,
            },
        },
        num_prompts=120,
    )
    ops = walk(d, random.Random(seed), max_ops=300)
    run = d.run()
    assert ops < 300, f"run still {run.status} after 300 batches: it stalled"
    assert run.status in ("completed", "failed"), run.status
    if run.status == "completed":
        assert all(s.status == "trained" for s in d.steps())
    else:
        assert run.end_reason in ("budget_exhausted", "short_step"), run.error
