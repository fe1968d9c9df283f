"""The ledger paths the throughput work changed (issue 7): batched lease handshakes, extras
whose displaced attempts are handed over with the batch's rows, and bundles of results in the
consumer. The invariants of every run are checked after each test (conftest)."""

from __future__ import annotations

import threading
import time

from sqlalchemy import text

from refill.models.context import RunContext
from refill.models.dataloader import mark_taken, take_spare
from refill.models.leases import start_attempts, startable
from refill.models.outbox import ToSend
from refill.models.payload import ResultMessage
from refill.models.results import Outcome
from refill.models.runs import request_stop, stop_run
from refill.models.slots import dispatch
from refill.models.tables import AttemptReason
from refill.tasks.consumer import ResultConsumer
from tests.support.driver import SPREAD, Driver
from tests.support.plans import run_explained


def add_extras(d: Driver, step: int, count: int) -> list[int]:
    """Dispatch `count` extras for `step` from the spare pool (how many over-dispatch sends
    is its own business; this is about where they go)."""

    def go(session):  # type: ignore[no-untyped-def]
        ctx = RunContext.open(session, d.run_id, d.now)
        ids = []
        for _ in range(count):
            spare = take_spare(ctx)
            assert spare is not None
            attempt = dispatch(ctx, step=step, slot=None, prompt_id=spare.prompt_id, reason=AttemptReason.EXTRA)
            mark_taken(spare, attempt)
            ctx.step(step).extras += 1
            ctx.flush()
            ids.append(attempt.id)
        return ids

    return d.ledger.transaction(go)


def test_start_attempts_leases_pending_and_queued_attempts_of_a_running_run_only(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    first, second, third = (d.live_of(0, i).id for i in range(3))
    d.relay()  # all queued now
    d.start(third, worker="someone-else")
    leases = ledger.transaction(
        lambda s: start_attempts(s, d.run_id, [first, second, third, 10**9], "w1", 30.0, d.now, 2)
    )
    assert set(leases) == {first, second}
    assert all(lease.run_id == d.run_id and lease.lease_seconds == 30.0 for lease in leases.values())
    # The engine's version raises the floor, as start_attempt does.
    assert leases[first].min_weight_version == 2 and d.attempt(first).min_weight_version == 2
    assert d.attempt(first).state == "running" and d.attempt(first).worker == "w1"
    assert d.attempt(third).worker == "someone-else"
    # A second handshake for the same attempts finds them running: nothing is ours.
    again = ledger.transaction(lambda s: start_attempts(s, d.run_id, [first, second], "w2", 30.0, d.now))
    assert again == {}
    # Another run's id, or a run that no longer runs, leases nothing.
    fourth = d.live_of(0, 3).id
    assert ledger.transaction(lambda s: start_attempts(s, d.run_id + 1, [fourth], "w1", 30.0, d.now)) == {}
    ledger.transaction(lambda s: request_stop(s, d.run_id))
    ledger.transaction(lambda s: stop_run(s, d.run_id, d.now))
    assert ledger.transaction(lambda s: start_attempts(s, d.run_id, [fourth], "w1", 30.0, d.now)) == {}


def test_a_handshake_finds_its_attempts_by_id_whatever_the_statistics_say(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A new run's attempts are not in PostgreSQL's statistics yet (here: a fresh database,
    never analyzed). A handshake of 8 attempts must still reach them by id, not through the
    run's 2,000 live attempts: with the run beside the ids, the planner ran its locking
    subquery once per live attempt (16,000 buffers). Measured by the buffers it touches."""
    from sqlalchemy import event

    d = Driver(pg_ledger, {"grpo": {"num_prompts_per_step": 512, "num_generations_per_prompt": 4}}, num_prompts=1200)
    d.admit()
    queued = [m.body["attempt_id"] for m in d.relay() if m.kind == "generate"]
    assert len(queued) >= 500
    statements: list[tuple[str, dict]] = []  # type: ignore[type-arg]

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "UPDATE attempts" in statement:
            statements.append((statement, parameters))

    event.listen(pg_ledger.engine, "before_cursor_execute", record)
    try:
        leases = pg_ledger.transaction(lambda s: start_attempts(s, d.run_id, queued[:8], "w1", 30.0, wait=False))
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", record)
    assert set(leases) == set(queued[:8])
    (statement, parameters), = statements
    # The same statement for the next 8 attempts, explained as it runs (then rolled back).
    # (The ids are the statement's expanding parameter `b_ids`, one `b_ids_N` per id.)
    ids = iter(queued[8:16])
    parameters = {k: next(ids) if k.startswith("b_ids_") else v for k, v in parameters.items()}
    rows, buffers = run_explained(pg_ledger, statement, parameters)
    assert rows == 8
    assert buffers < 1000, f"the handshake touched {buffers} buffers for 8 attempts"


def test_a_worker_handshake_and_heartbeat_write_the_ledger_clock_without_reading_it_first(ledger) -> None:  # type: ignore[no-untyped-def]
    """A worker passes no clock: the lease is written with the database's (PostgreSQL's
    now(), inside the statement: no round trip of its own), and the heartbeat the same way."""
    from datetime import timedelta

    from sqlalchemy import event, func, select

    from refill.models.clock import utcnow
    from refill.models.leases import extend_lease
    from refill.tasks.generation import LeaseKeeper

    d = Driver(ledger)
    d.admit()
    attempt_id = d.live_of(0, 0).id
    seen: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        seen.append(statement)

    def clock_reads() -> list[str]:
        return [s for s in seen if s.lstrip().lower().startswith("select now()")]

    def handshake(session):  # type: ignore[no-untyped-def]
        leases = start_attempts(session, d.run_id, [attempt_id], "w1", 30.0)
        reads = clock_reads()
        # The transaction's clock, read after the handshake (now() is the transaction's start).
        return leases, reads, session.scalar(select(func.now())) if ledger.dialect == "postgresql" else None

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        leases, reads, at = ledger.transaction(handshake)
        row = d.attempt(attempt_id)
        seen.clear()
        assert ledger.transaction(lambda s: extend_lease(s, attempt_id, "w1", 90.0))
        # The worker's own heartbeat (its lease keeper, every lease it holds at once) too.
        keeper = LeaseKeeper(ledger, "w1")
        try:
            assert keeper._extend({attempt_id: 90.0}) == {attempt_id}
            assert keeper._extend({attempt_id + 10_000: 90.0}) == set()  # not ours: not extended
        finally:
            keeper.close()
        heartbeat_reads = clock_reads()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    assert reads == [] and heartbeat_reads == []
    assert set(leases) == {attempt_id}
    if at is None:  # SQLite: this process's clock is the ledger's
        at = row.started_at
        assert abs((utcnow() - at).total_seconds()) < 60
    assert row.started_at == at and row.dispatched_at == at
    assert row.leased_until == at + timedelta(seconds=30)
    # The heartbeat pushed the lease out from its own transaction's clock.
    assert d.attempt(attempt_id).leased_until >= at + timedelta(seconds=90)


def test_a_bundle_handshake_takes_what_it_can_without_waiting_then_the_rest(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """Another transaction (a consumer's batch changing the attempt) holds one attempt's row.
    The bundle's handshake leases and commits the others without waiting for it (waiting while
    holding them deadlocked with such batches), then takes that one once it is free."""
    from refill.tasks.generation import GenerationService

    d = Driver(pg_ledger)
    d.admit()
    d.relay()
    first, busy, last = (d.live_of(0, i).id for i in range(3))
    with pg_ledger.engine.connect() as other:
        holding = other.begin()
        other.execute(text("SELECT id FROM attempts WHERE id = :id FOR NO KEY UPDATE"), {"id": busy})
        # The statement alone: it leaves the busy row out and does not wait.
        alone = pg_ledger.transaction(lambda s: start_attempts(s, d.run_id, [first, busy], "probe", 30.0, d.now, wait=False))
        assert set(alone) == {first}
        assert pg_ledger.transaction(lambda s: startable(s, d.run_id, [busy, first])) == [busy]

        service = GenerationService(pg_ledger, send_results=lambda bodies: None, worker="gen-1")
        leases: list = []  # type: ignore[type-arg]
        worker = threading.Thread(
            target=lambda: leases.extend(service._take_leases([(d.run_id, a, 30.0, 0) for a in (busy, last)]))
        )
        try:
            worker.start()
            deadline = time.monotonic() + 10
            while d.attempt(last).worker != "gen-1" and time.monotonic() < deadline:
                time.sleep(0.05)
            # Committed while the busy row is still held: the bundle did not wait for it.
            assert d.attempt(last).worker == "gen-1"
            assert worker.is_alive()  # and the busy one waits for the holder, in a transaction of its own
            holding.rollback()
            worker.join(timeout=30)
        finally:
            if holding.is_active:
                holding.rollback()
            worker.join(timeout=30)
            service.close()
    assert [lease.attempt_id if lease else None for lease in leases] == [busy, last]
    assert d.attempt(busy).state == "running" and d.attempt(busy).worker == "gen-1"


def test_extras_that_fill_slots_hand_their_attempts_over_once_per_batch(ledger) -> None:  # type: ignore[no-untyped-def]
    """An extra fills the earliest open slot and that slot's attempt becomes an extra of the
    step, written at the batch's flush. When the displaced attempt itself finishes later in the
    same batch, it is recorded as the extra it became, as if the hand-over had been written at
    once."""
    d = Driver(ledger, {"grpo": {"max_num_steps": 1}})
    d.admit()
    extras = add_extras(d, 0, 2)
    own_00 = d.live_of(0, 0).id
    own_01 = d.live_of(0, 1).id
    d.start_all([*extras[:2], own_00])
    batch = d.record(d.result(extras[0], SPREAD), d.result(own_00, SPREAD), d.result(extras[1], SPREAD))
    assert [o.outcome for o in batch.outcomes] == [Outcome.COMMITTED] * 3
    # The first extra took slot (0, 0); its own attempt, finishing in the same batch, became an
    # extra and took the next open slot, whose attempt became an extra in turn.
    assert d.slot(0, 0).group_attempt_id == extras[0]
    assert d.slot(0, 1).group_attempt_id == own_00
    moved = d.attempt(own_00)
    assert (moved.state, moved.slot_idx, moved.reason) == ("committed", None, "extra")
    displaced = d.attempt(own_01)
    assert (displaced.state, displaced.slot_idx, displaced.reason) == ("pending", None, "extra")
    # Every open slot still has exactly one live attempt (checked again by the conftest).
    for slot in d.slots(0):
        if slot.status == "open":
            d.live_of(0, slot.idx)


def test_a_bundle_of_results_is_recorded_once_whatever_it_repeats(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    a, b = d.live_of(0, 0).id, d.live_of(0, 1).id
    d.start_all([a, b])
    consumer = ResultConsumer(ledger)
    try:
        good_a = d.result(a, SPREAD, version=0).to_json()
        good_b = d.result(b, SPREAD, version=0).to_json()
        summary = consumer.submit({"bundle": [good_a, good_a, {"run_id": d.run_id}, good_b]})
        assert summary == "COMMITTEDx2 DUPLICATEx1 MALFORMEDx1"
        # The bundle delivered again (at least once): nothing changes but refusals.
        snapshot = d.snapshot()
        assert consumer.submit({"bundle": [good_a, good_b]}) == "DUPLICATEx2"
        assert d.snapshot() == snapshot
        # A plain result message is still accepted.
        assert consumer.submit(good_a) == "DUPLICATE"
    finally:
        consumer.close()
    assert d.step(0).committed == 2


def test_a_bundle_of_results_is_recorded_in_one_batch(ledger) -> None:  # type: ignore[no-untyped-def]
    """Even with no wait for company, a bundle's results are queued together: the batch that
    starts takes all of them (one transaction), none is left for the next."""
    d = Driver(ledger)
    d.admit()
    ids = [d.live_of(0, i).id for i in range(4)]
    d.start_all(ids)
    consumer = ResultConsumer(ledger, max_wait_ms=0.0)
    try:
        summary = consumer.submit({"bundle": [d.result(a, SPREAD, version=0).to_json() for a in ids]})
        batches = consumer._batcher.batches_processed
    finally:
        consumer.close()
    assert summary == "COMMITTEDx4" and batches == 1
    assert d.step(0).committed == 4


def test_a_runs_first_messages_take_their_leases_together_before_its_engine_loads(ledger) -> None:  # type: ignore[no-untyped-def]
    from refill.models.payload import GenerateMessage
    from refill.tasks.backends import make_engine
    from refill.tasks.generation import GenerationService

    d = Driver(ledger)
    d.admit()
    messages = [GenerateMessage.from_json(m.body) for m in d.relay() if m.kind == "generate"]
    assert len(messages) >= 4
    engines: list[int] = []
    handshakes: list[int] = []
    sent: list[dict] = []

    def factory(config):  # type: ignore[no-untyped-def]
        engines.append(1)
        return make_engine(config)

    class Counting(GenerationService):
        def _take_leases(self, requests):  # type: ignore[no-untyped-def]
            handshakes.append(len(requests))
            return super()._take_leases(requests)

    service = Counting(ledger, send_results=sent.extend, worker="gen-1", engine_factory=factory)
    try:
        # A message of a run this ledger does not have: skipped, and no engine is loaded for it.
        stray = GenerateMessage(**{**messages[0].to_json(), "run_id": d.run_id + 1})
        assert service.run(stray) == "skipped" and engines == [] and handshakes == []
        outcomes = service.run_all(messages[:4])
        assert outcomes in ("generated x4", "data x4"), outcomes  # generated (the reward function may refuse sim text)
        assert engines == [1]  # one engine, loaded after the leases
        assert sum(handshakes) == 4  # every lease through the batched handshake
        assert {d.attempt(m.attempt_id).worker for m in messages[:4]} == {"gen-1"}
        assert sorted(r["attempt_id"] for r in sent) == sorted(m.attempt_id for m in messages[:4])
        assert all(r["weight_version"] == 0 and r["worker"] == "gen-1" for r in sent), sent[0].get("error")
        # The second time the same attempt arrives it is not ours: skipped, the engine kept.
        assert service.run(messages[0]) == "skipped" and engines == [1]
    finally:
        service.close()
    d.record(*(ResultMessage.from_json(r) for r in sent))


def test_a_relay_pass_and_a_trainer_heartbeat_write_the_ledger_clock_without_reading_it_first(ledger) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import event

    from refill.models.training import extend_training_lease
    from refill.tasks.app import make_app
    from refill.tasks.relay import relay

    d = Driver(ledger)
    d.admit()
    statements: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        statements.append(statement.lstrip().lower())

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        sent = relay(ledger, make_app("memory://"), claimer="relay-test", run_id=d.run_id)
        queued = d.attempts(0)
        d.fill_step(0)
        assert d.claim(0, "t1") is not None
        assert ledger.transaction(lambda s: extend_training_lease(s, d.run_id, 0, "t1", 300))
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    assert sent == len(d.attempts()) > 0
    assert not [s for s in statements if s.startswith("select now()")]
    # Queued on the ledger's clock: leased for the queue time-out from when they were sent.
    assert queued and all(a.state == "queued" and a.leased_until > a.dispatched_at for a in queued)
    assert {a.dispatched_at for a in queued} == {queued[0].dispatched_at}


def test_a_relay_pass_locks_and_reads_its_attempts_together_and_writes_each_once(ledger) -> None:  # type: ignore[no-untyped-def]
    """The fleet's relay marks what it sent in the transaction that found it: no claim is
    written first (its row locks keep other relays off until it ends), and the due attempts
    are locked by the read that fetches their prompts and their runs."""
    from sqlalchemy import event

    from refill.models.outbox import claim_outbox, mark_sent

    d = Driver(ledger)
    d.admit()
    d.relay(only=ToSend((min(a.id for a in d.live()),)))  # the run's settings parsed: the pass below is a steady one
    statements: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        spelled = " ".join(statement.split()).lower()
        if spelled.startswith(("select", "update", "insert", "delete")):  # not SQLite's BEGIN
            statements.append(spelled)

    class Looked(Exception):
        pass

    def rolled_back(session):  # type: ignore[no-untyped-def]
        out = claim_outbox(session, claimer="relay-a", now=d.now, claim_seconds=None)
        raise Looked(len(out))

    try:
        ledger.transaction(rolled_back)
    except Looked as looked:
        assert looked.args[0] == 7
    # Nothing was written for a pass that did not commit: the attempts are due again at once.
    unsent = [a for a in d.live() if a.dispatched_at is None]
    assert len(unsent) == 7 and all(a.state == "pending" and a.available_at <= d.now for a in unsent)
    event.listen(ledger.engine, "before_cursor_execute", record)
    try:

        def go(session):  # type: ignore[no-untyped-def]
            out = claim_outbox(session, claimer="relay-b", now=d.now, claim_seconds=None)
            mark_sent(session, out, d.now)
            return out

        sent = ledger.transaction(go)
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    assert len(sent) == 7
    writes = [s for s in statements if s.startswith("update attempts")]
    assert len(writes) == 1, statements
    assert not [s for s in statements if s.startswith("update outbox")], statements  # no train_step due
    assert len([s for s in statements if "from attempts" in s]) == 1, statements
    assert not [s for s in statements if s.startswith("select runs.")], statements
    assert len(statements) == 3, statements  # due train_step rows, due attempts, attempts queued
    assert all(d.attempt(m.attempt_id).state == "queued" and d.attempt(m.attempt_id).dispatched_at == d.now for m in sent)
