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
from sqlalchemy import event, text

from refill.models.db import Ledger
from refill.models.leases import expire_leases, extend_lease, start_attempt
from refill.models.outbox import claim_outbox, mark_sent
from refill.models.results import Outcome, record_results
from refill.models.rows import RowStore
from refill.models.training import claim_training, extend_training_lease
from tests.support import invariants
from tests.support.databases import backend_seen
from tests.support.driver import SPREAD, Driver

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


#: the checks of `refill check` a race could break, run after every round; the after-test hook
#: runs all of them once more
ROUND_CHECKS = (
    "live_attempts",
    "step_counters",
    "released_step_not_full",
    "slot_committed_twice",
    "group_placement",
    "zero_variance_trained",
    "staleness_bound",
    "budget_exceeded",
)


def consistent(d: Driver) -> None:
    with d.ledger.session() as s:
        problems = invariants.ledger_violations(s, d.run_id, only=ROUND_CHECKS)
    assert not problems, problems


def recorder(d: Driver, *messages):  # type: ignore[no-untyped-def]
    return lambda: d.ledger.transaction(lambda s: record_results(s, list(messages), d.now)).outcomes


def reaper(d: Driver) -> Callable[[], Any]:
    return lambda: d.ledger.transaction(lambda s: expire_leases(s, d.run_id, d.now))


def many_steps(pg: Ledger, steps: int = ROUNDS) -> Driver:
    """One run with `steps` steps admitted at once: each round of a race uses its own step."""
    d = Driver(
        pg,
        {"grpo": {"max_num_steps": steps}, "async_rl": {"max_lookahead_versions": steps}},
        num_prompts=4 * steps + 40,
    )
    assert d.admit() == list(range(steps))
    return d


@pytest.fixture
def pg(pg_ledger: Ledger) -> Ledger:
    return pg_ledger


def test_two_results_competing_for_one_slot_commit_it_once(pg: Ledger) -> None:
    # (s, 0) waits on its replacement R; (s + 1, 1)'s first attempt F would fill (s, 0) too.
    # Either order is allowed: R in (s, 0) and F in (s + 1, 1), or F pushed into (s, 0) and R
    # re-aimed at (s + 1, 1). Never both in one slot, never a slot committed twice.
    d = many_steps(pg, 2 * ROUNDS)

    def one_round(s: int) -> None:
        d.filter_slot(s, 0)
        r = d.live_of(s, 0)
        f = d.live_of(s + 1, 1)
        d.start_all([r.id, f.id])
        a, b = race(recorder(d, d.result(r.id, SPREAD)), recorder(d, d.result(f.id, SPREAD)))
        assert [o.outcome for o in a + b] == [Outcome.COMMITTED, Outcome.COMMITTED]
        assert {d.slot(s, 0).group_attempt_id, d.slot(s + 1, 1).group_attempt_id} == {r.id, f.id}
        assert (d.step(s).committed, d.step(s + 1).committed) == (1, 1)
        consistent(d)

    for k in range(ROUNDS):
        one_round(2 * k)


def test_the_same_result_recorded_twice_at_once_has_one_effect(pg: Ledger) -> None:
    d = many_steps(pg)

    def one_round(s: int) -> None:
        attempt = d.live_of(s, 2)
        d.start(attempt.id)
        message = d.result(attempt.id, SPREAD)
        a, b = race(recorder(d, message), recorder(d, message))
        assert sorted(o.outcome.value for o in a + b) == ["COMMITTED", "DUPLICATE"]
        assert d.group(attempt.id) is not None and len(d.groups()) == s + 1
        assert d.step(s).committed == 1
        assert [(r.attempt_id, r.reason) for r in d.rejected()][-1] == (attempt.id, "duplicate")
        assert len(d.rejected()) == s + 1
        consistent(d)

    for s in range(ROUNDS):
        one_round(s)


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
    d = many_steps(pg)  # nothing relayed: only the attempt started below has a lease

    def one_round(s: int) -> None:
        attempt = d.live_of(s, 0)
        d.start(attempt.id)
        d.tick(61)
        reaped, outcomes = race(reaper(d), recorder(d, d.result(attempt.id, SPREAD)), jitter=0.005)
        if reaped.attempts == 1:
            # the reaper went first: the slot was re-dispatched and the result is late
            assert outcomes[0].outcome is Outcome.LATE
            assert d.attempt(attempt.id).failure_kind == "infra"
            assert d.live_of(s, 0).reason == "retry"
        else:
            assert (reaped.attempts, outcomes[0].outcome) == (0, Outcome.COMMITTED)
            assert d.slot(s, 0).group_attempt_id == attempt.id
        consistent(d)

    for s in range(ROUNDS):
        one_round(s)


def test_late_result_and_the_redispatched_one_at_once(pg: Ledger) -> None:
    d = many_steps(pg)

    def one_round(s: int) -> None:
        first = d.live_of(s, 0)
        d.start(first.id, worker="w1")
        d.tick(61)
        assert d.reap().attempts == 1
        retry = d.live_of(s, 0)
        d.start(retry.id, worker="w2")
        late, fresh = race(
            recorder(d, d.result(first.id, SPREAD, worker="w1")),
            recorder(d, d.result(retry.id, SPREAD, worker="w2")),
        )
        assert (late[0].outcome, fresh[0].outcome) == (Outcome.LATE, Outcome.COMMITTED)
        assert d.slot(s, 0).group_attempt_id == retry.id
        assert [(r.attempt_id, r.reason) for r in d.rejected()][-1] == (first.id, "late")
        consistent(d)

    for s in range(ROUNDS):
        one_round(s)


def test_heartbeat_racing_the_reaper_has_one_winner(pg: Ledger) -> None:
    d = many_steps(pg)

    def one_round(s: int, jitter: float) -> None:
        attempt = d.live_of(s, 1)
        d.start(attempt.id)
        d.tick(61)
        heartbeat = lambda: d.ledger.transaction(lambda s: extend_lease(s, attempt.id, "w1", 60, d.now))  # noqa: E731
        extended, reaped = race(heartbeat, reaper(d), jitter=jitter)
        state = d.attempt(attempt.id)
        assert extended != (reaped.attempts == 1), "both the heartbeat and the reaper won"
        if extended:
            assert state.state == "running"
            assert (state.leased_until - d.now).total_seconds() == 60
            d.commit_slot(s, 1)  # done with it: it must not expire in a later round
        else:
            assert (state.state, state.failure_kind) == ("failed", "infra")
            assert d.live_of(s, 1).reason == "retry"
        consistent(d)

    for s in range(ROUNDS):
        one_round(s, 0.002 * (s % 4))  # spread the heartbeat over the reaper's transaction


def test_heartbeat_between_the_reapers_read_and_write(pg: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
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

    write = RowStore.write

    def heartbeat_then_write(store: RowStore) -> int:
        # The reaper writes the attempts it failed here (models/rows.py), after reading them.
        if not heartbeat_thread:
            thread = threading.Thread(target=heartbeat)
            heartbeat_thread.append(thread)
            thread.start()
            thread.join(timeout=0.5)  # returns at once unless the reaper holds the attempt's row
        return write(store)

    monkeypatch.setattr(RowStore, "write", heartbeat_then_write)
    reaped = d.ledger.transaction(lambda s: expire_leases(s, d.run_id, d.now))
    monkeypatch.undo()
    heartbeat_thread[0].join(timeout=10)
    assert heartbeat_result, "the heartbeat never finished"
    state = d.attempt(attempt.id)
    assert heartbeat_result[0] != (reaped.attempts == 1), (
        f"heartbeat said {heartbeat_result[0]}, reaper reaped {reaped.attempts}: attempt is {state.state}"
    )
    consistent(d)


def test_the_reaper_passes_over_an_expired_lease_whose_row_is_held_and_judges_it_next(pg: Ledger) -> None:
    """A worker frozen inside its heartbeat's transaction holds its attempt's row. The reaper
    must not wait for it: it would hold the run's lock, and every batch of the run, for as long
    as the worker sleeps. It reaps the other expired leases and judges that one once free."""
    d = Driver(pg)
    d.admit()
    held, other = d.live_of(0, 0), d.live_of(0, 1)
    d.start(held.id)
    d.start(other.id)
    d.tick(61)
    with pg.engine.connect() as frozen:
        holding = frozen.begin()
        frozen.execute(text("SELECT id FROM attempts WHERE id = :id FOR NO KEY UPDATE"), {"id": held.id})
        done: list[Any] = []
        reaper_thread = threading.Thread(target=lambda: done.append(d.reap()))
        reaper_thread.start()
        reaper_thread.join(timeout=10)
        finished_while_held = not reaper_thread.is_alive()
        holding.rollback()
    reaper_thread.join(timeout=10)
    assert finished_while_held, "the reaper waited for the held row"
    assert done[0].attempts == 1
    assert d.attempt(other.id).failure_kind == "infra"
    assert d.attempt(held.id).state == "running"
    assert d.reap().attempts == 1  # free now: judged on the next pass
    assert d.attempt(held.id).failure_kind == "infra"
    consistent(d)


def test_a_duplicated_generate_message_starts_one_lease(pg: Ledger) -> None:
    d = many_steps(pg)

    def one_round(s: int) -> None:
        attempt = d.live_of(s, 3)
        leases = race(
            lambda: d.ledger.transaction(lambda ses: start_attempt(ses, attempt.id, "w1", d.now, 0)),
            lambda: d.ledger.transaction(lambda ses: start_attempt(ses, attempt.id, "w2", d.now, 0)),
        )
        won = [w for w, lease in zip(("w1", "w2"), leases, strict=True) if lease is not None]
        assert len(won) == 1
        state = d.attempt(attempt.id)
        assert (state.state, state.worker) == ("running", won[0])
        consistent(d)

    for s in range(ROUNDS):
        one_round(s)


def test_two_relays_claim_disjoint_messages(pg: Ledger) -> None:
    d = many_steps(pg, 2 * ROUNDS)  # eight messages a round

    def relay(name: str):  # type: ignore[no-untyped-def]
        def go(session):  # type: ignore[no-untyped-def]
            out = claim_outbox(session, claimer=name, now=d.now, limit=4, run_id=d.run_id)
            mark_sent(session, out, d.now)
            return [m.attempt_id for m in out]

        return lambda: d.ledger.transaction(go)

    def one_round(k: int) -> None:
        a, b = race(relay("r1"), relay("r2"))
        assert not set(a) & set(b)
        assert len(a) == len(b) == 4
        attempts = d.attempts()
        assert sum(a.dispatched_at is not None for a in attempts) == 8 * (k + 1)
        assert all((a.state == "queued") == (a.dispatched_at is not None) for a in attempts)
        consistent(d)

    for k in range(ROUNDS):
        one_round(k)


def test_the_relay_leaves_a_message_whose_attempt_a_batch_holds_for_its_next_pass(pg: Ledger) -> None:
    """Another transaction (a consumer's batch changing the attempt) holds one attempt's row:
    the relay sends the others without waiting for it (waiting there, holding the others, it
    deadlocked with such batches) and leaves that one pending, due; the next pass sends it."""
    d = Driver(pg, num_prompts=12)
    d.admit()
    busy = d.live_of(0, 1).id
    sent: list[Any] = []
    with pg.engine.connect() as other:
        holding = other.begin()
        other.execute(text("SELECT id FROM attempts WHERE id = :id FOR NO KEY UPDATE"), {"id": busy})

        def relay_once() -> None:
            def go(session):  # type: ignore[no-untyped-def]
                out = claim_outbox(session, claimer="relay", now=d.now)
                mark_sent(session, out, d.now)
                return out

            sent.extend(pg.transaction(go))

        thread = threading.Thread(target=relay_once)
        thread.start()
        thread.join(timeout=10)
        waited = thread.is_alive()
        holding.rollback()
        thread.join(timeout=30)
    assert not waited, "the relay waited for a row another transaction held"
    first = {m.body.get("attempt_id") for m in sent}
    assert busy not in first and len(first) == 7  # the step's other seven
    row = d.attempt(busy)
    assert row.state == "pending" and row.dispatched_at is None and row.available_at <= d.now
    again = d.relay()
    assert [m.body["attempt_id"] for m in again] == [busy]
    assert d.attempt(busy).state == "queued"
    consistent(d)


def test_two_trainers_claiming_one_step(pg: Ledger) -> None:
    d = many_steps(pg)

    def one_round(s: int) -> None:
        d.fill_step(s)
        batches = race(
            lambda: d.ledger.transaction(lambda ses: claim_training(ses, d.run_id, s, "t1", d.now)),
            lambda: d.ledger.transaction(lambda ses: claim_training(ses, d.run_id, s, "t2", d.now)),
        )
        winners = [t for t, batch in zip(("t1", "t2"), batches, strict=True) if batch is not None]
        assert len(winners) == 1
        step = d.step(s)
        assert (step.status, step.train_claims, step.trainer_id) == ("training", 1, winners[0])
        assert d.finish_training(s, winners[0])
        assert [v.version for v in d.weight_versions()] == list(range(s + 2))
        consistent(d)

    for s in range(ROUNDS):
        one_round(s)


def test_trainer_heartbeat_between_the_reapers_read_and_write(pg: Ledger) -> None:
    """As for generation leases: a trainer told it still holds its step must keep it."""
    d = Driver(pg, num_prompts=12)
    d.admit()
    d.fill_step(0)
    assert d.claim(0, "t1") is not None
    d.tick(301)  # trainer_lease_seconds is 300
    heartbeat_result: list[bool] = []
    heartbeat_thread: list[threading.Thread] = []

    def heartbeat() -> None:
        heartbeat_result.append(
            d.ledger.transaction(lambda s: extend_training_lease(s, d.run_id, 0, "t1", 300, d.now))
        )

    def before_write(_conn, _cursor, statement, _params, _context, _many):  # type: ignore[no-untyped-def]
        # The reaper has read the step (locked) and is about to write it back.
        if heartbeat_thread or not statement.startswith("UPDATE steps"):
            return
        thread = threading.Thread(target=heartbeat)
        heartbeat_thread.append(thread)
        thread.start()
        thread.join(timeout=0.5)

    event.listen(pg.engine, "before_cursor_execute", before_write)
    try:
        reaped = d.ledger.transaction(lambda s: expire_leases(s, d.run_id, d.now))
    finally:
        event.remove(pg.engine, "before_cursor_execute", before_write)
    heartbeat_thread[0].join(timeout=10)
    assert heartbeat_result, "the heartbeat never finished"
    step = d.step(0)
    assert heartbeat_result[0] != (reaped.train_steps == 1), (
        f"trainer heartbeat said {heartbeat_result[0]}, reaper re-queued {reaped.train_steps}: step is {step.status}"
    )
    if heartbeat_result[0]:
        assert (step.status, step.trainer_id) == ("training", "t1")
        assert d.finish_training(0, "t1")
    else:
        assert (step.status, step.trainer_id) == ("released", None)
    consistent(d)


def test_trainer_heartbeat_racing_the_reaper_has_one_winner(pg: Ledger) -> None:
    d = many_steps(pg)

    def one_round(s: int, jitter: float) -> None:
        d.fill_step(s)
        assert d.claim(s, "t1") is not None
        d.tick(301)
        heartbeat = lambda: d.ledger.transaction(  # noqa: E731
            lambda ses: extend_training_lease(ses, d.run_id, s, "t1", 300, d.now)
        )
        extended, reaped = race(heartbeat, reaper(d), jitter=jitter)
        assert extended != (reaped.train_steps == 1), "both the trainer heartbeat and the reaper won"
        step = d.step(s)
        assert step.status == ("training" if extended else "released")
        consistent(d)
        trainer = "t1" if extended else "t2"
        if not extended:
            assert d.claim(s, trainer) is not None
        assert d.finish_training(s, trainer)

    for s in range(ROUNDS):
        one_round(s, 0.002 * (s % 4))


def _push_over_a_replacement(pg: Ledger) -> tuple[Driver, Any, Any]:
    """The setup of the re-aim races below: step 2's group `pushed` (weights v1) would move
    to step 1's slot 0, whose live attempt R (a replacement, not started) would move to step 2."""
    d = Driver(pg, num_prompts=24)
    d.admit()
    d.fill_step(0)
    d.filter_slot(1, 0)
    replacement = d.live_of(1, 0)
    assert d.train(0)
    d.admit()
    pushed = d.live_of(2, 0)
    d.start(pushed.id, engine_version=1)
    return d, replacement, pushed


def test_worker_taking_the_lease_racing_a_push_that_reaims_it(pg: Ledger) -> None:
    """(1, 0) waits on replacement R; a v1 group of step 2 wants (1, 0) and R re-aimed at
    step 2, which needs v >= 1, while a worker on v0 takes R's lease. Either R moves first (the
    worker's lease then says v >= 1) or the worker first (R stays: v0 cannot serve step 2)."""

    def one_round() -> None:
        d, replacement, pushed = _push_over_a_replacement(pg)
        lease, outcomes = race(
            lambda: d.ledger.transaction(lambda s: start_attempt(s, replacement.id, "w2", d.now, 0)),
            recorder(d, d.result(pushed.id, SPREAD, version=1)),
        )
        assert lease is not None and outcomes[0].outcome is Outcome.COMMITTED
        moved = d.attempt(replacement.id)
        if moved.step == 2:
            assert d.slot(1, 0).group_attempt_id == pushed.id
            assert lease.min_weight_version == 1 and moved.min_weight_version == 1
        else:
            assert (moved.step, moved.slot_idx, moved.min_weight_version) == (1, 0, 0)
            assert lease.min_weight_version == 0
            assert d.slot(2, 0).group_attempt_id == pushed.id
        assert moved.state == "running"
        consistent(d)

    for _ in range(ROUNDS // 2):  # each round trains a step to set up the push
        one_round()


def test_worker_taking_the_lease_between_a_reaims_read_and_write(pg: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race above, forced into its worst interleaving: the worker's handshake runs after
    the consumer has decided to move R to step 2 and before it writes that. The handshake must
    wait for the consumer (R's row is locked when it is read for the re-aim) and then lease R
    for step 2 with weights new enough for it; had it gone first unseen, a v0 worker would
    generate for step 2, beyond the staleness bound."""
    d, replacement, pushed = _push_over_a_replacement(pg)
    leases: list[Any] = []
    threads: list[threading.Thread] = []
    write = RowStore.write

    def handshake_then_write(store: RowStore) -> int:
        row = store.attempts.get(replacement.id)
        if not threads and row is not None and row.step == 2:  # moved in memory, not written yet
            thread = threading.Thread(
                target=lambda: leases.append(
                    d.ledger.transaction(lambda s: start_attempt(s, replacement.id, "w2", d.now, 0))
                )
            )
            threads.append(thread)
            thread.start()
            thread.join(timeout=0.5)  # returns at once unless the consumer holds R's row
            assert thread.is_alive(), "the handshake did not wait for the re-aim"
        return write(store)

    monkeypatch.setattr(RowStore, "write", handshake_then_write)
    outcomes = d.ledger.transaction(lambda s: record_results(s, [d.result(pushed.id, SPREAD, version=1)], d.now)).outcomes
    monkeypatch.undo()
    assert threads, "the batch never re-aimed R"
    threads[0].join(timeout=10)
    assert outcomes[0].outcome is Outcome.COMMITTED
    assert d.slot(1, 0).group_attempt_id == pushed.id
    moved = d.attempt(replacement.id)
    assert (moved.step, moved.state, moved.min_weight_version) == (2, "running", 1)
    assert leases and leases[0] is not None and leases[0].min_weight_version == 1
    consistent(d)


def _record_while_locked(d: Driver, locks: list[str], params: dict[str, Any], pushed_id: int) -> list[Any]:
    """Record `pushed`'s result while another transaction holds the row locks `locks` take;
    fails (after letting go of the lock) if recording waited for it."""
    outcomes: list[Any] = []
    with d.ledger.engine.connect() as other:
        holding = other.begin()
        for lock in locks:
            other.execute(text(lock), params)
        thread = threading.Thread(
            target=lambda: outcomes.extend(
                d.ledger.transaction(lambda s: record_results(s, [d.result(pushed_id, SPREAD, version=1)], d.now)).outcomes
            )
        )
        thread.start()
        thread.join(timeout=10)
        waited = thread.is_alive()
        holding.rollback()
    thread.join(timeout=30)
    assert not waited, "recording the result waited for another transaction's row lock"
    return outcomes


def test_a_reaim_leaves_an_attempt_whose_handshake_holds_its_row(pg: Ledger) -> None:
    """A worker's lease handshake holds R's row (its update has locked it, not committed): the
    batch must not wait for it (a handshake leasing a bundle, waiting in turn on a row the batch
    locked, closed a deadlock) and must not move R, which is being started with the weights it
    was dispatched for. The group goes to its own slot instead."""
    d, replacement, pushed = _push_over_a_replacement(pg)
    outcomes = _record_while_locked(
        d, ["SELECT id FROM attempts WHERE id = :id FOR NO KEY UPDATE"], {"id": replacement.id}, pushed.id
    )
    assert outcomes[0].outcome is Outcome.COMMITTED
    assert d.slot(2, 0).group_attempt_id == pushed.id
    kept = d.attempt(replacement.id)
    assert (kept.step, kept.slot_idx, kept.state) == (1, 0, replacement.state)
    consistent(d)


def test_a_reaim_does_not_wait_for_foreign_key_checks_on_its_rows(pg: Ledger) -> None:
    """Another transaction holds key-share locks on the run's row and on R's, as a foreign-key
    check takes them (the relay marking an outbox row sent that it claimed in the same
    transaction): the run lock and the re-aim's row lock do not conflict with them, so the
    batch neither waits nor skips R."""
    d, replacement, pushed = _push_over_a_replacement(pg)
    outcomes = _record_while_locked(
        d,
        ["SELECT 1 FROM runs WHERE id = :run FOR KEY SHARE", "SELECT 1 FROM attempts WHERE id = :id FOR KEY SHARE"],
        {"run": d.run_id, "id": replacement.id},
        pushed.id,
    )
    assert outcomes[0].outcome is Outcome.COMMITTED
    assert d.slot(1, 0).group_attempt_id == pushed.id
    moved = d.attempt(replacement.id)
    assert (moved.step, moved.min_weight_version) == (2, 1)
    consistent(d)


def test_worker_taking_a_lease_racing_the_queue_timeout(pg: Ledger) -> None:
    def one_round(jitter: float) -> None:
        d = Driver(pg, num_prompts=12)
        d.admit()
        d.relay()  # eight queued attempts, leased until now + 600
        attempt = d.live_of(0, 2)
        d.tick(601)
        lease, reaped = race(
            lambda: d.ledger.transaction(lambda ses: start_attempt(ses, attempt.id, "w1", d.now, 0)),
            reaper(d),
            jitter=jitter,
        )
        state = d.attempt(attempt.id)
        if lease is not None:
            # the worker went first: its lease is fresh, the reaper leaves it alone
            assert state.state == "running" and state.leased_until > d.now
            assert reaped.attempts == 7
        else:
            assert (state.state, state.failure_kind) == ("failed", "infra")
            assert reaped.attempts == 8
        consistent(d)

    for i in range(ROUNDS):
        one_round(0.002 * (i % 4))


def test_consumers_with_batches_over_two_runs_do_not_deadlock(pg: Ledger, caplog: pytest.LogCaptureFixture) -> None:
    a, b = many_steps(pg), many_steps(pg)

    def one_round(s: int) -> None:
        ids = {(d.run_id, i): d.live_of(s, i).id for d in (a, b) for i in range(2)}
        a.start_all([ids[(a.run_id, 0)], ids[(a.run_id, 1)]])
        b.start_all([ids[(b.run_id, 0)], ids[(b.run_id, 1)]])
        one = [b.result(ids[(b.run_id, 0)], SPREAD), a.result(ids[(a.run_id, 0)], SPREAD)]
        two = [a.result(ids[(a.run_id, 1)], SPREAD), b.result(ids[(b.run_id, 1)], SPREAD)]
        x, y = race(recorder(a, *one), recorder(a, *two))
        assert [o.outcome for o in x + y] == [Outcome.COMMITTED] * 4
        assert (a.step(s).committed, b.step(s).committed) == (2, 2)
        consistent(a)
        consistent(b)

    with caplog.at_level("WARNING", logger="refill.models.db"):
        for s in range(ROUNDS // 2):
            one_round(s)
    assert [r.message for r in caplog.records if "retrying" in r.message] == []


def test_a_hand_over_by_slot_locks_its_attempts_in_id_order(pg: Ledger, caplog: pytest.LogCaptureFixture) -> None:
    """The hand-over by slot (`sql.hand_over`) takes its attempts' row locks in id order, as
    every other statement that locks several attempts does (a worker's heartbeat, a lease
    handshake): slot 0's live attempt Y was dispatched after slot 1's X, so in slot order the
    batch would hold Y while it waited for X, and a heartbeat holding X that then wants Y would
    close a deadlock with it (PostgreSQL then fails one of them: the heartbeat, or the batch,
    which is retried). Here the heartbeat holds X; the batch must wait for X holding nothing
    else, so the heartbeat's update of Y goes through, and nothing is retried."""
    from refill.models.context import RunContext
    from refill.models.slots import dispatch
    from refill.models.tables import AttemptReason

    d = Driver(pg, check=False)  # attempts changed by hand
    d.admit()
    first = d.live_of(0, 0).id
    d.query(lambda s: s.execute(text("UPDATE attempts SET state = 'cancelled' WHERE id = :id"), {"id": first}))

    def retry(session):  # type: ignore[no-untyped-def]
        with RunContext.open(session, d.run_id) as ctx:
            slot = ctx.slot(0, 0)
            return dispatch(ctx, step=0, slot=slot, prompt_id=slot.prompt_id, reason=AttemptReason.RETRY).id

    y, x = d.ledger.transaction(retry), d.live_of(0, 1).id
    assert x < y
    d.start_all([x, y])

    def hand_over_both(session):  # type: ignore[no-untyped-def]
        with RunContext.open(session, d.run_id) as ctx:
            for idx in (0, 1):
                ctx.hand_over(ctx.slot(0, idx))

    errors: list[BaseException] = []

    def batch() -> None:
        try:
            d.ledger.transaction(hand_over_both)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread below
            errors.append(error)

    with d.ledger.engine.connect() as heartbeat:
        holding = heartbeat.begin()
        heartbeat.execute(text("UPDATE attempts SET leased_until = leased_until WHERE id = :id"), {"id": x})
        thread = threading.Thread(target=batch)
        thread.start()
        assert _a_backend_waits_for_a_lock(d.ledger), "the batch's hand-over never waited for X"
        heartbeat.execute(text("SET LOCAL lock_timeout = '5s'"))
        heartbeat.execute(text("UPDATE attempts SET leased_until = leased_until WHERE id = :id"), {"id": y})
        holding.commit()
    thread.join(timeout=30)
    assert not thread.is_alive() and not errors, errors
    assert [r.message for r in caplog.records if "retrying" in r.message] == []
    assert {(d.attempt(a).slot_idx, d.attempt(a).reason) for a in (x, y)} == {(None, "extra")}


def _a_backend_waits_for_a_lock(ledger: Ledger) -> bool:
    """Whether a backend of the ledger's database is waiting for a lock, within 10 s."""
    return backend_seen(ledger.engine, "datname = current_database() AND wait_event_type = 'Lock'", within=10.0)


def test_every_update_of_attempts_found_otherwise_than_by_id_locks_them_in_id_order_first(pg: Ledger) -> None:
    """The rule the test above checks for the hand-over, for every statement that changes
    attempts it found by something else than their ids (a slot, a step, the run): a run's
    cancellation when it fails, the re-aim of a released step's unstarted extras, the hand-over.
    Each locks its rows first, in id order (`sql.attempts_locked_by_id`); the others are by id
    (an UPDATE by key, `id = ANY`), which PostgreSQL walks in id order."""
    import re

    from tests.support.driver import FLAT

    statements: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if re.search(r"\bUPDATE attempts\b", statement):
            statements.append(" ".join(statement.split()))

    settings = {"async_rl": {"max_lookahead_versions": 1, "over_dispatch": {"enabled": True, "safety_sigmas": 0.0}}}
    event.listen(pg.engine, "before_cursor_execute", record)
    try:
        # The re-aim: step 1 released with step 0 open, step 1's extras not started.
        d = Driver(pg, settings)
        d.admit()
        for idx in range(4):
            d.commit_slot(1, idx, SPREAD, version=0)
        assert {a.step for a in d.live() if a.slot_idx is None} == {0}
        # The hand-over: an extra's group fills slot (0, 0), whose attempt is not in the batch.
        d.start_all([a.id for a in d.live()])
        extra = next(a for a in d.live() if a.slot_idx is None)
        d.record(d.result(extra.id, SPREAD))
        # The cancellation: a slot's filter budget spent, the run failed.
        failing = Driver(pg)
        failing.admit()
        for _ in range(4):
            failing.filter_slot(0, 0, FLAT)
        assert failing.run().status == "failed" and failing.live() == []
    finally:
        event.remove(pg.engine, "before_cursor_execute", record)
    kinds = {"stranded": 0, "handed": 0, "live": 0}
    for statement in statements:
        locked = re.match(r"WITH (\w+) AS MATERIALIZED \(SELECT attempts\.id( AS id)? FROM attempts WHERE .* ORDER BY attempts\.id FOR NO KEY UPDATE\) UPDATE attempts SET .* WHERE attempts\.id = \1\.id", statement)
        if locked:
            kinds[locked.group(1)] += 1
            continue
        by_id = re.search(r"WHERE (t\.id = v\.id|attempts\.id = ANY|attempts\.id = %\(|attempts\.id IN \(|attempts\.id = handshake\.id)", statement)
        assert by_id, f"an UPDATE of attempts neither by id nor locked in id order first: {statement[:300]}"
    assert all(kinds.values()), kinds  # each of the three ran
