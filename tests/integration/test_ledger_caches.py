"""What a transaction keeps in memory instead of asking the database again: ids drawn in
blocks from the sequences, and the prefix of waiting slots a batch's placements look at."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import event, select

from refill.models import context as context_module
from refill.models import rollout_codec
from refill.models.context import RunContext
from refill.models.ids import FIRST_BLOCK, IdBlocks
from refill.models.results import Outcome
from refill.models.slots import shrink
from refill.models.tables import (
    Attempt,
    Group,
    ShrinkReason,
    Slot,
    SlotStatus,
    Step,
    StepStatus,
)
from tests.support.driver import FLAT, SPREAD, Driver


def _waiting_truth(session, run_id: int, limit: int) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    session.flush()
    return [
        (slot.step, slot.idx)
        for slot in session.scalars(
            select(Slot)
            .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
            .where(
                Slot.run_id == run_id,
                Slot.status == SlotStatus.OPEN.value,
                Slot.needs_replacement.is_(True),
                Step.status == StepStatus.OPEN.value,
            )
            .order_by(Slot.step, Slot.idx)
            .limit(limit)
        )
    ]


class Rollback(Exception):
    """Ends a transaction that changed rows in memory only to look at the caches."""


def test_placements_see_the_first_waiting_slots_when_the_loaded_prefix_runs_short(ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 8}}, num_prompts=80)
    d.admit()
    for step, idx in [(0, 0), (0, 2), (0, 3), (0, 5), (0, 7), (1, 1), (1, 4), (1, 6)]:
        d.filter_slot(step, idx)  # nothing to borrow: a spare replacement, the slot waits
    # A prefix of 3 for a batch of one result looking at 1 slot per placement.
    monkeypatch.setattr(context_module, "PLACEMENT_CHOICES", 1)

    def look(session):  # type: ignore[no-untyped-def]
        ctx = RunContext.open(session, d.run_id, d.now)
        ctx.size_caches(1)
        assert [(s.step, s.idx) for s in ctx.waiting_up_to(1, 2)] == [(0, 0), (0, 2)]
        assert len(ctx.waiting()) == 3  # only the prefix was loaded
        # The batch settles the first two: one loaded slot is left, fewer than asked for.
        for idx in (0, 2):
            shrink(ctx, ctx.slot(0, idx), ShrinkReason.END_OF_DATA)
        assert [(s.step, s.idx) for s in ctx.waiting_up_to(1, 2)] == _waiting_truth(session, d.run_id, 2)
        # A slot that starts waiting in memory, past the loaded prefix, does not jump ahead of
        # stored waiting slots that were not loaded.
        late = ctx.slot(1, 7)
        late.needs_replacement = True
        ctx.waiting_added(late)
        got = [(s.step, s.idx) for s in ctx.waiting_up_to(1, 5)]
        assert got == _waiting_truth(session, d.run_id, 5)
        assert got == [(0, 3), (0, 5), (0, 7), (1, 1), (1, 4)]
        raise Rollback

    with pytest.raises(Rollback):
        ledger.transaction(look)


def test_a_batch_reads_the_spares_its_filtered_results_take_and_more_when_they_run_short(ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A batch's read-ahead loads as many spare prompts as it has zero-variance results (and a
    margin, here none); when the batch takes more, the next are read (no write first), in the
    pool's order, none twice."""
    from refill.models.tables import SparePrompt

    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 8}}, num_prompts=80)
    d.admit()
    sized = RunContext.size_caches

    def no_margin(ctx, results, filtered=0):  # type: ignore[no-untyped-def]
        sized(ctx, results, filtered)
        ctx._spare_chunk = max(1, filtered - 2)  # shorter than the batch's need

    monkeypatch.setattr(RunContext, "size_caches", no_margin)
    pool = d.spare_pool()
    d.start_all([a.id for a in d.live(0)])
    batch = [d.result(d.live_of(0, idx).id, FLAT) for idx in (1, 3, 4, 6)]  # nothing to borrow
    assert [r.outcome.value for r in d.record(*batch).outcomes] == ["FILTERED"] * 4
    taken = d.query(
        lambda s: s.execute(
            select(SparePrompt.prompt_id).where(SparePrompt.run_id == d.run_id, SparePrompt.taken_at.is_not(None)).order_by(SparePrompt.id)
        ).scalars().all()
    )
    assert [d.position(p) for p in taken] == pool[:4]
    assert d.spare_pool()[: len(pool) - 4] == pool[4:]  # the rest, in order (a refill comes after)
    assert sorted(a.prompt_id for a in d.live(0) if a.reason != "first") == sorted(taken)


def test_an_unsized_cache_loads_every_waiting_slot_up_to_its_chunk(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 8}}, num_prompts=80)
    d.admit()
    for idx in (1, 3, 6):
        d.filter_slot(0, idx)

    def look(session):  # type: ignore[no-untyped-def]
        ctx = RunContext.open(session, d.run_id, d.now)
        assert sorted(ctx.waiting()) == [(0, 1), (0, 3), (0, 6)]
        assert [(s.step, s.idx) for s in ctx.waiting_up_to(0, 32)] == [(0, 1), (0, 3), (0, 6)]
        assert ctx.waiting_up_to(-1, 32) == []

    ledger.transaction(look)


def test_new_rows_get_ids_in_the_order_they_are_made(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 40}}, num_prompts=200)
    d.admit()
    attempts = d.attempts()
    # Admission makes each slot's attempt in slot order, pending: its generate message, due now.
    by_slot = sorted((a for a in attempts if a.slot_idx is not None and a.step == 0), key=lambda a: a.slot_idx)
    assert [a.id for a in by_slot] == sorted(a.id for a in by_slot)
    assert all(a.state == "pending" and a.available_at == d.now for a in by_slot)


def test_id_blocks_grow_and_never_hand_out_an_id_twice(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """Two transactions drawing at once get disjoint ids; a block doubles up to the cap."""
    drawn: dict[str, list[int]] = {}
    barrier = threading.Barrier(2)

    def draw(name: str) -> None:
        with pg_ledger.session() as session:
            blocks = IdBlocks.for_session(session)
            assert blocks.enabled
            ids = []
            for i in range(5 * FIRST_BLOCK):
                if i == FIRST_BLOCK:
                    barrier.wait(timeout=30)  # both hold a block: the next ones interleave
                ids.append(blocks.next("attempts"))
            assert blocks.ids("outbox").keys() == {"id"}
            drawn[name] = ids

    sizes: list[int] = []

    def count_draws(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "nextval" in statement and "attempts" in parameters["ids_sequence0"]:
            sizes.append(parameters["ids_count0"])

    threads = [threading.Thread(target=draw, args=(name,)) for name in ("a", "b")]
    event.listen(pg_ledger.engine, "before_cursor_execute", count_draws)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", count_draws)
    a, b = drawn["a"], drawn["b"]
    assert len(a) == len(b) == 5 * FIRST_BLOCK
    assert a == sorted(a) and b == sorted(b)
    assert not set(a) & set(b)
    # 16, then 32, then 64: three queries for 80 ids in each transaction. (A block's ids are
    # not contiguous when another transaction draws at the same moment: nextval is per row.)
    assert sorted(sizes) == [FIRST_BLOCK, FIRST_BLOCK, 2 * FIRST_BLOCK, 2 * FIRST_BLOCK, 4 * FIRST_BLOCK, 4 * FIRST_BLOCK]


def test_expected_tables_draw_their_first_blocks_in_one_query(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """`expect` sizes the first block of each table a batch makes rows in and draws them all
    together; ids keep ascending through the blocks that follow, and a table already holding
    free ids uses those first."""
    statements: list[str] = []

    def count_draws(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "nextval" in statement:
            statements.append(statement)

    with pg_ledger.session() as session:
        blocks = IdBlocks.for_session(session)
        left_over = blocks.next("outbox")  # a block of FIRST_BLOCK outbox ids, one used
        event.listen(pg_ledger.engine, "before_cursor_execute", count_draws)
        try:
            blocks.expect({"attempts": 40, "outbox": 40, "spare_prompts": 0})
            attempts = [blocks.next("attempts") for _ in range(40)]
            outbox = [blocks.next("outbox") for _ in range(40 + FIRST_BLOCK - 1)]
            assert len(statements) == 1  # both tables' blocks, one query; no spare_prompts block
            more = [blocks.next("attempts") for _ in range(80)]  # then blocks of 80 as before
            assert len(statements) == 2
        finally:
            event.remove(pg_ledger.engine, "before_cursor_execute", count_draws)
    assert attempts + more == sorted(attempts + more) and len(set(attempts + more)) == 120
    # The leftover block first: 55 ids from one query of 40 needed the 15 already free.
    assert outbox == sorted(outbox) and outbox[0] > left_over
    assert len(set(outbox)) == len(outbox)


def test_a_batch_of_results_draws_its_ids_with_its_reads(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A batch's first blocks of attempt and outbox ids come in its joint read, not in a query
    of their own; the filtered results' replacements and their messages get ids from them,
    unused before, in the order they were made."""
    d = Driver(pg_ledger)
    d.admit()
    before = {a.id for a in d.attempts()}
    live = d.live()
    d.start_all([a.id for a in live])
    nextval: list[str] = []

    def count_draws(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "nextval" in statement:
            nextval.append(statement)

    event.listen(pg_ledger.engine, "before_cursor_execute", count_draws)
    try:
        recorded = d.record(*(d.result(a.id, FLAT) for a in live[:3]))
    finally:
        event.remove(pg_ledger.engine, "before_cursor_execute", count_draws)
    assert [r.outcome for r in recorded.outcomes] == [Outcome.FILTERED] * 3
    assert len(nextval) == 1 and "json_agg" in nextval[0], nextval
    made = sorted(a.id for a in d.attempts() if a.id not in before)
    assert len(made) == 3 and made[0] > max(before)
    # What the batch leaves to send is the attempts it made, each pending.
    assert sorted(recorded.to_send.attempt_ids) == made and recorded.to_send.outbox_ids == ()
    assert all(d.attempt(i).state == "pending" for i in made)


def test_sqlite_assigns_its_own_ids(sqlite_ledger) -> None:  # type: ignore[no-untyped-def]
    with sqlite_ledger.session() as session:
        blocks = IdBlocks.for_session(session)
        assert not blocks.enabled and blocks.ids("attempts") == {}
    d = Driver(sqlite_ledger)
    d.admit()
    ids = sorted(a.id for a in d.attempts())
    # The database's own numbering: 1, 2, 3, ... with no blocks drawn ahead.
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    with sqlite_ledger.session() as session:
        assert session.scalar(select(Attempt.id).order_by(Attempt.id.desc()).limit(1)) == ids[-1]


def test_lenders_leave_out_parked_groups_too_stale_for_every_open_step(ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Parked groups that expired stay parked; loaded oldest first, enough of them would hide
    every parked group still lendable."""
    d = Driver(ledger, {"grpo": {"max_num_steps": 6}}, num_prompts=80)
    d.admit()
    for step in (0, 1):
        d.fill_step(step)
        assert d.train(step)
    assert [s.step for s in d.steps() if s.status == "open"] == [2, 3]  # floor: weights >= 1
    monkeypatch.setattr(context_module, "LENDER_CHOICES", 1)  # a prefix of 3 for one result

    def look(session):  # type: ignore[no-untyped-def]
        spare = d.live(3)[:4]
        for attempt, version in zip(spare, [0, 0, 0, 2], strict=True):
            session.add(
                Group(
                    attempt_id=attempt.id, run_id=d.run_id, prompt_id=attempt.prompt_id,
                    origin_step=3, weight_version=version, rewards=SPREAD, reward_mean=0.5,
                    zero_variance=False, rollout=rollout_codec.encode([1], [])[0], completion_texts=[], num_tokens=4,
                    committed_at=d.now, parked=True, moves=0,
                )
            )
        session.flush()
        ctx = RunContext.open(session, d.run_id, d.now)
        ctx.size_caches(1)
        parked, _, _ = ctx.lendable_parts()
        assert [view.attempt_id for view in parked] == [spare[3].id]
        raise Rollback

    with pytest.raises(Rollback):
        ledger.transaction(look)


@pytest.mark.parametrize("late", ["none", "some", "all"], ids=["one statement", "some late", "all late"])
def test_reads_run_together_return_what_each_query_returns_alone(ledger, late) -> None:  # type: ignore[no-untyped-def]
    """`RowStore.load_all` (one statement on PostgreSQL, the rows carried as JSON) returns the
    same rows, values and types as one query per read: timestamps, floats that are whole
    numbers, JSON, NULLs, each read's order and LIMIT, extra columns and plain tuples; and so
    do reads made `late` (a second statement), each in its place among the others, and reads
    all late (one statement then)."""
    from refill.models import sql
    from refill.models.rows import AttemptRow, Read, RowStore, SlotRow, SpareRow, StepRow

    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 8}, "async_rl": {"max_lookahead_versions": 1}}, num_prompts=80)
    d.admit()
    d.commit_slot(1, 3)
    d.commit_slot(1, 5, rewards=[0.0, 1.0] * 8)  # a reward mean of 0.5, a min and max of 0.0 and 1.0
    d.filter_slot(0, 2)  # borrows from step 1: its slot waits, with timestamps and a float mean
    d.filter_slot(0, 4)
    for idx in (6, 7, 0, 1):  # the first fill step 0's waiting slots, the rest are lenders
        d.commit_slot(1, idx)
    run_id = d.run_id
    attempts_table = Attempt.__table__

    def reads() -> list[Read]:
        committed, parked = sql.lendable(run_id, 1, 16)
        some, every = late != "none", late == "all"
        return [
            Read(AttemptRow, select(*context_module.ATTEMPT_COLUMNS).where(attempts_table.c.run_id == run_id).order_by(attempts_table.c.id.desc()), late=every),
            Read(SlotRow, sql.open_slots(run_id, limit=1, waiting=True), late=every),
            Read(SlotRow, sql.open_slots(run_id, limit=5), late=every),
            Read(SlotRow, committed, extra=("lender_version",), late=every),
            Read(None, parked, extra=("attempt_id", "weight_version"), late=some),
            Read(SpareRow, sql.spares(run_id, 0, 4), late=every),
            Read(StepRow, sql.unfinished_steps(run_id), late=some),
        ]

    def typed(found):  # type: ignore[no-untyped-def]
        def one(item):  # type: ignore[no-untyped-def]
            if isinstance(item, tuple) and item and isinstance(item[0], SlotRow):
                return (one(item[0]), item[1], [type(v) for v in item[1]])
            if isinstance(item, tuple):
                return (item, [type(v) for v in item])
            return sorted((k, v, type(v)) for k, v in item.__dict__.items())
        return [[one(item) for item in rows] for rows in found]

    def look(session):  # type: ignore[no-untyped-def]
        together = RowStore(session).load_all(reads())
        store = RowStore(session)
        alone = [
            store.load(r.cls, r.statement) if r.cls is not None and not r.extra
            else store.load_with(r.cls, r.statement) if r.cls is not None
            else [tuple(row) for row in session.execute(*r.query).all()]
            for r in reads()
        ]
        assert [len(rows) for rows in together] == [len(rows) for rows in alone]
        assert len(together[1]) == 1 and len(together[2]) == 5 and together[3]  # LIMITs held; a lender
        assert [step.step for step in together[6]] == [0, 1]  # in step order, with their timestamps
        assert typed(together) == typed(alone)
        means = {a.reward_mean for a in together[0] if a.reward_mean is not None}
        assert 0.5 in means and any(float(m).is_integer() for m in means)
        assert all(isinstance(m, float) for m in means)
        raise Rollback

    with pytest.raises(Rollback):
        ledger.transaction(look)


def test_a_read_with_a_condition_costs_nothing_where_the_condition_does_not_hold(ledger) -> None:  # type: ignore[no-untyped-def]
    """`Read.when`: on PostgreSQL a read whose condition does not hold comes back None, and its
    subquery is never run (the plan says so); SQLite runs every read (never wrong)."""
    from sqlalchemy import exists

    from refill.models import sql
    from refill.models.rows import Read, RowStore, SlotRow, SpareRow

    d = Driver(ledger, {"grpo": {"num_prompts_per_step": 8}}, num_prompts=80)
    d.admit()
    run_id = d.run_id

    def has_step(number: int) -> Any:  # a condition the planner cannot fold away
        return exists().where(Step.run_id == run_id, Step.step == number)

    def reads() -> list[Read]:
        return [Read(SlotRow, sql.open_slots(run_id, limit=3), when=has_step(0)), Read(SpareRow, sql.spares(run_id, 0, 4), when=has_step(99))]

    def look(session):  # type: ignore[no-untyped-def]
        sent: list[tuple[str, Any]] = []
        connection = session.connection()

        def seen(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
            sent.append((statement, parameters))

        event.listen(connection, "before_cursor_execute", seen)
        try:
            slots, spares = RowStore(session).load_all(reads())
        finally:
            event.remove(connection, "before_cursor_execute", seen)
        assert [(slot.step, slot.idx) for slot in slots] == [(0, 0), (0, 1), (0, 2)]
        if connection.dialect.name != "postgresql":
            assert spares is not None and len(spares) == 4
            raise Rollback
        assert spares is None and len(sent) == 1
        statement, parameters = sent[0]
        plan = [row[0] for row in connection.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + statement, parameters)]
        scans = {table: [line for line in plan if f" on {table}" in line] for table in ("slots", "spare_prompts")}
        assert scans["spare_prompts"] and all("never executed" in line for line in scans["spare_prompts"]), plan
        assert scans["slots"] and not any("never executed" in line for line in scans["slots"]), plan
        raise Rollback

    with pytest.raises(Rollback):
        ledger.transaction(look)


def test_a_batch_reads_the_open_and_waiting_slots_only_where_it_may_place_a_group_in_them(pg_ledger, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under `in_order` a group fills its own slot unless it is an extra's (which may take any
    open slot, `sql.batch_has_extra`) or serves a later step than the first open one (which may
    take a slot waiting on a replacement, `sql.batch_places_elsewhere`): a batch reads the open
    and waiting slots with its first read only where it may, and not later."""
    d = Driver(
        pg_ledger,
        {"grpo": {"num_prompts_per_step": 8}, "async_rl": {"max_lookahead_versions": 1, "over_dispatch": {"enabled": True, "safety_sigmas": 0.0}}},
        num_prompts=80,
    )
    assert d.admit() == [0, 1]
    d.filter_slot(0, 2)  # nothing to borrow yet: a spare replacement goes out, the slot waits
    assert d.slot(0, 2).needs_replacement
    read: list[tuple[str, bool]] = []
    adopt_waiting, adopt_open = RunContext._adopt_waiting, RunContext._adopt_open_slots

    def waiting(self, rows):  # type: ignore[no-untyped-def]
        read.append(("waiting", rows is not None))
        adopt_waiting(self, rows)

    def open_slots(self, rows):  # type: ignore[no-untyped-def]
        read.append(("open", rows is not None))
        adopt_open(self, rows)

    monkeypatch.setattr(RunContext, "_adopt_waiting", waiting)
    monkeypatch.setattr(RunContext, "_adopt_open_slots", open_slots)

    own = d.commit_slot(0, 3)  # the first open step's own group
    assert own.outcome is Outcome.COMMITTED and d.slot(0, 3).group_attempt_id == own.attempt_id
    assert read == [("waiting", False), ("open", False)]  # not read, nor loaded on use

    read.clear()
    later = d.commit_slot(1, 4)  # a later step's group: it fills step 0's waiting slot
    assert d.slot(0, 2).group_attempt_id == later.attempt_id and d.slot(1, 4).status == "open"
    assert read == [("waiting", True), ("open", False)]  # only an extra's takes an open slot

    read.clear()
    extra = next(a for a in d.live(1) if a.slot_idx is None)
    d.start(extra.id)
    assert d.record(d.result(extra.id, SPREAD)).outcomes[0].outcome is Outcome.COMMITTED
    assert read == [("waiting", True), ("open", True)]
    # It filled an open slot (the first, of step 0: an extra may serve any step it can train).
    assert [s.group_attempt_id for step in (0, 1) for s in d.slots(step)].count(extra.id) == 1
