"""Runs sharing one fleet (issue 18): the relay meters each run's attempts on the broker by its
`run.share`, and the outbox holds a run's train_step messages, not its attempts."""

from __future__ import annotations

import json
from collections import Counter, deque

import pytest

from refill.admin.fleet_queries import fleet_shares
from refill.admin.run_queries import list_runs
from refill.admin.snapshot import read_snapshot
from refill.models.db import Ledger
from refill.models.migrate import upgrade
from refill.models.outbox import (
    Outgoing,
    ToSend,
    claim_outbox,
    mark_sent,
    queue_room,
    queued_window,
)
from refill.models.tables import AttemptState
from refill.tasks.relay import QUEUED_PER_SHARE_ENV, queued_per_share
from tests.support.driver import SPREAD, Driver

#: eight prompts a step, two steps admitted (lookahead 1): sixteen pending attempts a run
WIDE = {"grpo": {"num_prompts_per_step": 8, "max_num_steps": 4}, "rollout_failure": {"replacement_reserve_prompts": 8}}


def two_runs(ledger, share_a: float = 2, share_b: float = 1) -> tuple[Driver, Driver]:
    a = Driver(ledger, {**WIDE, "run": {"seed": 7, "share": share_a}}, num_prompts=80)
    b = Driver(ledger, {**WIDE, "run": {"seed": 8, "share": share_b}}, num_prompts=80)
    a.admit()
    b.admit()
    return a, b


def metered(d: Driver, per_share: int, *, run_id: int | None = None, ids: list[int] | None = None) -> list[Outgoing]:
    def go(session):  # type: ignore[no-untyped-def]
        sent = claim_outbox(
            session, claimer="relay", now=d.now, run_id=run_id,
            only=None if ids is None else ToSend(tuple(ids), run_ids=(d.run_id,)),
            queued_per_share=per_share,
        )
        mark_sent(session, sent, d.now)
        return sent

    return d.ledger.transaction(go)


def by_run(messages: list[Outgoing]) -> Counter[int]:
    return Counter(m.run_id for m in messages if m.kind == "generate")


def test_a_run_keeps_its_share_of_the_window_on_the_broker(ledger) -> None:
    a, b = two_runs(ledger)
    assert queued_window(2, 3) == 6 and queued_window(0.1, 3) == 1  # never below one
    # The controller's pass (by run) and the consumer's (by ids) meter alike.
    assert by_run(metered(a, 3, run_id=a.run_id)) == {a.run_id: 6}
    unsent_b = [x.id for x in b.attempts(state=AttemptState.PENDING.value)]
    assert by_run(metered(b, 3, ids=unsent_b)) == {b.run_id: 3}
    assert metered(a, 3, run_id=a.run_id) == [] and metered(b, 3, ids=unsent_b) == []
    # A worker takes two of A's attempts: A may send two more, B nothing.
    queued_a = [x.id for x in a.attempts(state=AttemptState.QUEUED.value)]
    a.start_all(queued_a[:2])
    assert by_run(metered(a, 3)) == {a.run_id: 2}
    with ledger.session() as session:
        assert queue_room(session, [a.run_id, b.run_id], 3) == {a.run_id: 0, b.run_id: 0}
    # Held attempts stay pending and due, unclaimed: nothing of them is lost.
    held = a.attempts(state=AttemptState.PENDING.value)
    assert held and all(x.dispatched_at is None and x.available_at <= a.now for x in held)


def test_train_step_rows_and_moot_rows_are_never_held(ledger) -> None:
    a, _ = two_runs(ledger)
    metered(a, 1, run_id=a.run_id)  # A's window (2) is full from here on
    queued = [x.id for x in a.attempts(state=AttemptState.QUEUED.value)]
    a.start_all(queued)
    for attempt_id in queued:
        a.finish(attempt_id, SPREAD)
    a.fill_step(0)
    sent = metered(a, 1, run_id=a.run_id)
    assert [m.body["step"] for m in sent if m.kind == "train_step"] == [0]
    # Step 0 trained with step 1 full: step 1's train_step row waits, unsent, when the run stops.
    a.fill_step(1)
    assert a.train(0)
    assert [(row.step, row.sent_at is None) for row in a.outbox()] == [(0, False), (1, True)]
    # A stopped run sends nothing, and its rows drain whatever its window says.
    a.stop()
    assert metered(a, 1, run_id=a.run_id) == []
    assert [row for row in a.outbox() if row.sent_at is None] == []


def test_a_run_that_does_not_run_sends_none_of_its_pending_attempts(ledger) -> None:
    """Stopping a run cancels its live attempts; were any left pending (a row written by hand,
    a future path), the relay still sends only a running run's, by run, by id or over all."""
    from sqlalchemy import update

    from refill.models.tables import Run

    a, b = two_runs(ledger)
    ids = tuple(x.id for x in a.attempts(state=AttemptState.PENDING.value))
    ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == a.run_id).values(status="stopped")))
    for kwargs in ({"run_id": a.run_id}, {"only": ToSend(ids)}, {"only": ToSend(ids, run_ids=(a.run_id,))}, {}):
        def go(session, kwargs=kwargs):  # type: ignore[no-untyped-def]
            return claim_outbox(session, claimer="r", now=a.now, queued_per_share=3, claim_seconds=None, **kwargs)

        assert {m.run_id for m in ledger.transaction(go)} <= {b.run_id}, kwargs
    ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == a.run_id).values(status="running")))
    assert by_run(metered(a, 3, run_id=a.run_id)) == {a.run_id: 6}


def test_a_metered_pass_locks_only_what_it_sends(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """The consumer's relay pass sizes its runs' rooms before it reads their attempts: the
    attempts over a run's room are not locked (a batch that wants to move one would take it for
    one a worker is starting), and not read."""
    from sqlalchemy import text

    a, _ = two_runs(pg_ledger)
    ids = tuple(x.id for x in a.attempts(state=AttemptState.PENDING.value))
    with pg_ledger.session() as session:
        sent = claim_outbox(session, claimer="c", now=a.now, only=ToSend(ids, run_ids=(a.run_id,)), queued_per_share=2)
        assert len(sent) == 4  # the window of share 2, two a share
        left = [i for i in ids if i not in {m.attempt_id for m in sent}]
        with pg_ledger.engine.connect() as other:
            free = other.execute(
                text("SELECT id FROM attempts WHERE id = ANY(:ids) FOR NO KEY UPDATE SKIP LOCKED"), {"ids": left}
            ).scalars().all()
            other.rollback()
        session.rollback()
    assert sorted(free) == sorted(left) and len(left) == len(ids) - 4


@pytest.mark.parametrize(("share_a", "share_b", "expected"), [(1, 1, 1.0), (2, 1, 2.0)])
def test_a_fifo_fleet_serves_runs_in_the_ratio_of_their_shares(ledger, share_a, share_b, expected) -> None:
    """The argument of `queue_room`, played out: one FIFO queue, workers that take its head one
    at a time, and a metered relay between takes. The take sequence settles into a cycle in
    which each run appears as often as its window."""
    a, b = two_runs(ledger, share_a, share_b)
    queue: deque[int] = deque()
    taken: list[int] = []
    for _ in range(18):
        for d in (a, b):
            for message in metered(d, 2, run_id=d.run_id):
                if message.kind == "generate":
                    queue.append(message.body["attempt_id"])
        attempt_id = queue.popleft()
        owner = a if a.attempt(attempt_id).run_id == a.run_id else b
        owner.start_all([attempt_id])
        taken.append(owner.run_id)
    settled = Counter(taken[6:])
    assert settled[a.run_id] / settled[b.run_id] == pytest.approx(expected, rel=0.1)


def test_the_outbox_holds_a_runs_train_step_messages_not_its_attempts(ledger) -> None:
    """A pending attempt is its own generate message: a run that makes many attempts writes
    one outbox row a released step, and nothing needs pruning as it goes."""
    a, _ = two_runs(ledger)
    a.relay()
    a.tick(120)
    for attempt in a.attempts(state=AttemptState.QUEUED.value)[:8]:
        a.start_all([attempt.id])
        a.finish(attempt.id, SPREAD)
    a.fill_step(0)
    sent = a.relay()
    assert len(a.attempts()) >= 16 and [m.body["step"] for m in sent if m.kind == "train_step"] == [0]
    assert [(row.kind, row.step) for row in a.outbox()] == [("train_step", 0)]


def test_the_window_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(QUEUED_PER_SHARE_ENV, raising=False)
    assert queued_per_share() == 256
    monkeypatch.setenv(QUEUED_PER_SHARE_ENV, "12")
    assert queued_per_share() == 12
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv(QUEUED_PER_SHARE_ENV, bad)
        with pytest.raises(ValueError, match="REFILL_QUEUED_PER_SHARE=.*positive integer"):
            queued_per_share()


def shared_fleet(ledger) -> tuple[Driver, Driver]:
    """Run A (share 3): three attempts running and three queued; run B (share 1): two queued."""
    a, b = two_runs(ledger, 3, 1)
    metered(a, 2, run_id=a.run_id)
    metered(b, 2, run_id=b.run_id)
    a.start_all([x.id for x in a.attempts(state=AttemptState.QUEUED.value)][:3])
    return a, b


def test_the_read_side_tells_each_runs_share_and_attempts_in_flight(ledger) -> None:
    a, b = shared_fleet(ledger)
    with read_snapshot(ledger) as session:
        runs = {r["run_id"]: r for r in list_runs(session)}
        fleet = {r["run_id"]: r for r in fleet_shares(session)}
    assert (runs[a.run_id]["share"], runs[a.run_id]["running"], runs[a.run_id]["queued"]) == (3.0, 3, 3)
    assert (runs[b.run_id]["share"], runs[b.run_id]["running"], runs[b.run_id]["queued"]) == (1.0, 0, 2)
    assert fleet[a.run_id]["entitled_fraction"] == pytest.approx(0.75)
    assert fleet[a.run_id]["running_fraction"] == 1.0 and fleet[b.run_id]["running_fraction"] == 0.0


def test_refill_runs_and_workers_show_them(tmp_path) -> None:
    from typer.testing import CliRunner

    from refill.admin.cli import app

    url = f"sqlite:///{tmp_path}/refill.db"
    upgrade(url)
    ledger = Ledger(url)
    try:
        a, _ = shared_fleet(ledger)
    finally:
        ledger.dispose()
    runner = CliRunner()
    workers = runner.invoke(app, ["workers", "--database-url", url])
    assert workers.exit_code == 0, workers.output
    assert "runs on the fleet" in workers.stdout and "75%" in workers.stdout
    as_json = json.loads(runner.invoke(app, ["workers", "--database-url", url, "--json"]).stdout)
    assert {r["run_id"]: r["queued"] for r in as_json["runs"]} == {a.run_id: 3, a.run_id + 1: 2}
    listing = runner.invoke(app, ["runs", "--database-url", url])
    assert listing.exit_code == 0 and "3 running + 3 queued" in listing.stdout


def test_a_run_whose_stored_config_no_longer_validates_is_still_listed(ledger) -> None:
    from sqlalchemy import update

    from refill.models.tables import Run
    from tests.support.driver import BASE_CONFIG, merged

    d = Driver(ledger, check=False)
    broken = merged(BASE_CONFIG, {"run": {"share": "a lot"}})
    ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(config=broken)))
    with read_snapshot(ledger) as session:
        (row,) = [r for r in list_runs(session) if r["run_id"] == d.run_id]
    assert row["share"] is None and row["status"] == "running"


def test_a_metered_pass_reads_its_runs_with_their_locks_and_counts_in_one_statement(ledger) -> None:  # type: ignore[no-untyped-def]
    """The consumer's relay pass (its batch's attempts, metered): the runs' status and config
    hash, the metering locks (PostgreSQL) and the queued counts are one statement, before the
    due attempts are read; no claim is written before the attempts are marked queued."""
    from sqlalchemy import event

    a, _ = two_runs(ledger)
    unsent = [x.id for x in a.attempts(state=AttemptState.PENDING.value)]
    assert by_run(metered(a, 3, ids=unsent[:1])) == {a.run_id: 1}  # the run's settings parsed
    statements: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        spelled = " ".join(statement.split()).lower()
        if spelled.startswith(("select", "update", "insert", "delete")):
            statements.append(spelled)

    def go(session):  # type: ignore[no-untyped-def]
        sent = claim_outbox(
            session, claimer="consumer", now=a.now, only=ToSend(tuple(unsent[1:]), run_ids=(a.run_id,)),
            queued_per_share=3, claim_seconds=None,
        )
        mark_sent(session, sent, a.now)
        return sent

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        sent = a.ledger.transaction(go)
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    assert by_run(sent) == {a.run_id: 5}  # the window of 6, less the one sent before
    assert not [s for s in statements if s.startswith("select runs.")], statements
    assert len(statements) == 3, statements  # the room (with the runs), due attempts, attempts queued
    assert all(a.attempt(m.attempt_id).state == "queued" and a.attempt(m.attempt_id).dispatched_at == a.now for m in sent)


def test_a_run_another_relay_is_metering_gets_no_room_this_pass(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    from refill.models.outbox import _METER_LOCK

    a, b = two_runs(pg_ledger)
    with pg_ledger.engine.connect() as other:
        holding = other.begin()
        assert other.execute(text("SELECT pg_try_advisory_xact_lock(:k, :r)"), {"k": _METER_LOCK, "r": a.run_id}).scalar()
        with pg_ledger.session() as session:
            assert queue_room(session, [a.run_id, b.run_id], 3) == {a.run_id: 0, b.run_id: 3}
        assert by_run(metered(a, 3)) == {b.run_id: 3}  # A's rows wait for the other relay
        holding.rollback()
    assert by_run(metered(a, 3)) == {a.run_id: 6}
