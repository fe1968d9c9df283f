"""The two comparison strategies of the fill-time benchmark, as plain event-driven simulations.

They share everything with the `refill` strategy except the scheduling decision:

- the same `sim` engine (per-prompt Beta solve rates keyed by the prompt's text, the same
  zero-variance fraction, lognormal latency drawn from the attempt's seed), in virtual mode;
- the same data order (`refill.models.dataloader.epoch_order` with the run seed) and the same
  seed rule per attempt (`Scenario.attempt_seed`: the k-th dispatched attempt of every strategy
  draws the same latency and the same completions for the same prompt);
- the same fleet (`W` workers x `C` groups in flight, one FIFO queue; a worker generates with
  the newest published weight version), the same admission gate (step `s` is admitted once the
  newest version is at least `s - max_lookahead_versions`) and the same trainer (released steps
  train in order, `train_seconds` each, publishing version `s + 1`).

Strategies:

- `serial`: the reference's per-slot serial replacement (NeMo RL PR #4588). Each slot
  dispatches its prompt; a zero-variance group is replaced by the next prompt for that slot,
  which then waits for that generation. No borrowing, no over-dispatch. A step is released
  when every slot holds a group.
- `batch`: whole-batch regeneration (verl's DAPO recipe, NeMo RL's synchronous path). A step
  generates a batch of `N` prompts and waits for all of it; it keeps the non-zero-variance
  groups and generates another batch of `N` while it holds fewer than `N`; the surplus of the
  last batch is discarded.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from bench.virtual_fleet import AttemptRecord, Scenario, StepRecord, Trace
from refill.models.dataloader import epoch_order
from refill.models.payload import GenerationRequest
from refill.rewards.scoring import score_group
from refill.rewards.sim import solved


@dataclass
class _Attempt:
    number: int
    position: int
    step: int
    slot: int | None
    started: float = float("nan")
    finished: float = float("nan")
    latency: float = 0.0
    version: int = 0
    zero_variance: bool = False
    trained_step: int | None = None
    done: bool = False


@dataclass
class _Step:
    step: int
    admitted: float
    released: float | None = None
    trained: float | None = None
    committed: int = 0
    # batch strategy
    round_size: int = 0
    round_done: int = 0
    round: list[_Attempt] = field(default_factory=list)
    kept: list[_Attempt] = field(default_factory=list)


class _Simulation:
    """The fleet, the data loader, the admission gate and the trainer; a strategy decides what
    to dispatch on admission and on each finished attempt."""

    name = "?"

    def __init__(self, scenario: Scenario) -> None:
        self.sc = scenario
        self.engine = scenario.engine()
        self.free = scenario.capacity
        self.queue: deque[_Attempt] = deque()
        self.events: list[tuple[float, int, str, _Attempt | None]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.version = 0
        self.next_step = 0
        self.steps: dict[int, _Step] = {}
        self.attempts: list[_Attempt] = []
        self.training = False
        self.epoch = 0
        self.cursor = 0
        self.order = epoch_order(scenario.num_prompts(), scenario.seed, 0, True)
        self.lookahead = scenario.max_lookahead_versions

    # --- plumbing ------------------------------------------------------------------------

    def draw(self) -> int:
        if self.cursor >= len(self.order):
            self.epoch += 1
            self.cursor = 0
            self.order = epoch_order(self.sc.num_prompts(), self.sc.seed, self.epoch, True)
        position = self.order[self.cursor]
        self.cursor += 1
        return position

    def dispatch(self, step: int, slot: int | None) -> _Attempt:
        attempt = _Attempt(len(self.attempts) + 1, self.draw(), step, slot)
        self.attempts.append(attempt)
        self.queue.append(attempt)
        return attempt

    def start_workers(self) -> None:
        while self.free and self.queue:
            attempt = self.queue.popleft()
            self.free -= 1
            self.generate(attempt)
            heapq.heappush(self.events, (attempt.finished, next(self.seq), "done", attempt))

    def generate(self, attempt: _Attempt) -> None:
        sc = self.sc
        request = GenerationRequest(
            attempt_id=attempt.number,
            prompt=sc.prompt_text(attempt.position),
            row={"i": attempt.position},
            n=sc.generations,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=2,
            seed=sc.attempt_seed(attempt.number),
        )
        (output,) = self.engine.generate([request])
        assert not isinstance(output, Exception)
        rewards = score_group(solved, [c.text for c in output.completions], {"i": attempt.position})
        attempt.zero_variance = max(rewards) - min(rewards) <= 0.0
        attempt.version = self.version
        attempt.started = self.now
        attempt.latency = float(output.generation_seconds or 0.0)
        attempt.finished = self.now + attempt.latency

    def admit(self) -> None:
        while self.next_step < self.sc.steps and self.next_step - self.version <= self.lookahead:
            step = _Step(self.next_step, self.now)
            self.steps[step.step] = step
            self.next_step += 1
            self.on_admit(step)
        self.start_workers()

    def release(self, step: _Step) -> None:
        step.released = self.now
        self.maybe_train()

    def maybe_train(self) -> None:
        head = self.steps.get(self.version)
        if not self.training and head is not None and head.released is not None:
            self.training = True
            heapq.heappush(self.events, (self.now + self.sc.train_seconds, next(self.seq), "trained", None))

    def run(self) -> Trace:
        self.admit()
        while self.events and self.version < self.sc.steps:
            self.now, _, kind, attempt = heapq.heappop(self.events)
            if kind == "done":
                assert attempt is not None
                attempt.done = True
                self.free += 1
                self.on_result(attempt)
                self.start_workers()
            else:
                self.steps[self.version].trained = self.now
                self.training = False
                self.version += 1
                self.admit()
                self.maybe_train()
        return self.trace()

    def trace(self) -> Trace:
        # Attempts still generating when the last step trained are counted with the groups
        # they would return: generated, never trained.
        finished = [
            AttemptRecord(a.zero_variance, a.version, a.trained_step, a.started, a.finished)
            for a in self.attempts
            if a.started == a.started  # started (not NaN)
        ]
        steps = [
            StepRecord(s.step, s.admitted, s.released, s.trained)
            for s in sorted(self.steps.values(), key=lambda s: s.step)
            if s.released is not None
        ]
        return Trace(self.name, steps, finished, self.lookahead, dispatched=len(self.attempts))

    # --- strategy ------------------------------------------------------------------------

    def on_admit(self, step: _Step) -> None:
        raise NotImplementedError

    def on_result(self, attempt: _Attempt) -> None:
        raise NotImplementedError


class Serial(_Simulation):
    name = "serial"

    def on_admit(self, step: _Step) -> None:
        for slot in range(self.sc.prompts_per_step):
            self.dispatch(step.step, slot)

    def on_result(self, attempt: _Attempt) -> None:
        step = self.steps[attempt.step]
        if attempt.zero_variance:
            self.dispatch(step.step, attempt.slot)  # the slot waits for its replacement
            return
        attempt.trained_step = step.step
        step.committed += 1
        if step.committed == self.sc.prompts_per_step:
            self.release(step)


class Batch(_Simulation):
    name = "batch"

    def on_admit(self, step: _Step) -> None:
        self.new_round(step)

    def new_round(self, step: _Step) -> None:
        step.round = [self.dispatch(step.step, None) for _ in range(self.sc.prompts_per_step)]
        step.round_size = len(step.round)
        step.round_done = 0

    def on_result(self, attempt: _Attempt) -> None:
        step = self.steps[attempt.step]
        step.round_done += 1
        if step.round_done < step.round_size:
            return
        # The whole batch is back: keep its non-zero-variance groups, in batch order.
        step.kept.extend(a for a in step.round if not a.zero_variance)
        if len(step.kept) < self.sc.prompts_per_step:
            self.new_round(step)
            self.start_workers()
            return
        for kept in step.kept[: self.sc.prompts_per_step]:
            kept.trained_step = step.step  # the rest is discarded
        self.release(step)


STRATEGIES = {"serial": Serial, "batch": Batch}


def simulate(name: str, scenario: Scenario) -> Trace:
    return STRATEGIES[name](scenario).run()
