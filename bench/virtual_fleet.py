"""The `refill` strategy of the fill-time benchmark: the production ledger driven in virtual time.

Nothing of the scheduling is re-implemented here. A `VirtualFleet` plays the roles of the fleet
against a real ledger (SQLite in memory by default; any SQLAlchemy URL works) through the same
ledger operations the Celery tasks call:

- controller: `admit_steps` at start, `claim_outbox` + `mark_sent` after every operation that
  made attempts or train_step rows (the relay), `expire_leases` every `reap_every` virtual seconds;
- generation workers: `W` workers with `C` groups in flight each, one FIFO of relayed
  `generate` messages; a worker takes the lease (`start_attempts`, with the weight version its
  engine holds: the newest published one; the handshakes of one moment in one statement, as a
  worker's lease batcher sends them), runs the `sim` engine in virtual mode (it reports
  the latency it drew instead of sleeping), scores the group with the run's reward function,
  and its result arrives at `start + latency`;
- results consumer: the results that arrive within `batch_window` seconds of the first one
  (at most `batch_max`, the consumer's defaults) are recorded in one `record_results` call at
  the end of the window; over-dispatch (`top_up`), borrowing and the barrier run inside it;
- trainer: a relayed `train_step` is claimed (`claim_training`) and finished
  (`finish_training`, which publishes the next weight version and admits what it unlocks)
  `train_seconds` later.

The clock is a float of virtual seconds; the ledger sees it as `T0 + seconds`. Work the
ledger does is real (and is what the benchmark's wall time measures); latency costs nothing.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from refill.models.admission import admit_steps
from refill.models.db import Ledger
from refill.models.leases import Lease, expire_leases, start_attempts
from refill.models.outbox import claim_outbox, mark_sent
from refill.models.payload import GenerateMessage, ResultMessage
from refill.models.results import record_results
from refill.models.runs import PromptRow, create_run, publish_initial_weights, start_run
from refill.models.tables import Attempt, Base, Group, Run, RunStatus, Step
from refill.models.training import claim_training, finish_training
from refill.rewards.scoring import score_group
from refill.rewards.sim import solved
from refill.tasks.backends.sim import Latency, SimEngine

T = TypeVar("T")

T0 = datetime(2026, 1, 1, tzinfo=UTC)
#: leases taken in one statement at most (a generation worker's lease batcher, tasks/generation.py)
LEASE_BATCH = 64


@dataclass(frozen=True)
class Scenario:
    """What is simulated: the same for every strategy of one comparison."""

    prompts_per_step: int = 256
    generations: int = 16
    p: float = 0.33
    latency: Latency = field(default_factory=lambda: Latency("lognormal", 1.0, 0.5))
    workers: int = 8
    in_flight: int = 64
    steps: int = 10
    seed: int = 0
    train_seconds: float = 0.1
    max_lookahead_versions: int = 1

    @property
    def capacity(self) -> int:
        return self.workers * self.in_flight

    def bound(self) -> float:
        """Issue 7: one generation latency, or the fleet's throughput limit if larger."""
        mean = self.latency.mean_seconds
        return max(mean, self.prompts_per_step / ((1.0 - self.p) * self.capacity) * mean)

    def prompt_text(self, position: int) -> str:
        # The sim engine keys a prompt's solve rate on its text: every strategy that draws the
        # prompt at `position` sees the same difficulty.
        return f"bench prompt {position}"

    def num_prompts(self) -> int:
        # Enough prompts that no strategy cycles the data within a run (extras included).
        return int(self.prompts_per_step * (self.steps + 4) * 4 / max(0.05, 1.0 - self.p)) + 1

    def attempt_seed(self, attempt_no: int) -> int:
        """The engine seed of the `attempt_no`-th attempt (1-based): the rule of the outbox
        (`refill.models.outbox`), so the k-th dispatch of every strategy draws the same
        latency and completions for the same prompt."""
        return (self.seed * 1_000_003 + attempt_no) % 2**31

    def engine(self) -> SimEngine:
        return SimEngine(
            seed=self.seed,
            zero_variance_fraction=self.p,
            latency=self.latency,
            tokens_per_completion=2,
            vocab_size=100,
            virtual=True,
        )


@dataclass(frozen=True)
class RefillPolicy:
    """The knobs of the production path under test (async_rl.*)."""

    name: str = "refill"
    max_lookahead_versions: int | None = None  # None: the scenario's
    sampler: str = "in_order"
    over_dispatch: bool = True
    safety_sigmas: float = 2.0
    max_extra_fraction: float = 1.0
    tail_fraction: float = 0.01

    def label(self, scenario: Scenario) -> str:
        la = self.lookahead(scenario)
        od = (
            f"od σ={self.safety_sigmas:g} cap={self.max_extra_fraction:g} tail={self.tail_fraction:g}"
            if self.over_dispatch
            else "no od"
        )
        return f"{self.name} (lookahead {la}, {self.sampler}, {od})"

    def lookahead(self, scenario: Scenario) -> int:
        return scenario.max_lookahead_versions if self.max_lookahead_versions is None else self.max_lookahead_versions


def run_config(scenario: Scenario, policy: RefillPolicy) -> dict[str, Any]:
    lat = scenario.latency
    return {
        "run": {"seed": scenario.seed},
        "data": {"shuffle": True},
        "generation": {
            "backend": "sim",
            "max_new_tokens": 2,
            "lease_seconds": 3600,
            "queue_timeout_seconds": 36000,
            "sim": {
                "zero_variance_fraction": scenario.p,
                "latency": {"distribution": lat.distribution, "mean_seconds": lat.mean_seconds, "sigma": lat.sigma},
                "virtual": True,
                "tokens_per_completion": 2,
                "vocab_size": 100,
            },
        },
        "reward": {"function": "refill.rewards.sim:solved"},
        "grpo": {
            "num_prompts_per_step": scenario.prompts_per_step,
            "num_generations_per_prompt": scenario.generations,
            "max_num_steps": scenario.steps,
            "max_num_epochs": None,
            "use_dynamic_sampling": True,
            "dynamic_sampling_max_replacements_per_slot": 64,
        },
        "async_rl": {
            "max_lookahead_versions": policy.lookahead(scenario),
            "sampler": {"name": policy.sampler},
            "over_dispatch": {
                "enabled": policy.over_dispatch,
                "safety_sigmas": policy.safety_sigmas,
                "max_extra_fraction": policy.max_extra_fraction,
                "tail_fraction": policy.tail_fraction,
            },
        },
        "rollout_failure": {"replacement_reserve_prompts": scenario.prompts_per_step},
        "infra": {"trainer_lease_seconds": 36000},
    }


@dataclass
class AttemptRecord:
    """What the benchmark reads back of one finished generation (any strategy)."""

    zero_variance: bool
    weight_version: int
    trained_step: int | None
    started: float
    finished: float


@dataclass
class StepRecord:
    step: int
    admitted: float
    released: float
    trained: float | None


@dataclass
class Trace:
    """One run of one strategy: enough to compute every figure of the benchmark."""

    strategy: str
    steps: list[StepRecord]
    finished: list[AttemptRecord]
    lookahead: int
    dispatched: int = 0
    #: ledger profile (wall seconds and calls per operation); empty for the simulations
    profile: dict[str, list[float]] = field(default_factory=dict)
    wall_seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


class VirtualFleet:
    """Drives one run of the production ledger in virtual time; see the module docstring."""

    def __init__(
        self,
        scenario: Scenario,
        policy: RefillPolicy | None = None,
        *,
        ledger_url: str = "sqlite://",
        batch_window: float = 0.02,
        batch_max: int = 64,
        reap_every: float = 30.0,
        max_virtual_seconds: float = 1e6,
    ) -> None:
        self.scenario = scenario
        self.policy = policy or RefillPolicy()
        self.batch_window = batch_window
        self.batch_max = batch_max
        self.reap_every = reap_every
        self.max_virtual_seconds = max_virtual_seconds
        self.ledger = Ledger(ledger_url)
        if self.ledger.dialect == "sqlite":
            Base.metadata.create_all(self.ledger.engine)
        self.engine = scenario.engine()
        self.now = 0.0
        self.version = 0
        self.free = scenario.capacity
        self.queue: deque[GenerateMessage] = deque()
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.inbox: list[ResultMessage] = []
        self.consume_at: float | None = None
        self.started_at: dict[int, float] = {}
        self.starting: list[tuple[GenerateMessage, float, int]] = []
        self.skipped: set[int] = set()
        self.dispatched = 0
        self.profile: dict[str, list[float]] = {}
        self.config = run_config(scenario, self.policy)
        self.run_id = self._create()

    # --- plumbing ------------------------------------------------------------------------

    def at(self, seconds: float | None = None) -> datetime:
        return T0 + timedelta(seconds=self.now if seconds is None else seconds)

    def tx(self, what: str, fn: Callable[[Session], T]) -> T:
        self.flush_starts()
        began = time.perf_counter()
        try:
            return self.ledger.transaction(fn, what=what)
        finally:
            entry = self.profile.setdefault(what, [0.0, 0])
            entry[0] += time.perf_counter() - began
            entry[1] += 1

    def schedule(self, when: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def _create(self) -> int:
        scenario, config = self.scenario, self.config
        prompts = [
            PromptRow(text=scenario.prompt_text(i), row={"i": i}) for i in range(scenario.num_prompts())
        ]
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()

        def create(session: Session) -> int:
            run = create_run(
                session,
                name="bench-fill",
                config=config,
                config_hash=digest,
                prompts=prompts,
                data_fingerprint="bench",
                output_dir="/tmp/refill-bench",
                now=self.at(),
            )
            session.flush()
            publish_initial_weights(session, run.id, None, now=self.at())
            return run.id

        run_id = self.tx("create_run", create)
        self.tx("start_run", lambda s: start_run(s, run_id, "bench-controller", now=self.at()))
        return run_id

    # --- roles ---------------------------------------------------------------------------

    def relay(self) -> None:
        """The relay: every due message of the run, marked sent in the transaction that read it (as the
        fleet's relay does: no claim written first), then delivered."""

        def go(session: Session) -> list:
            sent = claim_outbox(
                session, claimer="bench-relay", now=self.at(), limit=100_000, run_id=self.run_id, claim_seconds=None
            )
            mark_sent(session, sent, self.at())
            return sent

        for message in self.tx("relay", go):
            if message.queue == "generate":
                self.queue.append(GenerateMessage.from_json(message.body))
                self.dispatched += 1
            else:
                self.schedule(self.now, "train", int(message.body["step"]))
        self.start_workers()

    def start_workers(self) -> None:
        """Free worker slots take queued messages in FIFO order.

        A worker takes the lease (`start_attempts`) the moment it starts; the benchmark
        applies the leases taken since the last ledger operation in one transaction right
        before the next one (`flush_starts`), each with its own time, so the ledger sees them
        in the same order and at the same times as if each had been its own transaction."""
        while self.free and self.queue:
            message = self.queue.popleft()
            self.free -= 1
            result, latency = self.generate(message, self.version)
            self.started_at[message.attempt_id] = self.now
            self.starting.append((message, self.now, self.version))
            self.schedule(self.now + latency, "done", result)

    def flush_starts(self) -> None:
        if not self.starting:
            return
        batch, self.starting = self.starting, []
        lease_seconds = float(self.config["generation"]["lease_seconds"])
        # As a generation worker takes them (`GenerationService._take_leases`): the handshakes
        # waiting at one moment go out as one `start_attempts` statement (at most
        # LEASE_BATCH), here those started at the same virtual time with the same weights.
        chunks: list[list[tuple[GenerateMessage, float, int]]] = []
        for item in batch:
            last = chunks[-1] if chunks else None
            if last is not None and len(last) < LEASE_BATCH and last[0][1:] == item[1:]:
                last.append(item)
            else:
                chunks.append([item])

        def go(session: Session) -> dict[int, Lease]:
            taken: dict[int, Lease] = {}
            for chunk in chunks:
                _, when, version = chunk[0]
                ids = [m.attempt_id for m, _, _ in chunk]
                taken.update(
                    start_attempts(session, self.run_id, ids, "bench-worker", lease_seconds, self.at(when), version)
                )
            return taken

        began = time.perf_counter()
        leases = self.ledger.transaction(go, what="start_attempt")
        entry = self.profile.setdefault("start_attempt", [0.0, 0])
        entry[0] += time.perf_counter() - began
        entry[1] += len(batch)
        for message, _, version in batch:
            lease = leases.get(message.attempt_id)
            if lease is None:
                # Cancelled or settled before a worker took it: the worker skips it. (Only
                # happens when the run ends.)
                self.skipped.add(message.attempt_id)
                continue
            if lease.min_weight_version > version:
                raise AssertionError(
                    f"attempt {message.attempt_id} needs weights v{lease.min_weight_version}, "
                    f"the worker holds v{version}"
                )

    def generate(self, message: GenerateMessage, version: int) -> tuple[ResultMessage, float]:
        """What `GenerationService._generate` does, on the sim engine in virtual mode."""
        if self.engine.weight_version != version:
            # As a worker's engine does (engine_batching): new weights when a version is
            # published, not per attempt (the sim engine records each load it is given).
            self.engine.load_weights(version, None)
        (output,) = self.engine.generate([message])
        if isinstance(output, Exception):  # the benchmark injects no failures
            raise output
        rewards = score_group(solved, [c.text for c in output.completions], message.row)
        result = ResultMessage(
            run_id=message.run_id,
            attempt_id=message.attempt_id,
            worker="bench-worker",
            weight_version=output.weight_version,
            prompt_token_ids=output.prompt_token_ids,
            completions=output.completions,
            rewards=rewards,
            generation_seconds=output.generation_seconds,
        )
        return result, float(output.generation_seconds or 0.0)

    def consume(self) -> None:
        """The consumer's group commit: every result in the inbox, in one transaction each
        `batch_max`."""
        while self.inbox:
            batch, self.inbox = self.inbox[: self.batch_max], self.inbox[self.batch_max :]
            self.tx("record_results", lambda s, b=batch: record_results(s, b, self.at()))
        self.relay()

    def train(self, step: int) -> None:
        batch = self.tx("claim_training", lambda s: claim_training(s, self.run_id, step, "bench-trainer", self.at()))
        if batch is not None:
            self.schedule(self.now + self.scenario.train_seconds, "trained", step)

    def trained(self, step: int) -> None:
        done = self.tx(
            "finish_training",
            lambda s: finish_training(s, self.run_id, step, "bench-trainer", None, {"loss": 0.0}, self.at()),
        )
        if done is not None:
            self.version = step + 1
        self.relay()

    def reap(self) -> None:
        self.tx("expire_leases", lambda s: expire_leases(s, self.run_id, self.at()))
        self.relay()

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> Trace:
        began = time.perf_counter()
        self.tx("admit_steps", lambda s: admit_steps(s, self.run_id, self.at()))
        self.relay()
        self.schedule(self.reap_every, "reap")
        while self.events:
            when, _, kind, payload = heapq.heappop(self.events)
            self.now = when
            if self.now > self.max_virtual_seconds:
                raise RuntimeError(f"the run did not finish within {self.max_virtual_seconds} virtual seconds")
            if not self.step_event(kind, payload):
                break
        trace = self.trace()
        trace.wall_seconds = time.perf_counter() - began
        return trace

    def step_event(self, kind: str, payload: Any) -> bool:
        """Apply one event at `self.now`; False once a trained step has ended the run."""
        if kind == "done":
            self.free += 1
            if payload.attempt_id in self.skipped:
                return True
            self.inbox.append(payload)
            if self.consume_at is None:
                self.consume_at = self.now + self.batch_window
                self.schedule(self.consume_at, "consume")
            self.start_workers()
        elif kind == "consume":
            self.consume_at = None
            self.consume()
        elif kind == "train":
            self.train(payload)
        elif kind == "trained":
            self.trained(payload)
            return self.status() == RunStatus.RUNNING.value
        elif kind == "reap":
            self.reap()
            self.schedule(self.now + self.reap_every, "reap")
        return True

    def status(self) -> str:
        return self.tx("read", lambda s: s.scalar(select(Run.status).where(Run.id == self.run_id)))

    # --- reading the ledger back ---------------------------------------------------------

    def trace(self) -> Trace:
        def secs(value: datetime | None) -> float | None:
            if value is None:
                return None
            if value.tzinfo is None:
                value = value.replace(tzinfo=UTC)
            return (value - T0).total_seconds()

        def read(session: Session) -> Trace:
            steps = [
                StepRecord(row.step, secs(row.admitted_at) or 0.0, secs(row.released_at) or float("nan"), secs(row.trained_at))
                for row in session.scalars(select(Step).where(Step.run_id == self.run_id).order_by(Step.step))
                if row.released_at is not None
            ]
            trained = dict(
                session.execute(
                    select(Group.attempt_id, Group.trained_step).where(Group.run_id == self.run_id)
                ).all()
            )
            finished = []
            for attempt in session.scalars(
                select(Attempt).where(Attempt.run_id == self.run_id, Attempt.zero_variance.is_not(None))
            ):
                finished.append(
                    AttemptRecord(
                        zero_variance=bool(attempt.zero_variance),
                        weight_version=int(attempt.weight_version or 0),
                        trained_step=trained.get(attempt.id),
                        started=self.started_at.get(attempt.id, float("nan")),
                        finished=secs(attempt.finished_at) or float("nan"),
                    )
                )
            # Results still on their way when the run ended (generating, or waiting for the
            # consumer) are groups that were generated and never trained.
            pending = [
                payload
                for _, _, kind, payload in self.events
                if kind == "done" and payload.attempt_id not in self.skipped
            ] + self.inbox
            for result in pending:
                finished.append(
                    AttemptRecord(
                        zero_variance=max(result.rewards) - min(result.rewards) <= 0.0,
                        weight_version=int(result.weight_version or 0),
                        trained_step=None,
                        started=self.started_at.get(result.attempt_id, float("nan")),
                        finished=float("nan"),
                    )
                )
            return Trace(
                strategy=self.policy.label(self.scenario),
                steps=steps,
                finished=finished,
                lookahead=self.policy.lookahead(self.scenario),
                dispatched=self.dispatched,
                profile=self.profile,
            )

        return self.tx("read", read)

    def close(self) -> None:
        self.ledger.dispose()
