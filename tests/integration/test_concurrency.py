"""Races on the PostgreSQL ledger, with real threads each in its own transactions.

Each race is lined up with a `threading.Barrier` so that the transactions really overlap, and
run many times over fresh runs; whatever order the database picks, the ledger must end in one
of the allowed states, and its invariants must hold.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

from refill.models.db import Ledger
from refill.models.leases import expire_leases, extend_lease, start_attempt
from refill.models.outbox import claim_outbox, mark_sent
from refill.models.results import Outcome, record_results
from refill.models.training import claim_training
from tests.support.driver import SPREAD, Driver
from tests.support.invariants import assert_ledger_consistent

ROUNDS = 20


def race(*fns: Callable[[], Any], jitter: float = 0.0) -> list[Any]:
    """Run each fn in its own thread, released together; their results in order."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            barrier.wait(timeout=10)
            if jitter:
                time.sleep(random.uniform(0, jitter))
            results[i] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a racing transaction hung"
    if errors:
        raise errors[0]
    return results


def consistent(d: Driver) -> None:
    with d.ledger.session() as s:
        assert_ledger_consistent(s, d.run_id)


def recorder(d: Driver, *messages):  # type: ignore[no-untyped-def]
    return lambda: d.ledger.transaction(lambda s: record_results(s, list(messages), d.now)).outcomes


def reaper(d: Driver) -> Callable[[], Any]:
    return lambda: d.ledger.transaction(lambda s: expire_leases(s, d.run_id, d.now))


@pytest.fixture
def pg(pg_ledger: Ledger) -> Ledger:
    return pg_ledger


def test_two_results_competing_for_one_slot_commit_it_once(pg: Ledger) -> None:
    # (0, 0) waits on its replacement R; (1, 1)'s first attempt F would fill (0, 0) too.
    # Either order is allowed: R in (0, 0) and F in (1, 1), or F pushed into (0, 0) and R
    # re-aimed at (1, 1). Never both in one slot, never a slot committed twice.
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        d.filter_slot(0, 0)
        r = d.live_of(0, 0)
        f = d.live_of(1, 1)
        d.start(r.id)
        d.start(f.id)
        a, b = race(recorder(d, d.result(r.id, SPREAD)), recorder(d, d.result(f.id, SPREAD)))
        assert [o.outcome for o in a + b] == [Outcome.COMMITTED, Outcome.COMMITTED]
        placed = {d.slot(0, 0).group_attempt_id, d.slot(1, 1).group_attempt_id}
        assert placed == {r.id, f.id}
        assert (d.step(0).committed, d.step(1).committed) == (1, 1)
        consistent(d)

    for _ in range(ROUNDS):
        one_round()


def test_the_same_result_recorded_twice_at_once_has_one_effect(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        attempt = d.live_of(0, 2)
        d.start(attempt.id)
        message = d.result(attempt.id, SPREAD)
        a, b = race(recorder(d, message), recorder(d, message))
        assert sorted(o.outcome.value for o in a + b) == ["COMMITTED", "DUPLICATE"]
        assert [g.attempt_id for g in d.groups()] == [attempt.id]
        assert d.step(0).committed == 1
        assert [(r.attempt_id, r.reason) for r in d.rejected()] == [(attempt.id, "duplicate")]
        consistent(d)

    for _ in range(ROUNDS):
        one_round()


def test_eight_consumers_finishing_a_step_release_it_once(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, {"grpo": {"num_prompts_per_step": 8}}, num_prompts=24)
        d.admit()
        attempts = d.live(0)
        assert sorted(a.slot_idx for a in attempts) == list(range(8))
        d.start_all([a.id for a in attempts])
        outcomes = race(*[recorder(d, d.result(a.id, SPREAD)) for a in attempts])
        assert [o[0].outcome for o in outcomes] == [Outcome.COMMITTED] * 8
        step = d.step(0)
        assert (step.status, step.committed) == ("released", 8)
        assert [m.step for m in d.outbox("train_step")] == [0]
        assert d.metrics(0).trained_groups == 8
        consistent(d)

    for _ in range(ROUNDS // 2):  # each round is an eight-way race already
        one_round()


def test_result_racing_the_reaper_after_its_lease_expired(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        d.relay()
        attempt = d.live_of(0, 0)
        d.start(attempt.id)
        d.tick(61)
        reaped, outcomes = race(reaper(d), recorder(d, d.result(attempt.id, SPREAD)), jitter=0.005)
        if reaped.attempts == 1:
            # the reaper went first: the slot was re-dispatched and the result is late
            assert outcomes[0].outcome is Outcome.LATE
            assert d.attempt(attempt.id).failure_kind == "infra"
            assert d.live_of(0, 0).reason == "retry"
        else:
            assert (reaped.attempts, outcomes[0].outcome) == (0, Outcome.COMMITTED)
            assert d.slot(0, 0).group_attempt_id == attempt.id
        consistent(d)

    for _ in range(ROUNDS):
        one_round()


def test_late_result_and_the_redispatched_one_at_once(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        d.relay()
        first = d.live_of(0, 0)
        d.start(first.id, worker="w1")
        d.tick(61)
        assert d.reap().attempts == 1
        retry = d.live_of(0, 0)
        d.start(retry.id, worker="w2")
        late, fresh = race(
            recorder(d, d.result(first.id, SPREAD, worker="w1")),
            recorder(d, d.result(retry.id, SPREAD, worker="w2")),
        )
        assert (late[0].outcome, fresh[0].outcome) == (Outcome.LATE, Outcome.COMMITTED)
        assert d.slot(0, 0).group_attempt_id == retry.id
        assert [r.reason for r in d.rejected()] == ["late"]
        consistent(d)

    for _ in range(ROUNDS):
        one_round()


def test_heartbeat_racing_the_reaper_has_one_winner(pg: Ledger) -> None:
    def one_round(jitter: float) -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        attempt = d.live_of(0, 1)
        d.start(attempt.id)
        d.tick(61)
        heartbeat = lambda: d.ledger.transaction(lambda s: extend_lease(s, attempt.id, "w1", 60, d.now))  # noqa: E731
        extended, reaped = race(heartbeat, reaper(d), jitter=jitter)
        state = d.attempt(attempt.id)
        assert extended != (reaped.attempts == 1), "both the heartbeat and the reaper won"
        if extended:
            assert state.state == "running"
            assert (state.leased_until - d.now).total_seconds() == 60
        else:
            assert (state.state, state.failure_kind) == ("failed", "infra")
            assert d.live_of(0, 1).reason == "retry"
        consistent(d)

    for i in range(ROUNDS):
        one_round(0.002 * (i % 4))  # spread the heartbeat over the reaper's transaction


def test_heartbeat_between_the_reapers_read_and_write(pg: Ledger) -> None:
    """The worst interleaving, forced: the heartbeat runs after the reaper has read the
    expired lease and before it writes the failure. The reaper must not fail an attempt whose
    worker was just told it still holds it."""
    d = Driver(pg, num_prompts=12)
    d.admit()
    attempt = d.live_of(0, 1)
    d.start(attempt.id)
    d.tick(61)
    heartbeat_result: list[bool] = []
    heartbeat_thread: list[threading.Thread] = []

    def heartbeat() -> None:
        heartbeat_result.append(d.ledger.transaction(lambda s: extend_lease(s, attempt.id, "w1", 60, d.now)))

    def before_flush(session, _context, _instances):  # type: ignore[no-untyped-def]
        if heartbeat_thread:
            return
        thread = threading.Thread(target=heartbeat)
        heartbeat_thread.append(thread)
        thread.start()
        thread.join(timeout=0.5)  # returns at once unless the reaper holds the attempt's row

    event.listen(pg.sessions, "before_flush", before_flush)
    try:
        reaped = d.ledger.transaction(lambda s: expire_leases(s, d.run_id, d.now))
    finally:
        event.remove(pg.sessions, "before_flush", before_flush)
    heartbeat_thread[0].join(timeout=10)
    assert heartbeat_result, "the heartbeat never finished"
    state = d.attempt(attempt.id)
    assert heartbeat_result[0] != (reaped.attempts == 1), (
        f"heartbeat said {heartbeat_result[0]}, reaper reaped {reaped.attempts}: attempt is {state.state}"
    )
    consistent(d)


def test_a_duplicated_generate_message_starts_one_lease(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        d.relay()
        attempt = d.live_of(0, 3)
        leases = race(
            lambda: d.ledger.transaction(lambda s: start_attempt(s, attempt.id, "w1", d.now, 0)),
            lambda: d.ledger.transaction(lambda s: start_attempt(s, attempt.id, "w2", d.now, 0)),
        )
        won = [w for w, lease in zip(("w1", "w2"), leases, strict=True) if lease is not None]
        assert len(won) == 1
        state = d.attempt(attempt.id)
        assert (state.state, state.worker) == ("running", won[0])
        consistent(d)

    for _ in range(ROUNDS):
        one_round()


def test_two_relays_claim_disjoint_messages(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()

        def relay(name: str):  # type: ignore[no-untyped-def]
            def go(session):  # type: ignore[no-untyped-def]
                out = claim_outbox(session, claimer=name, now=d.now, limit=5, run_id=d.run_id)
                mark_sent(session, out, d.now)
                return [m.outbox_id for m in out]

            return lambda: d.ledger.transaction(go)

        a, b = race(relay("r1"), relay("r2"))
        assert not set(a) & set(b)
        assert len(a) + len(b) == 8
        assert all(r.send_count == 1 for r in d.outbox())
        consistent(d)

    for _ in range(ROUNDS):
        one_round()


def test_two_trainers_claiming_one_step(pg: Ledger) -> None:
    def one_round() -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        d.fill_step(0)
        batches = race(
            lambda: d.ledger.transaction(lambda s: claim_training(s, d.run_id, 0, "t1", d.now)),
            lambda: d.ledger.transaction(lambda s: claim_training(s, d.run_id, 0, "t2", d.now)),
        )
        assert sum(b is not None for b in batches) == 1
        step = d.step(0)
        assert (step.status, step.train_claims) == ("training", 1)
        consistent(d)

    for _ in range(ROUNDS):
        one_round()
