"""Adaptive over-dispatch (models/overdispatch.py): which step gets extras, how many, and
what happens to extras whose step no longer needs them.

The Driver's steps have 4 slots; before any group is seen the estimate of p is its prior, 0.25."""

from __future__ import annotations

import pytest

from refill.models.results import Outcome
from tests.support import plans
from tests.support.driver import FLAT, SPREAD, Driver


def over_dispatch(lookahead: int, sigmas: float) -> dict:
    return {"async_rl": {"max_lookahead_versions": lookahead, "over_dispatch": {"enabled": True, "safety_sigmas": sigmas}}}


class Rollback(Exception):
    """Carries a look out of a transaction, rolling back what it changed."""


def extras(d: Driver, step: int) -> list:
    return [a for a in d.live(step) if a.slot_idx is None]


def test_only_the_newest_admitted_step_gets_extras(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, over_dispatch(lookahead=1, sigmas=0.0))
    assert d.admit() == [0, 1]
    # Step 0's extras would generate with weights too old for any step after it; step 0 borrows
    # from step 1 instead. Step 1: 4 slots at p = 0.25 need ceil(4 / 0.75) = 6 attempts.
    assert extras(d, 0) == [] and d.step(0).extras == 0
    assert len(extras(d, 1)) == d.step(1).extras == 2
    assert all(a.reason == "extra" for a in extras(d, 1))


def test_the_margin_is_above_the_need_without_lookahead_and_below_it_with(ledger) -> None:  # type: ignore[no-untyped-def]
    # m(1-p) - z sqrt(m p (1-p)) >= 4 at p = 0.25: z = +1 needs 7 attempts, z = -1 needs 5.
    without = Driver(ledger, over_dispatch(lookahead=0, sigmas=1.0))
    assert without.admit() == [0]
    assert len(extras(without, 0)) == 3
    lending = Driver(ledger, over_dispatch(lookahead=1, sigmas=1.0))
    assert lending.admit() == [0, 1]
    assert len(extras(lending, 1)) == 1


def test_unstarted_extras_of_a_released_step_move_to_the_newest_open_step(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()
    stranded = [a.id for a in extras(d, 1)]
    assert len(stranded) == 2
    for idx in range(4):
        assert d.commit_slot(1, idx, SPREAD, version=0).outcome is Outcome.COMMITTED
    assert d.step(1).status == "released" and d.step(0).status == "open"
    # Not started yet: they can still serve step 0, with step 0's staleness floor.
    moved = [d.attempt(a) for a in stranded]
    assert [(a.step, a.slot_idx, a.state) for a in moved] == [(0, None, "pending")] * 2
    assert all(a.min_weight_version == 0 for a in moved)


def test_an_extra_does_not_displace_an_attempt_generating_with_weights_too_old_for_a_later_step(ledger) -> None:  # type: ignore[no-untyped-def]
    # Without lookahead every running attempt of step 0 is generating with weights no later
    # step may train: displaced, it would come back to a full step and be lost.
    d = Driver(ledger, over_dispatch(lookahead=0, sigmas=1.0))
    d.admit()
    running = d.live_of(0, 0)
    d.start(running.id)
    first, second = extras(d, 0)[:2]
    assert d.finish_one(first.id, SPREAD).outcome is Outcome.COMMITTED
    assert d.slot(0, 0).status == "open" and d.live_of(0, 0).id == running.id
    assert d.slot(0, 1).group_attempt_id == first.id  # the next slot, whose attempt had not started
    for idx in (2, 3):
        d.commit_slot(0, idx)
    # Step 0's last open slot is its tail: it no longer waits on its slowest generation.
    assert d.finish_one(second.id, SPREAD).outcome is Outcome.COMMITTED
    assert d.slot(0, 0).group_attempt_id == second.id and d.step(0).status == "released"
    assert d.attempt(running.id).slot_idx is None  # an extra now: cancelled with the step


def test_a_parked_group_fills_the_last_open_slot_of_a_step(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, over_dispatch(lookahead=0, sigmas=1.0))
    d.admit()
    d.start_all([d.live_of(0, idx).id for idx in range(4)])
    extra = extras(d, 0)[0]
    # Every open slot's attempt is running with old weights: the group has nowhere to go.
    assert d.finish_one(extra.id, SPREAD).outcome is Outcome.COMMITTED
    assert d.group(extra.id).parked
    for idx in (1, 2, 3):
        d.commit_slot(0, idx)
    # The step is down to its last slot: the parked group fills it rather than wait for (0, 0).
    assert d.slot(0, 0).group_attempt_id == extra.id and not d.group(extra.id).parked
    assert d.step(0).status == "released"
    # Generated for this very step: not a group promoted from a later one (the slots'
    # `borrowed_in`, which the metric summed, counts this placement too).
    assert d.metrics(0).promoted_prompt_groups == 0


def test_tail_fraction_sets_how_many_last_slots_may_displace_a_slow_attempt(ledger) -> None:  # type: ignore[no-untyped-def]
    # Lookahead 0: every running attempt of step 0 generates with weights no later step may
    # train. Two of four slots open, both running: in the tail only if it is two slots long.
    outcomes = {}
    for fraction in (0.01, 0.5):
        config = over_dispatch(lookahead=0, sigmas=1.0)
        config["async_rl"]["over_dispatch"]["tail_fraction"] = fraction
        d = Driver(ledger, config)
        d.admit()
        running = [d.live_of(0, idx) for idx in (0, 1)]
        d.start_all([a.id for a in running])
        for idx in (2, 3):
            d.commit_slot(0, idx)
        extra = extras(d, 0)[0]
        assert d.finish_one(extra.id, SPREAD).outcome is Outcome.COMMITTED
        outcomes[fraction] = (d.group(extra.id).parked, d.slot(0, 0).group_attempt_id == extra.id)
        if fraction == 0.5:
            assert d.attempt(running[0].id).slot_idx is None  # displaced: an extra of its step now
    assert outcomes == {0.01: (True, False), 0.5: (False, True)}


def test_run_detail_counts_parked_groups_no_step_can_still_train_as_expired(ledger) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import update

    from refill.admin.run_queries import run_detail
    from refill.models.tables import Group

    d = Driver(ledger, over_dispatch(lookahead=0, sigmas=1.0), check=False)
    d.admit()
    d.start_all([d.live_of(0, idx).id for idx in range(4)])
    extra = extras(d, 0)[0]
    assert d.finish_one(extra.id, SPREAD).outcome is Outcome.COMMITTED and d.group(extra.id).parked

    def groups() -> dict:
        return d.query(lambda s: run_detail(s, d.run_id)["groups"])

    # Weights v0 may train step 0, still open: parked, not expired.
    assert (groups()["parked"], groups()["parked_expired"]) == (1, 0)
    # Weights older than any open step may train (lookahead 0): expired.
    d.ledger.transaction(lambda s: s.execute(update(Group).where(Group.attempt_id == extra.id).values(weight_version=-1)))
    assert (groups()["parked"], groups()["parked_expired"]) == (1, 1)
    d.ledger.transaction(lambda s: s.execute(update(Group).where(Group.attempt_id == extra.id).values(weight_version=0)))
    d.stop()
    assert (groups()["parked"], groups()["parked_expired"]) == (1, 1)  # the run ended


def test_a_step_the_reaper_releases_hands_its_unstarted_extras_to_the_newest_open_step(ledger) -> None:  # type: ignore[no-untyped-def]
    # The reaper releases step 1 by shrinking its last slot (a dropped prompt): its extras move
    # in the same transaction, as they do when a batch of results releases it.
    config = over_dispatch(lookahead=1, sigmas=0.0)
    config["rollout_failure"] = {"on_dropped_prompt": "shrink", "max_attempts_per_prompt": 1, "min_step_batch_fraction": 0.5}
    d = Driver(ledger, config)
    d.admit()
    stranded = [a.id for a in extras(d, 1)]
    assert len(stranded) == 2
    for idx in range(3):
        d.commit_slot(1, idx, SPREAD, version=0)
    last = d.live_of(1, 3)
    d.start(last.id)
    d.tick(61)
    assert d.reap().attempts == 1
    assert d.slot(1, 3).status == "shrunk" and d.step(1).status == "released"
    assert [(a.step, a.slot_idx, a.state) for a in map(d.attempt, stranded)] == [(0, None, "pending")] * 2


def test_a_batch_counts_what_it_has_not_written_as_a_write_would(ledger) -> None:  # type: ignore[no-untyped-def]
    """Over-dispatch counts the newest step's live attempts and the parked groups in the
    database plus what the batch changed in memory (`RowStore.unwritten_change`): the same
    numbers as counting after writing the batch."""
    from sqlalchemy import func, select

    from refill.models.context import ATTEMPT_COLUMNS, GROUP_COLUMNS, RunContext
    from refill.models.rows import AttemptRow, GroupRow
    from refill.models.slots import LIVE
    from refill.models.tables import Attempt, Group

    d = Driver(ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()
    d.commit_slot(1, 0, SPREAD, version=0)
    attempts, groups = Attempt.__table__, Group.__table__

    def counted(session, run_id):  # type: ignore[no-untyped-def]
        live = session.scalar(select(func.count()).where(attempts.c.run_id == run_id, attempts.c.step == 1, attempts.c.state.in_(LIVE)))
        parked = session.scalar(select(func.count()).where(groups.c.run_id == run_id, groups.c.parked.is_(True)))
        return live, parked

    def look(session):  # type: ignore[no-untyped-def]
        ctx = RunContext.open(session, d.run_id, d.now)
        rows = ctx.rows
        live = rows.load(AttemptRow, select(*ATTEMPT_COLUMNS).where(attempts.c.run_id == d.run_id).order_by(attempts.c.id))
        (group,) = rows.load(GroupRow, select(*GROUP_COLUMNS).where(groups.c.run_id == d.run_id))
        original = counted(session, d.run_id)
        # Changes of every kind: one attempt finishes, one moves to step 1, a new one is made
        # there, a group is parked.
        step_1 = [a for a in live if a.step == 1 and a.state in LIVE]
        step_0 = [a for a in live if a.step == 0 and a.state in LIVE]
        step_1[0].state, step_1[0].failure_kind, step_1[0].finished_at = "failed", "infra", d.now
        step_0[0].step = 1
        ctx.new_attempt({**{k: v for k, v in step_1[1].__dict__.items() if k != "id"}, "slot_idx": None, "reason": "extra"})
        group.parked = True
        before = counted(session, d.run_id)  # as the database holds it (SQLite inserted the new row)
        expected = (
            before[0] + rows.unwritten_change(AttemptRow, lambda r: r["state"] in LIVE and r["step"] == 1),
            before[1] + rows.unwritten_change(GroupRow, lambda r: bool(r["parked"])),
        )
        ctx.flush()
        assert expected == counted(session, d.run_id) == (original[0] + 1, original[1] + 1)
        raise Rollback

    with pytest.raises(Rollback):
        ledger.transaction(look)


def test_a_batch_that_dispatches_extras_writes_each_table_once(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """Two filtered groups (their slots take spare prompts) and a committed one: over-dispatch
    sends another extra, and the batch's rows, its replacements and the extra go out together,
    one INSERT or UPDATE per table (it used to write the batch before counting, then the extra)."""
    from sqlalchemy import event

    d = Driver(pg_ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()
    d.start_all([a.id for a in d.live()])
    assert len(extras(d, 1)) == 2
    batch = [d.result(d.live_of(1, 0).id, FLAT), d.result(d.live_of(1, 1).id, FLAT), d.result(d.live_of(1, 2).id, SPREAD)]
    writes: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        words = statement.split()
        if words[0] in ("INSERT", "UPDATE"):
            writes.append(f"{words[0]} {words[2] if words[0] == 'INSERT' else words[1]}")
        elif words[0] == "COPY":  # a table's many new rows on PostgreSQL (driver.insert_rows)
            writes.append(f"INSERT {words[1]}")

    event.listen(pg_ledger.engine, "before_cursor_execute", record)
    try:
        d.record(*batch)
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", record)
    assert len(extras(d, 1)) == 3
    assert "INSERT attempts" in writes and "UPDATE attempts" in writes
    assert sorted(writes) == sorted(set(writes)), writes


def test_the_extras_of_a_top_up_take_their_spares_with_one_read(pg_ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Over-dispatch knows how many extras it sends: it loads their spare prompts with one read
    (`RunContext.reserve_spares`), not one chunk after another (hundreds of extras a step)."""
    from sqlalchemy import event

    from refill.models import context as context_module

    monkeypatch.setattr(context_module, "SPARE_CHUNK", 1)  # a chunk smaller than the top-up
    spare_reads: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if plans.is_read(statement) and "FROM spare_prompts" in statement:
            spare_reads.append(statement)

    d = Driver(pg_ledger, over_dispatch(lookahead=1, sigmas=0.0))
    event.listen(pg_ledger.engine, "before_cursor_execute", record)
    try:
        assert d.admit() == [0, 1]
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", record)
    assert len(spare_reads) == 1, spare_reads
    # The extras took the pool's oldest spares, in the order they were added, one each.
    from sqlalchemy import select

    from refill.models.tables import SparePrompt

    spares = d.query(
        lambda s: s.execute(
            select(SparePrompt.prompt_id, SparePrompt.taken_by_attempt).where(SparePrompt.run_id == d.run_id).order_by(SparePrompt.id)
        ).all()
    )
    made = extras(d, 1)
    assert len(made) == 2
    assert spares[:2] == [(a.prompt_id, a.id) for a in made]
    assert all(taker is None for _, taker in spares[2:])


def _count_statements(ledger, run):  # type: ignore[no-untyped-def]
    """The SELECTs with a count that `run` sends, and what it returns."""
    from sqlalchemy import event

    seen: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if plans.is_read(statement) and "count(" in statement:
            seen.append(statement)

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        return seen, run()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)


def test_a_batch_reads_over_dispatchs_counts_with_its_other_reads(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """The live attempts and parked groups over-dispatch counts come with the batch's first
    read-ahead: no statement of their own, and the same extras as when counted alone."""
    d = Driver(pg_ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()
    d.start_all([a.id for a in d.live()])
    assert len(extras(d, 1)) == 2
    batch = [d.result(d.live_of(1, 0).id, FLAT), d.result(d.live_of(1, 1).id, FLAT), d.result(d.live_of(1, 2).id, SPREAD)]
    seen, _ = _count_statements(pg_ledger, lambda: d.record(*batch))
    assert len(extras(d, 1)) == 3  # as test_a_batch_that_dispatches_extras_writes_each_table_once
    assert len(seen) == 1 and "json_agg" in seen[0], seen


def test_counts_read_ahead_are_not_used_once_the_batch_wrote_rows(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A count read before a write is not the database's count after it: `top_up` counts
    again when the batch wrote rows after its read-ahead (a cache that ran short flushes)."""
    from refill.models.context import RunContext
    from refill.models.overdispatch import counted, counts_read, top_up

    d = Driver(pg_ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()

    def look(write: bool):  # type: ignore[no-untyped-def]
        def transaction(session):  # type: ignore[no-untyped-def]
            ctx = RunContext.open(session, d.run_id)
            read = counts_read(ctx)
            assert read is not None
            ahead = counted(ctx, read, ctx.rows.load_all([read])[0])
            assert (ahead.step, ahead.live) == (1, 6)  # 4 slots and 2 extras, none finished
            if write:
                ctx.run.scored_groups += 1
                ctx.flush()
            seen, _ = _count_statements(pg_ledger, lambda: top_up(ctx, ahead))
            raise Rollback(seen)

        with pytest.raises(Rollback) as looked:
            pg_ledger.transaction(transaction)
        return looked.value.args[0]

    assert look(write=False) == []
    assert len(look(write=True)) == 1


def _live_attempts_by_slot(ledger, run):  # type: ignore[no-untyped-def]
    """The kind of each statement `run` sends that finds live attempts by their slots: UPDATE
    for one that changes them (the hand-over locks them first, in a CTE), else its first word."""
    from sqlalchemy import event

    seen: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if "attempts.slot_idx IN" in statement:
            seen.append("UPDATE" if "UPDATE attempts SET" in statement else statement.split()[0])

    event.listen(ledger.engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", record)
    return seen


def test_a_batch_hands_the_open_slots_live_attempts_over_with_its_write_without_reading_them(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A group placed in an open slot hands the slot's live attempt over to the extras: a batch
    that places some hands those it never read over in one UPDATE by slot, with its write, and
    reads none of them; a batch whose groups fill only their own slots sends neither (most
    batches of a step)."""
    d = Driver(pg_ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()
    d.start_all([a.id for a in d.live()])
    own = [d.result(d.live_of(1, idx).id, SPREAD) for idx in (0, 1)]
    assert _live_attempts_by_slot(pg_ledger, lambda: d.record(*own)) == []
    first, second = extras(d, 1)
    displaced = {d.live_of(0, 0).id, d.live_of(0, 1).id}
    sent = _live_attempts_by_slot(pg_ledger, lambda: d.record(d.result(first.id, SPREAD), d.result(second.id, SPREAD)))
    assert sent == ["UPDATE"], sent
    # Both extras filled the earliest open slots they may (step 0's first two), whose own
    # attempts now serve that step as extras.
    from refill.models.results import committed_slot_of

    placed = {d.query(lambda s, a=a: committed_slot_of(s, d.run_id, a.id)) for a in (first, second)}
    assert placed == {(0, 0), (0, 1)}
    assert {a.id for a in extras(d, 0)} == displaced
    assert {d.attempt(a).reason for a in displaced} == {"extra"}


def test_a_slot_filled_with_no_live_attempt_hands_nothing_over_and_the_batch_stands(ledger) -> None:  # type: ignore[no-untyped-def]
    """The hand-over by slot matches the slot's one live attempt, or none: an extra's group that
    fills an open slot whose attempt is gone (cancelled by hand here) commits, and no other
    attempt is touched."""
    from sqlalchemy import update

    from refill.models.tables import Attempt

    d = Driver(ledger, over_dispatch(lookahead=1, sigmas=0.0), check=False)
    d.admit()
    d.start_all([a.id for a in d.live()])
    gone = d.live_of(0, 0).id
    d.query(lambda s: s.execute(update(Attempt).where(Attempt.id == gone).values(state="cancelled")))
    first, _ = extras(d, 1)
    before = {a.id: (a.step, a.slot_idx, a.reason) for a in d.live()}
    batch = d.record(d.result(first.id, SPREAD))
    assert [o.outcome.value for o in batch.outcomes] == ["COMMITTED"]
    from refill.models.results import committed_slot_of

    assert d.query(lambda s: committed_slot_of(s, d.run_id, first.id)) == (0, 0)
    after = {a.id: (a.step, a.slot_idx, a.reason) for a in d.live()}
    assert after == {i: place for i, place in before.items() if i != first.id}
    assert d.attempt(gone).state == "cancelled"


def test_a_batch_reads_its_attempts_and_their_slots_in_one_statement(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """Before it decides, a batch of results reads what it will look up (its attempts, the slots
    they serve, the run's steps and its caches' first loads) in one statement, whose text is the
    same for every batch (so that psycopg prepares it), and reads no slot on its own after."""
    import re

    from sqlalchemy import event

    from refill.models.tables import Slot

    d = Driver(pg_ledger, over_dispatch(lookahead=1, sigmas=0.0))
    d.admit()
    d.start_all([a.id for a in d.live()])
    reads: list[str] = []

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        if plans.is_read(statement) and re.search(r"(FROM|JOIN)\s+slots\b", statement):
            reads.append(statement)

    event.listen(pg_ledger.engine, "before_cursor_execute", record)
    try:
        for idx in (0, 1):
            d.record(d.result(d.live_of(1, 2 * idx).id, SPREAD), d.result(d.live_of(1, 2 * idx + 1).id, [1.0] * 4))
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", record)
    assert len(reads) == 2 and reads[0] == reads[1], reads
    # the slots probed from the attempts' rows (sql.slots_of_attempts), in the same statement
    assert re.search(r"FROM batch_attempts JOIN LATERAL \(SELECT slots\.", reads[0]) and "%(attempt_ids)s" in reads[0]
    # Each batch committed one group into its own slot and filtered the other's.
    committed = d.query(lambda s: {(slot.idx, slot.status) for slot in s.query(Slot).filter_by(run_id=d.run_id, step=1).filter(Slot.idx < 4)})
    assert committed == {(0, "committed"), (1, "open"), (2, "committed"), (3, "open")}


def test_a_hand_over_by_slot_leaves_alone_an_attempt_the_transaction_made_for_that_slot(ledger) -> None:  # type: ignore[no-untyped-def]
    """A slot handed over by its slot (its live attempt never read) may open again in the same
    batch (its group lent) and take a new attempt before the write: until the write the batch
    sees only that one there (`live_attempt`), and the UPDATE by slot hands over the attempt
    the slot had, not the one the transaction made for it."""
    from refill.models.context import RunContext
    from refill.models.slots import dispatch
    from refill.models.tables import AttemptReason

    d = Driver(ledger, check=False)  # the slot is left with a live attempt of its own again
    d.admit()
    old = d.live_of(0, 0).id

    def act(session):  # type: ignore[no-untyped-def]
        with RunContext.open(session, d.run_id) as ctx:
            slot = ctx.slot(0, 0)
            ctx.hand_over(slot)
            assert ctx.rows.handed_over == {d.run_id: [(0, 0)]}  # not read: by its slot, at the write
            # Until then the slot has no attempt but those made here: the one it had is an extra.
            assert ctx.live_attempt(slot) is None
            made = dispatch(ctx, step=0, slot=slot, prompt_id=slot.prompt_id, reason=AttemptReason.RETRY)
            assert ctx.live_attempt(slot) is made
            return made.id

    made = ledger.transaction(act)
    assert (d.attempt(old).slot_idx, d.attempt(old).reason) == (None, "extra")
    assert (d.attempt(made).step, d.attempt(made).slot_idx, d.attempt(made).reason) == (0, 0, "retry")
