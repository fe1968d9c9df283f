"""Drive a run through the ledger API by hand, playing every role of the fleet (no Celery).

Integration tests use it to put the ledger into exact situations: which attempt finishes
first, with which rewards, at which (virtual) time. Every `Driver` created during a test is
remembered in `DRIVERS`, so that the integration suite can check the ledger's invariants of
each run after the test (`tests/integration/conftest.py`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import undefer

from refill.models.admission import admit_steps
from refill.models.db import Ledger
from refill.models.leases import Lease, Reaped, expire_leases, extend_lease, start_attempt
from refill.models.outbox import Outgoing, ToSend, claim_outbox, mark_sent
from refill.models.payload import Completion, ResultMessage
from refill.models.results import BatchResult, Outcome, Recorded, record_results
from refill.models.runs import (
    PromptRow,
    create_run,
    publish_initial_weights,
    request_stop,
    start_run,
    stop_run,
)
from refill.models.tables import (
    Attempt,
    AttemptState,
    Base,
    Group,
    Outbox,
    Prompt,
    RejectedResult,
    Run,
    Slot,
    SlotStatus,
    SparePrompt,
    Step,
    StepMetrics,
    WeightVersion,
)
from refill.models.training import TrainBatch, claim_training, finish_training

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
    "infra": {"trainer_lease_seconds": 300},
}

T0 = datetime(2026, 1, 1, tzinfo=UTC)

#: rewards with spread (mean 0.5): the group commits
SPREAD = [0.0, 1.0, 0.0, 1.0]
#: all-equal rewards (mean 1.0): a zero-variance group, filtered under dynamic sampling
FLAT = [1.0, 1.0, 1.0, 1.0]

#: Drivers created in the current test (cleared by the integration conftest).
DRIVERS: list[Driver] = []
#: The run directories Drivers made that are not removed yet: each test's go when it ends
#: (tests/conftest.py), in whichever suite it runs.
OUTPUT_DIRS: list[str] = []


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def config_hash(config: dict[str, Any]) -> str:
    # The ledger caches a run's settings by (run id, config hash); run ids restart in every
    # test database, so the hash must really be one of the config.
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


class Driver:
    def __init__(
        self,
        ledger: Ledger,
        overrides: dict[str, Any] | None = None,
        num_prompts: int = 40,
        worker: str = "w1",
        *,
        start: bool = True,
        check: bool = True,
    ):
        self.ledger = ledger
        self.config = merged(BASE_CONFIG, overrides or {})
        self.worker = worker
        self.now = T0
        #: check the ledger invariants of this run after the test
        self.check = check
        #: the run's directory parent (claim-check payloads land under it): one per driver, since
        #: every SQLite ledger's first run is run 1 and tests run side by side under `-n`
        self.output_dir = tempfile.mkdtemp(prefix="refill-test-runs-")
        OUTPUT_DIRS.append(self.output_dir)

        def create(session):  # type: ignore[no-untyped-def]
            run = create_run(
                session,
                name="t",
                config=self.config,
                config_hash=config_hash(self.config),
                prompts=[PromptRow(text=f"p{i}", row={"prompt": f"p{i}", "i": i}) for i in range(num_prompts)],
                data_fingerprint="test",
                output_dir=self.output_dir,
                now=self.now,
            )
            session.flush()
            publish_initial_weights(session, run.id, None, now=self.now)
            return run.id

        self.run_id: int = ledger.transaction(create)
        DRIVERS.append(self)
        if start:
            ledger.transaction(lambda s: start_run(s, self.run_id, "controller-1", now=self.now))

    # --- clock
    def tick(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now

    # --- roles
    def admit(self) -> list[int]:
        return self.ledger.transaction(lambda s: admit_steps(s, self.run_id, self.now)).steps

    def relay(
        self, *, claim_seconds: float = 30.0, send: bool = True, only: ToSend | None = None
    ) -> list[Outgoing]:
        """Claim due messages (only those `only` names, when given) and (unless `send` is
        False: the relay died before marking them) mark them sent."""

        def go(session):  # type: ignore[no-untyped-def]
            sent = claim_outbox(session, claimer="relay", now=self.now, claim_seconds=claim_seconds, only=only)
            if send:
                mark_sent(session, sent, self.now)
            return sent

        return self.ledger.transaction(go)

    def start(self, attempt_id: int, worker: str | None = None, engine_version: int | None = None) -> Lease | None:
        return self.ledger.transaction(
            lambda s: start_attempt(s, attempt_id, worker or self.worker, self.now, engine_version)
        )

    def heartbeat(self, attempt_id: int, worker: str | None = None, seconds: float = 60.0) -> bool:
        return self.ledger.transaction(
            lambda s: extend_lease(s, attempt_id, worker or self.worker, seconds, self.now)
        )

    def result(self, attempt_id: int, rewards: list[float], version: int | None = 0, worker: str | None = None, **kw: Any) -> ResultMessage:
        n = len(rewards)
        kw.setdefault("prompt_token_ids", [5, 6, 7])
        kw.setdefault(
            "completions",
            [Completion(token_ids=[8, 9], logprobs=[-0.5, -0.25], text="ok") for _ in range(n)],
        )
        return ResultMessage(
            run_id=self.run_id,
            attempt_id=attempt_id,
            worker=worker or self.worker,
            weight_version=version,
            rewards=rewards,
            **kw,
        )

    def record(self, *results: ResultMessage) -> BatchResult:
        return self.ledger.transaction(lambda s: record_results(s, list(results), self.now))

    def start_all(self, attempt_ids: list[int], worker: str | None = None) -> None:
        """Take the lease of each attempt (that is not running yet), in one transaction."""

        def go(session):  # type: ignore[no-untyped-def]
            for attempt_id in attempt_ids:
                if session.get(Attempt, attempt_id).state != AttemptState.RUNNING.value:
                    lease = start_attempt(session, attempt_id, worker or self.worker, self.now)
                    assert lease is not None, f"attempt {attempt_id} could not start"

        self.ledger.transaction(go)

    def _started(self, attempt_id: int) -> int:
        """Start the attempt if it is not running; the run's weight version."""

        def go(session):  # type: ignore[no-untyped-def]
            if session.get(Attempt, attempt_id).state != AttemptState.RUNNING.value:
                lease = start_attempt(session, attempt_id, self.worker, self.now)
                assert lease is not None, f"attempt {attempt_id} could not start"
            return session.get(Run, self.run_id).weight_version

        return self.ledger.transaction(go)

    def finish(self, attempt_id: int, rewards: list[float], version: int | None = None) -> BatchResult:
        """Start (if needed) and finish one attempt with these rewards."""
        current = self._started(attempt_id)
        return self.record(self.result(attempt_id, rewards, current if version is None else version))

    def finish_one(self, attempt_id: int, rewards: list[float], version: int | None = None) -> Recorded:
        (outcome,) = self.finish(attempt_id, rewards, version).outcomes
        return outcome

    def fail(self, attempt_id: int, kind: str = "infra", error: str = "engine crashed") -> Recorded:
        """Start (if needed) and report a failed generation."""
        self._started(attempt_id)
        (outcome,) = self.record(
            ResultMessage(
                run_id=self.run_id,
                attempt_id=attempt_id,
                worker=self.worker,
                weight_version=self.run().weight_version,
                error_kind=kind,
                error=error,
            )
        ).outcomes
        return outcome

    def commit_slot(self, step: int, idx: int, rewards: list[float] = SPREAD, version: int | None = None) -> Recorded:
        """Finish the live attempt aimed at (step, idx) with these rewards."""
        return self.finish_one(self.live_of(step, idx).id, rewards, version)

    def filter_slot(self, step: int, idx: int, rewards: list[float] = FLAT) -> Recorded:
        return self.finish_one(self.live_of(step, idx).id, rewards)

    def fill_step(self, step: int, rewards: list[float] = SPREAD) -> None:
        """Commit every live attempt aimed at an open slot of `step` (generated with the run's
        current weights), in attempt order and one batch, until none is left."""
        for _ in range(100):
            live = [a.id for a in self.live(step) if a.slot_idx is not None]
            if not live:
                return
            self.start_all(live)
            version = self.run().weight_version
            outcomes = self.record(*(self.result(a, rewards, version) for a in live)).outcomes
            assert all(o.outcome is Outcome.COMMITTED for o in outcomes), outcomes
        raise AssertionError(f"step {step} did not settle")

    def reap(self) -> Reaped:
        return self.ledger.transaction(lambda s: expire_leases(s, self.run_id, self.now))

    def claim(self, step: int, trainer: str = "trainer-1") -> TrainBatch | None:
        return self.ledger.transaction(lambda s: claim_training(s, self.run_id, step, trainer, self.now))

    def finish_training(self, step: int, trainer: str = "trainer-1", metrics: dict[str, float] | None = None) -> bool:
        """True when this trainer's step was accepted (a new weight version published)."""
        done = self.ledger.transaction(
            lambda s: finish_training(
                s, self.run_id, step, trainer, None, metrics or {"loss": 0.5}, self.now
            )
        )
        # finish_training returns what it left to send (None when the trainer lost the
        # step); older versions returned a bool.
        return done if isinstance(done, bool) else done is not None

    def train(self, step: int, trainer: str = "trainer-1") -> bool:
        if self.claim(step, trainer) is None:
            return False
        return self.finish_training(step, trainer)

    def stop(self) -> int:
        self.ledger.transaction(lambda s: request_stop(s, self.run_id))
        return self.ledger.transaction(lambda s: stop_run(s, self.run_id, self.now))

    def resume(self, controller: str = "controller-1") -> Run:
        return self.ledger.transaction(lambda s: start_run(s, self.run_id, controller, now=self.now))

    # --- reading
    def run(self) -> Run:
        with self.ledger.session() as s:
            return s.get(Run, self.run_id)  # type: ignore[return-value]

    def attempt(self, attempt_id: int) -> Attempt:
        with self.ledger.session() as s:
            return s.get(Attempt, attempt_id)  # type: ignore[return-value]

    def live(self, step: int | None = None) -> list[Attempt]:
        with self.ledger.session() as s:
            q = select(Attempt).where(
                Attempt.run_id == self.run_id, Attempt.state.in_(["pending", "queued", "running"])
            )
            if step is not None:
                q = q.where(Attempt.step == step)
            return list(s.scalars(q.order_by(Attempt.id)))

    def live_of(self, step: int, idx: int) -> Attempt:
        """The one live attempt aimed at slot (step, idx)."""
        found = [a for a in self.live(step) if a.slot_idx == idx]
        assert len(found) == 1, f"slot ({step}, {idx}) has {len(found)} live attempts"
        return found[0]

    def attempts(self, step: int | None = None, idx: int | None = None, state: str | None = None) -> list[Attempt]:
        """Attempts aimed now at (step, idx), oldest first."""
        with self.ledger.session() as s:
            q = select(Attempt).where(Attempt.run_id == self.run_id)
            if step is not None:
                q = q.where(Attempt.step == step)
            if idx is not None:
                q = q.where(Attempt.slot_idx == idx)
            if state is not None:
                q = q.where(Attempt.state == state)
            return list(s.scalars(q.order_by(Attempt.id)))

    def slot(self, step: int, idx: int) -> Slot:
        with self.ledger.session() as s:
            row = s.get(Slot, (self.run_id, step, idx))
            assert row is not None, f"no slot ({step}, {idx})"
            return row

    def slots(self, step: int) -> list[Slot]:
        with self.ledger.session() as s:
            return list(s.scalars(select(Slot).where(Slot.run_id == self.run_id, Slot.step == step).order_by(Slot.idx)))

    def step(self, step: int) -> Step:
        with self.ledger.session() as s:
            row = s.get(Step, (self.run_id, step))
            assert row is not None, f"no step {step}"
            return row

    def steps(self) -> list[Step]:
        with self.ledger.session() as s:
            return list(s.scalars(select(Step).where(Step.run_id == self.run_id).order_by(Step.step)))

    def group(self, attempt_id: int) -> Group | None:
        with self.ledger.session() as s:
            # The payload columns are deferred; a test reads them after the session closes.
            return s.get(Group, attempt_id, options=[undefer("*")])

    def groups(self) -> list[Group]:
        with self.ledger.session() as s:
            return list(
                s.scalars(select(Group).where(Group.run_id == self.run_id).order_by(Group.attempt_id).options(undefer("*")))
            )

    def outbox(self, kind: str | None = None) -> list[Outbox]:
        with self.ledger.session() as s:
            q = select(Outbox).where(Outbox.run_id == self.run_id)
            if kind is not None:
                q = q.where(Outbox.kind == kind)
            return list(s.scalars(q.order_by(Outbox.id)))

    def rejected(self, run_id: int | None = None) -> list[RejectedResult]:
        """Refused results of this run (or of `run_id`: an unknown run's are kept under it)."""
        with self.ledger.session() as s:
            return list(
                s.scalars(
                    select(RejectedResult)
                    .where(RejectedResult.run_id == (self.run_id if run_id is None else run_id))
                    .order_by(RejectedResult.id)
                )
            )

    def spare_pool(self) -> list[int]:
        """Positions (in the data set) of the prompts waiting in the spare pool, oldest first."""
        with self.ledger.session() as s:
            return list(
                s.scalars(
                    select(Prompt.position)
                    .join(SparePrompt, SparePrompt.prompt_id == Prompt.id)
                    .where(SparePrompt.run_id == self.run_id, SparePrompt.taken_at.is_(None))
                    .order_by(SparePrompt.id)
                )
            )

    def position(self, prompt_id: int) -> int:
        """A prompt's row index in the data set (prompt ids are not stable across ledgers)."""
        with self.ledger.session() as s:
            return s.scalar(select(Prompt.position).where(Prompt.id == prompt_id))  # type: ignore[return-value]

    def metrics(self, step: int) -> StepMetrics:
        with self.ledger.session() as s:
            row = s.get(StepMetrics, (self.run_id, step))
            assert row is not None, f"step {step} has no metrics"
            return row

    def weight_versions(self) -> list[WeightVersion]:
        with self.ledger.session() as s:
            return list(
                s.scalars(select(WeightVersion).where(WeightVersion.run_id == self.run_id).order_by(WeightVersion.version))
            )

    def layout(self, step: int) -> list[tuple[str, int | None]]:
        """(status, data-set position of the trained group's prompt) of each slot of a step."""
        with self.ledger.session() as s:
            rows = s.execute(
                select(Slot.status, Prompt.position)
                .outerjoin(Group, Group.attempt_id == Slot.group_attempt_id)
                .outerjoin(Prompt, Prompt.id == Group.prompt_id)
                .where(Slot.run_id == self.run_id, Slot.step == step)
                .order_by(Slot.idx)
            ).all()
            return [(status, pos) for status, pos in rows]

    def slot_prompts(self, step: int) -> list[int]:
        """Data-set positions of the prompts each slot of a step was admitted with."""
        with self.ledger.session() as s:
            return list(
                s.scalars(
                    select(Prompt.position)
                    .join(Slot, Slot.prompt_id == Prompt.id)
                    .where(Slot.run_id == self.run_id, Slot.step == step)
                    .order_by(Slot.idx)
                )
            )

    def counts(self) -> dict[str, int]:
        """Row counts of every table (a cheap fingerprint of 'nothing else changed')."""
        with self.ledger.session() as s:
            return {
                t.name: int(s.scalar(select(func.count()).select_from(t)) or 0)
                for t in Base.metadata.sorted_tables
            }

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table but rejected_results: what 'nothing else changes' compares."""
        with self.ledger.session() as s:
            out = {}
            for t in Base.metadata.sorted_tables:
                if t.name == "rejected_results":
                    continue
                out[t.name] = sorted(
                    tuple(repr(v) for v in row) for row in s.execute(select(t)).all()
                )
            return out

    def query(self, fn: Callable[[Any], Any]) -> Any:
        with self.ledger.session() as s:
            return fn(s)

    def committed_slots(self, step: int) -> int:
        return sum(1 for sl in self.slots(step) if sl.status == SlotStatus.COMMITTED.value)
