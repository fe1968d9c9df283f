"""Several runs on one fleet (issue 18): two sim runs share one generation worker of real
`celery worker` processes, and each trains steps at the rate its `run.share` gives it.

The generation worker is the bottleneck by construction (four threads, a constant 1 s per
message, one or two attempts per message), and each run always has work for it (two steps
of four prompts ahead of its trainer), so each run's rate is its share of the worker; the ledger, the consumer
and the controllers need a small part of the machine's CPU, so the test holds on a loaded
machine.
Rates are measured from the ledger's `trained_at` times, over a window in which both runs
have work all along (they are far from their last step), after both trained a few steps.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import datetime

import pytest
from sqlalchemy import func, select

from refill.models.db import Ledger
from refill.models.migrate import upgrade
from refill.models.runs import request_stop
from refill.models.tables import Attempt, AttemptState, Run, Step, StepStatus
from refill.tasks.controller import Controller
from refill.tasks.relay import QUEUED_PER_SHARE_ENV
from tests.support.databases import temporary_pg_database
from tests.support.fleet import Fleet, purge_prefix

#: Attempts per unit of share on the broker: small against a run's backlog (three steps of 4
#: prompts), so the windows decide the mix of the queue. (A worker's thread runs a message's
#: attempts together, so larger windows, sent as larger bundles, would make the worker fast
#: enough that the runs' own pipelines, not the worker, set their pace.)
QUEUED_PER_SHARE = 1

SHARED: dict = {
    "generation": {
        "sim": {
            # Few groups filtered: a step then costs four attempts but rarely five, so steps
            # come at an even pace and the rates settle within the window.
            "zero_variance_fraction": 0.02,
            "latency": {"distribution": "constant", "mean_seconds": 1.0},
        },
    },
    # Small steps: many of them in the measuring window, so a step more or less moves a rate little.
    "grpo": {"num_prompts_per_step": 4, "max_num_steps": 10_000, "max_num_epochs": None},
    "async_rl": {"max_lookahead_versions": 2, "over_dispatch": {"enabled": False}},
}

WARM_UP_STEPS = 2
WINDOW_SECONDS = 90.0


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory) -> Iterator[tuple[Fleet, Ledger]]:
    saved = os.environ.get(QUEUED_PER_SHARE_ENV)
    os.environ[QUEUED_PER_SHARE_ENV] = str(QUEUED_PER_SHARE)  # the controllers relay in this process
    with temporary_pg_database("refill_shares") as url:
        upgrade(url)
        f = Fleet(url, tmp_path_factory.mktemp("shared-fleet"))
        f.env[QUEUED_PER_SHARE_ENV] = str(QUEUED_PER_SHARE)  # the consumer and trainer relay too
        ledger = Ledger(url)
        try:
            f.start("generate", concurrency=4)
            f.start("consume")
            f.start("train")
            yield f, ledger
        finally:
            ledger.dispose()
            for name in list(f.workers):
                f.kill(name, signal.SIGTERM)
            purge_prefix(f.prefix, f.redis_url)
            if saved is None:
                os.environ.pop(QUEUED_PER_SHARE_ENV, None)
            else:
                os.environ[QUEUED_PER_SHARE_ENV] = saved


class Driven:
    """A run's controller on a thread of this process."""

    def __init__(self, f: Fleet, ledger: Ledger, share: float, seed: int) -> None:
        self.ledger = ledger
        self.run_id = f.create_run(ledger, {**SHARED, "run": {"seed": seed, "share": share}})
        self.controller = Controller(ledger, f.app, self.run_id)
        self.controller.start()
        self.status: str | None = None
        self.thread = threading.Thread(target=self._drive, name=f"controller-{self.run_id}", daemon=True)
        self.thread.start()

    def _drive(self) -> None:
        self.status = self.controller.run(max_seconds=600)

    def trained_at(self) -> list[datetime]:
        with self.ledger.session() as session:
            return list(
                session.scalars(
                    select(Step.trained_at)
                    .where(Step.run_id == self.run_id, Step.status == StepStatus.TRAINED.value)
                    .order_by(Step.trained_at)
                )
            )

    def stop(self) -> str | None:
        self.ledger.transaction(lambda s: request_stop(s, self.run_id))
        self.thread.join(60)
        return self.status


def wait_for(what: str, condition, timeout: float, f: Fleet) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout}s\n{f.tail_logs()}")
        time.sleep(0.2)


def steps_per_minute(stamps: list[datetime], start: datetime, end: datetime) -> float:
    """Steps per minute from the intervals between consecutive steps trained in [start, end]
    (whole intervals only, so the window's edges do not round a rate up or down)."""
    inside = [t for t in stamps if start <= t <= end]
    assert len(inside) >= 4, f"only {len(inside)} steps trained in the window"
    gaps = [(b - a).total_seconds() for a, b in zip(inside, inside[1:], strict=False)]
    return 60.0 / statistics.fmean(gaps)


def measure(f: Fleet, ledger: Ledger, shares: tuple[float, float]) -> tuple[float, float]:
    a = Driven(f, ledger, shares[0], seed=11)
    b = Driven(f, ledger, shares[1], seed=12)
    try:
        wait_for(
            f"both runs trained {WARM_UP_STEPS} steps",
            lambda: min(len(a.trained_at()), len(b.trained_at())) >= WARM_UP_STEPS,
            120,
            f,
        )
        # The window opens at the last step trained so far (on the ledger's clock, as trained_at).
        start = max(a.trained_at()[-1], b.trained_at()[-1])
        time.sleep(WINDOW_SECONDS)
        end = max(a.trained_at()[-1], b.trained_at()[-1])
        rates = (steps_per_minute(a.trained_at(), start, end), steps_per_minute(b.trained_at(), start, end))
        # Both runs had work all along: neither was near its last step.
        assert max(len(a.trained_at()), len(b.trained_at())) < SHARED["grpo"]["max_num_steps"]
        print(f"shares {shares[0]}:{shares[1]}: steps per minute {rates[0]:.1f} and {rates[1]:.1f}")
        return rates
    finally:
        assert a.stop() == "stopped" and b.stop() == "stopped", f.tail_logs()


def test_equal_shares_train_at_equal_rates(shared_fleet) -> None:
    f, ledger = shared_fleet
    a, b = measure(f, ledger, (1, 1))
    assert abs(a - b) <= 0.2 * max(a, b), f"steps per minute {a:.1f} and {b:.1f} differ by more than 20%"


def test_shares_two_to_one_train_at_about_two_to_one(shared_fleet) -> None:
    f, ledger = shared_fleet
    a, b = measure(f, ledger, (2, 1))
    assert 1.6 <= a / b <= 2.4, f"steps per minute {a:.1f} and {b:.1f}: ratio {a / b:.2f}, not within 1.6..2.4"


def test_a_stopped_run_leaves_the_fleet_to_the_other(shared_fleet) -> None:
    f, ledger = shared_fleet
    a = Driven(f, ledger, 1, seed=13)
    b = Driven(f, ledger, 1, seed=14)
    try:
        wait_for("both runs trained a step", lambda: min(len(a.trained_at()), len(b.trained_at())) >= 1, 120, f)
        assert a.stop() == "stopped"
        before = len(b.trained_at())
        wait_for("the other run goes on alone", lambda: len(b.trained_at()) >= before + 3, 60, f)
        # A's stop disturbed nothing of B's: no lease of B's expired, no attempt of B's failed.
        with ledger.session() as session:
            run_b = session.get(Run, b.run_id)
            assert run_b is not None and run_b.status == "running" and run_b.error is None
            failed = session.scalar(
                select(func.count()).where(Attempt.run_id == b.run_id, Attempt.state == AttemptState.FAILED.value)
            )
        assert failed == 0
    finally:
        assert b.stop() == "stopped", f.tail_logs()
