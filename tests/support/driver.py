"""Drive a run through the ledger API by hand, playing every role of the fleet (no Celery).

Integration tests use it to put the ledger into exact situations: which attempt finishes
first, with which rewards, at which (virtual) time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from refill.models.admission import admit_steps
from refill.models.db import Ledger
from refill.models.leases import Lease, expire_leases, start_attempt
from refill.models.outbox import Outgoing, claim_outbox, mark_sent
from refill.models.payload import Completion, ResultMessage
from refill.models.results import BatchResult, record_results
from refill.models.runs import PromptRow, create_run, publish_initial_weights, start_run
from refill.models.tables import Attempt, AttemptState, Run
from refill.models.training import claim_training, finish_training

BASE_CONFIG: dict[str, Any] = {
    "run": {"seed": 7},
    "data": {"shuffle": False},
    "generation": {"backend": "sim", "sim": {"vocab_size": 100}, "lease_seconds": 60, "queue_timeout_seconds": 600},
    "grpo": {
        "num_prompts_per_step": 4,
        "num_generations_per_prompt": 4,
        "max_num_steps": 3,
        "max_num_epochs": 1,
        "use_dynamic_sampling": True,
        "dynamic_sampling_max_replacements_per_slot": 3,
    },
    "async_rl": {"max_lookahead_versions": 1, "sampler": {"name": "in_order"}, "over_dispatch": {"enabled": False}},
    "rollout_failure": {
        "max_attempts_per_prompt": 2,
        "retry_backoff_seconds": 0.0,
        "on_dropped_prompt": "replace",
        "max_replacement_attempts": 1,
        "replacement_reserve_prompts": 4,
        "min_step_batch_fraction": 0.5,
        "max_consecutive_dropped_prompts": 5,
    },
}

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


class Driver:
    def __init__(self, ledger: Ledger, overrides: dict[str, Any] | None = None, num_prompts: int = 40, worker: str = "w1"):
        self.ledger = ledger
        self.config = merged(BASE_CONFIG, overrides or {})
        self.worker = worker
        self.now = T0

        def create(session):  # type: ignore[no-untyped-def]
            run = create_run(
                session,
                name="t",
                config=self.config,
                config_hash="test",
                prompts=[PromptRow(text=f"p{i}", row={"prompt": f"p{i}", "i": i}) for i in range(num_prompts)],
                data_fingerprint="test",
                output_dir="/tmp/refill-test-runs",
                now=self.now,
            )
            session.flush()
            publish_initial_weights(session, run.id, None, now=self.now)
            return run.id

        self.run_id: int = ledger.transaction(create)
        ledger.transaction(lambda s: start_run(s, self.run_id, "controller-1", now=self.now))

    # --- clock
    def tick(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now

    # --- roles
    def admit(self) -> list[int]:
        return self.ledger.transaction(lambda s: admit_steps(s, self.run_id, self.now)).steps

    def relay(self) -> list[Outgoing]:
        def go(session):  # type: ignore[no-untyped-def]
            sent = claim_outbox(session, claimer="relay", now=self.now)
            mark_sent(session, sent, self.now)
            return sent

        return self.ledger.transaction(go)

    def start(self, attempt_id: int, worker: str | None = None, engine_version: int | None = None) -> Lease | None:
        return self.ledger.transaction(
            lambda s: start_attempt(s, attempt_id, worker or self.worker, self.now, engine_version)
        )

    def result(self, attempt_id: int, rewards: list[float], version: int = 0, worker: str | None = None, **kw: Any) -> ResultMessage:
        n = len(rewards)
        return ResultMessage(
            run_id=self.run_id,
            attempt_id=attempt_id,
            worker=worker or self.worker,
            weight_version=version,
            prompt_token_ids=[5, 6, 7],
            completions=[Completion(token_ids=[8, 9], logprobs=[-0.5, -0.25], text="ok") for _ in range(n)],
            rewards=rewards,
            **kw,
        )

    def record(self, *results: ResultMessage) -> BatchResult:
        return self.ledger.transaction(lambda s: record_results(s, list(results), self.now))

    def finish(self, attempt_id: int, rewards: list[float], version: int | None = None) -> BatchResult:
        """Start (if needed) and finish one attempt with these rewards."""
        attempt = self.attempt(attempt_id)
        if attempt.state != AttemptState.RUNNING.value:
            assert self.start(attempt_id) is not None, f"attempt {attempt_id} could not start"
        v = self.run().weight_version if version is None else version
        return self.record(self.result(attempt_id, rewards, v))

    def reap(self):  # type: ignore[no-untyped-def]
        return self.ledger.transaction(lambda s: expire_leases(s, self.run_id, self.now))

    def train(self, step: int, trainer: str = "trainer-1") -> bool:
        batch = self.ledger.transaction(lambda s: claim_training(s, self.run_id, step, trainer, self.now))
        if batch is None:
            return False
        return self.ledger.transaction(
            lambda s: finish_training(s, self.run_id, step, trainer, None, {"loss": 0.5}, self.now)
        )

    # --- reading
    def run(self) -> Run:
        with self.ledger.session() as s:
            return s.get(Run, self.run_id)  # type: ignore[return-value]

    def attempt(self, attempt_id: int) -> Attempt:
        with self.ledger.session() as s:
            return s.get(Attempt, attempt_id)  # type: ignore[return-value]

    def live(self, step: int | None = None) -> list[Attempt]:
        from sqlalchemy import select

        with self.ledger.session() as s:
            q = select(Attempt).where(
                Attempt.run_id == self.run_id, Attempt.state.in_(["pending", "queued", "running"])
            )
            if step is not None:
                q = q.where(Attempt.step == step)
            return list(s.scalars(q.order_by(Attempt.id)))

    def query(self, fn: Callable[[Any], Any]) -> Any:
        with self.ledger.session() as s:
            return fn(s)
