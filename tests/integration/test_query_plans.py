"""The per-batch reads that would otherwise grow with the length of a run are served by their
indexes. Asserted on PostgreSQL's plans, with statistics taken (a plan, unlike a time, does
not vary from run to run)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.dialects import postgresql

from refill.models import sql
from refill.models.tables import Step, StepMetrics, StepStatus
from tests.support import plans
from tests.support.driver import Driver
from tests.support.plans import run_explained, run_explained_generic


def _plan(session, statement, params=None) -> str:  # type: ignore[no-untyped-def]
    sql = str(statement.params(params or {}).compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    return "\n".join(row[0] for row in session.execute(text("EXPLAIN " + sql)))


def first_reads(ledger, d: Driver, batch: list) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def, type-arg]
    """The first read-ahead of recording `batch` (statement, parameters), and any other
    statement of that shape the batch ran."""
    with plans.statements_run(
        ledger, lambda statement, parameters: plans.JOINT_READ in statement and "attempt_ids" in str(parameters)
    ) as reads:
        d.record(*batch)
    return reads


class Looked(Exception):
    """Carries what a transaction saw out of it, rolling back the rows it made up."""


def test_a_long_runs_unfinished_steps_are_read_without_its_trained_ones(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(pg_ledger)
    d.admit()

    def look(session):  # type: ignore[no-untyped-def]
        # A run 5,000 steps in: its trained steps (numbered below its real ones, which stay as
        # they are; made up, and rolled back with the transaction) and a few open ones, as the
        # primary key alone would have to walk.
        session.execute(
            text(
                "INSERT INTO steps (run_id, step, status, num_slots, committed, shrunk, dropped_shrunk, admitted_at, train_claims) "
                "SELECT :run, -g, 'trained', 1, 1, 0, 0, now(), 1 FROM generate_series(1, 5000) g"
            ),
            {"run": d.run_id},
        )
        session.execute(text("ANALYZE steps"))
        unfinished = sql.unfinished_steps(d.run_id)  # what a batch reads
        earliest_open = select(func.min(Step.step)).where(Step.run_id == d.run_id, Step.status == StepStatus.OPEN.value)
        raise Looked(_plan(session, *unfinished), _plan(session, earliest_open), [row.step for row in session.execute(*unfinished)])

    with pytest.raises(Looked) as looked:
        pg_ledger.transaction(look)
    unfinished_plan, earliest_plan, steps = looked.value.args
    assert steps and all(step >= 0 for step in steps)
    assert "ix_steps_unfinished" in unfinished_plan, unfinished_plan
    assert "ix_steps_unfinished" in earliest_plan, earliest_plan


def test_a_metered_relay_pass_reads_its_runs_first_rows_whatever_the_statistics_say(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """The controller's relay asks for its run's first due pending attempts (as many as the
    run's queue has room for). Facing a burst of 5,000 pending attempts that PostgreSQL's
    statistics have not seen (a new ledger's table, never analyzed: an ANALYZE here, of the
    empty table, would mislead the plans of the tests after it), it must still read about as
    many rows as it takes, under the plan made for its values and under the generic plan a prepared statement
    gets, not every pending attempt joined to its prompt and run and sorted. Measured by the
    buffers it touches."""
    from refill.models.outbox import claim_outbox
    from refill.tasks.relay import DEFAULT_QUEUED_PER_SHARE

    d = Driver(pg_ledger, num_prompts=64)
    with pg_ledger.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO attempts (run_id, step, origin_step, prompt_id, try_no, reason, state, "
                "min_weight_version, created_at, available_at) "
                "SELECT :run, 0, 0, (SELECT min(id) FROM prompts WHERE run_id = :run), 1, 'extra', 'pending', 0, "
                "now(), now() - interval '1 second' FROM generate_series(1, 5000)"
            ),
            {"run": d.run_id},
        )

    def relay_pass(session):  # type: ignore[no-untyped-def]
        now = session.execute(text("SELECT now()")).scalar_one()
        return claim_outbox(
            session, claimer="c", now=now, limit=1000, run_id=d.run_id, queued_per_share=DEFAULT_QUEUED_PER_SHARE,
            claim_seconds=None,
        )

    with plans.statements_run(pg_ledger, lambda statement, _: "FROM attempts" in statement and "FOR NO KEY UPDATE" in statement) as statements:
        claimed = pg_ledger.transaction(relay_pass)
    assert len(claimed) == DEFAULT_QUEUED_PER_SHARE and {m.kind for m in claimed} == {"generate"}
    # The pass's read of its attempts, explained as it runs (then rolled back), and again
    # under a generic plan.
    (statement, parameters), = statements
    with pg_ledger.engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET state = 'pending' WHERE run_id = :run"), {"run": d.run_id})
    rows, buffers = run_explained(pg_ledger, statement, parameters)
    assert rows == DEFAULT_QUEUED_PER_SHARE
    assert buffers < 2000, f"a relay pass touched {buffers} buffers for {DEFAULT_QUEUED_PER_SHARE} rows of 5,000: {plans.last_scans[:6]}"
    rows, buffers = run_explained_generic(pg_ledger, statement, parameters)
    assert rows == DEFAULT_QUEUED_PER_SHARE
    assert buffers < 2000, f"a generic plan touched {buffers} buffers for {DEFAULT_QUEUED_PER_SHARE} rows of 5,000"


def test_an_id_list_is_a_constant_the_planner_counts(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """`sql.ids_in` sends its list as the text of an array, untyped, and the statement's cast
    makes that parameter the array itself when PostgreSQL parses it: the planner sees a
    constant and counts its elements (80 ids, 80 rows expected by primary key). Bound as a
    string, which psycopg's dialect casts to varchar, the cast was an expression whose length the
    planner guessed (10), and under such plans the relay and admission read whole tables
    (`bench overhead` took 37-44 s, stop 43)."""
    from refill.models import driver
    from refill.models.tables import Attempt

    attempts = Attempt.__table__
    ids = list(range(10**12, 10**12 + 80))
    statement = select(attempts.c.id).where(sql.ids_in(attempts.c.id, ids))
    with plans.statements_run(pg_ledger, lambda text_, _: "FROM attempts" in text_) as seen:
        with pg_ledger.session() as session:
            assert driver.rows(session, statement, {}) == []
    [(sent, parameters)] = seen
    assert "VARCHAR" not in sent.upper() and list(parameters.values()) == ["{" + ",".join(map(str, ids)) + "}"]
    raw = pg_ledger.engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute("EXPLAIN (FORMAT JSON) " + sent, parameters)
        [[plan]] = cursor.fetchall()
        raw.rollback()
    finally:
        raw.close()
    top = plan[0]["Plan"]
    assert top["Plan Rows"] == len(ids), top


@pytest.mark.parametrize("with_extra", [False, True], ids=["own-groups", "with-an-extra"])
def test_a_batchs_first_read_ahead_under_a_generic_plan_reads_about_its_own_rows(pg_ledger, with_extra) -> None:  # type: ignore[no-untyped-def]
    """The first read of a batch of results (its attempts by id and the slots they serve,
    over-dispatch's counts, the run's unfinished steps, waiting slots, lenders, spare prompts
    and open slots) has the same text for every batch, so psycopg prepares it and PostgreSQL may
    plan it once for any values. That plan must still find the batch's attempts and their slots
    by primary key and the run's rows by their indexes: beside 40,000 attempts and 20,000 slots
    of another run, with no statistics, with statistics from before those rows and with
    statistics after them, it touches under 600 buffers (180-310 when written, 100-190 before
    the slots joined the read; with index scans turned off, about 7,000). A batch that holds an
    extra's result reads the open slots too: under 1,000 (340-500 when written; 609 once in CI,
    when the tests' PostgreSQL still ran autovacuum and "no statistics" meant whatever a
    background analyze had taken)."""
    d = Driver(pg_ledger, {"grpo": {"num_prompts_per_step": 64}, "async_rl": {"over_dispatch": {"enabled": True}}}, num_prompts=512)
    d.admit()
    d.start_all([a.id for a in d.live()])
    batch = [d.result(a.id, [0.0, 1.0, 1.0, 0.0] if i % 3 else [1.0] * 4) for i, a in enumerate(d.live(0)[:16])]
    if with_extra:
        extra = next(a for a in d.live() if a.slot_idx is None)
        batch[-1] = d.result(extra.id, [0.0, 1.0, 1.0, 0.0])
    reads = first_reads(pg_ledger, d, batch)
    assert len(reads) == 1 and "%(attempt_ids)s" in reads[0][0]  # bound, not written into the text
    def copies(table: str, where: str, changes: str, count: int) -> str:
        """`count` copies of one row of `table`, with `changes` (SQL for a jsonb object, `g`
        numbering the copies) over its columns."""
        return (
            f"INSERT INTO {table} SELECT r.* FROM (SELECT * FROM {table} WHERE {where} LIMIT 1) t, generate_series(0, {count - 1}) g, "
            f"LATERAL jsonb_populate_record(NULL::{table}, to_jsonb(t) || {changes}) r; "
        )

    other = "(SELECT max(id) FROM runs)"
    made_up = (  # another run, a copy of this one's row, with a step of 20,000 slots and 40,000 live attempts
        copies("runs", f"id = {d.run_id}", "jsonb_build_object('id', nextval(pg_get_serial_sequence('runs', 'id')), 'name', 'other', 'config_hash', md5('other'))", 1)
        + copies("steps", f"run_id = {d.run_id}", f"jsonb_build_object('run_id', {other}, 'step', 0, 'num_slots', 20000)", 1)
        + copies("slots", f"run_id = {d.run_id}", f"jsonb_build_object('run_id', {other}, 'step', 0, 'idx', g, 'status', 'open', 'needs_replacement', g % 2 = 0, 'group_attempt_id', NULL, 'settled_at', NULL)", 20000)
        + copies("attempts", f"run_id = {d.run_id} AND state = 'running'", f"jsonb_build_object('id', nextval(pg_get_serial_sequence('attempts', 'id')), 'run_id', {other}, 'step', 0, 'slot_idx', g % 20000, 'state', 'running')", 40000)
    )
    statement, parameters = reads[0]
    analyze = "ANALYZE runs, steps, slots, attempts, groups, spare_prompts;"
    # No statistics; statistics of the small run only (taken before the other run's rows came);
    # statistics of both.
    # A batch with an extra's result reads the open slots as well, and two conditions of the
    # batch's attempts (each about 35 buffers): more work, bounded by its own rows all the same.
    bound = 1000 if with_extra else 600
    for when, before in (("none", made_up), ("before", analyze + made_up), ("after", made_up + analyze)):
        rows, buffers = run_explained_generic(pg_ledger, statement, parameters, before=before)
        assert rows == 1
        assert buffers < bound, f"the first read-ahead touched {buffers} buffers (statistics: {when} 60,000 rows): {plans.last_scans[:6]}"


def test_a_batchs_first_read_ahead_on_a_run_5000_steps_in_costs_what_it_does_on_a_new_one(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """The first read of a batch that holds an extra's result finds the run's open steps four
    times (its first open step, and beside the slots it reads: lenders, slots waiting, open
    slots) under the plan PostgreSQL makes once for any values. Through the partial index of
    the unfinished steps (`sql._step_is_open`) that costs about the same however long the run:
    on a run 5,000 steps in (each with four committed slots and their groups, one of them parked
    for good), it touches at most 40 buffers more than on a new run (58 against 40 when written;
    with 'open' a bound parameter, the primary key walked the trained steps: 133).

    The statistics are the test's own, taken after the history as autovacuum would (the tables
    hold only this test's rows, each under 30,000, so ANALYZE reads them whole). Statistics
    from before the history (a small run) are not asserted: with them the planner takes every
    table for a few pages, and no spelling of these reads keeps it off the primary keys (about
    600 buffers); a run that grows is analyzed again by autovacuum."""
    d = Driver(pg_ledger, {"grpo": {"num_prompts_per_step": 64}, "async_rl": {"over_dispatch": {"enabled": True}, "max_lookahead_versions": 1}}, num_prompts=512)
    d.admit()
    d.start_all([a.id for a in d.live()])
    batch = [d.result(a.id, [0.0, 1.0, 1.0, 0.0] if i % 3 else [1.0] * 4) for i, a in enumerate(d.live(0)[:4])]
    batch[-1] = d.result(next(a for a in d.live() if a.slot_idx is None).id, [0.0, 1.0, 1.0, 0.0])
    reads = first_reads(pg_ledger, d, batch)
    statement, parameters = reads[0]
    assert "lenders_limit" in parameters and "open_limit" in parameters
    run, first = d.run_id, f"(SELECT min(id) FROM prompts WHERE run_id = {d.run_id})"
    # Made up (and rolled back): steps -1 to -5000, trained, four committed slots each, their
    # groups (the first of each step parked, too stale ever to lend). Foreign keys to attempts
    # are not checked for the transaction: the history has no attempts.
    history = (
        "SET LOCAL session_replication_role = replica;"
        "INSERT INTO steps (run_id, step, status, num_slots, committed, shrunk, dropped_shrunk, admitted_at, train_claims) "
        f"SELECT {run}, -g, 'trained', 4, 4, 0, 0, now(), 1 FROM generate_series(1, 5000) g;"
        "INSERT INTO slots (run_id, step, idx, status, prompt_id, group_attempt_id, needs_replacement, filtered, filter_replacements,"
        " filter_budget, infra_failures, data_failures, drops, drop_replacements, drop_budget, borrowed_in, lent_out, attempts) "
        f"SELECT {run}, -g, i, 'committed', {first}, 10000000 + 4 * g + i, false, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1 "
        "FROM generate_series(1, 5000) g, generate_series(0, 3) i;"
        "INSERT INTO groups (attempt_id, run_id, prompt_id, origin_step, weight_version, rewards, reward_mean, zero_variance, rollout,"
        " completion_texts, num_tokens, committed_at, parked, moves, trained_step) "
        f"SELECT 10000000 + 4 * g + i, {run}, {first}, -g, -g, '[0, 1]', 0.5, false, '\\x00', '[]', 8, now(), i = 0, 0, "
        "CASE WHEN i = 0 THEN NULL ELSE -g END FROM generate_series(1, 5000) g, generate_series(0, 3) i;"
    )
    analyze = "ANALYZE runs, steps, slots, attempts, groups, spare_prompts;"
    new_rows, new_run = run_explained_generic(pg_ledger, statement, parameters, before=analyze)
    rows, long_run = run_explained_generic(pg_ledger, statement, parameters, before=history + analyze)
    assert new_rows == rows == 1
    assert long_run <= new_run + 40, f"5,000 steps in: {long_run} buffers against {new_run} on a new run: {plans.last_scans[:6]}"


def test_a_steps_release_finds_its_slots_first_attempts_by_origin_not_among_every_attempt(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """A step's release averages the first generation of each slot's own prompt
    (`first_attempt_reward`), found by the slot it was dispatched for (it may have moved since).
    Beside 20,000 attempts dispatched for other steps of the run (statistics taken after them),
    that read touches about what the step's own attempts take, through the index of origins (a
    sequential scan of the attempts: about 700 buffers; 2,100 on a run 3,000 steps of 16
    prompts in). Since stop 53 it is part of the release's one read of its metrics
    (`metrics._release_read`: the step's attempts by step, its slots and their groups), and the
    bound is that whole statement's."""
    d = Driver(pg_ledger)
    d.admit()
    with plans.statements_run(pg_ledger, lambda statement, _: "first_value(attempts.prompt_id)" in statement) as reads:
        d.fill_step(0)
    assert d.step(0).status == "released" and d.query(lambda s: s.get(StepMetrics, (d.run_id, 0))).first_attempt_reward is not None
    [(statement, parameters)] = reads
    history = (  # made up and rolled back; foreign keys unchecked (the steps and slots they name do not exist)
        "SET LOCAL session_replication_role = replica;"
        f"INSERT INTO attempts SELECT r.* FROM (SELECT * FROM attempts WHERE run_id = {d.run_id} AND reward_mean IS NOT NULL LIMIT 1) t, "
        "generate_series(1, 20000) g, LATERAL jsonb_populate_record(NULL::attempts, to_jsonb(t) || jsonb_build_object("
        "'id', nextval(pg_get_serial_sequence('attempts', 'id')), 'step', -1 - g / 4, 'origin_step', -1 - g / 4, 'origin_slot', g % 4)) r;"
        "ANALYZE attempts;"
    )
    rows, buffers = run_explained_generic(pg_ledger, statement, parameters, before=history)
    assert rows == 1
    assert buffers < 150, f"the release's metrics read (the first attempts' reward with it) {buffers} buffers beside 20,000 other attempts: {plans.last_scans[:4]}"


def test_the_loaders_streak_read_walks_back_only_as_far_as_it_needs(pg_ledger) -> None:  # type: ignore[no-untyped-def]
    """Pre-rollout skipping reads each prompt's newest scored groups, as many as the streak
    whose skip probability has reached its ceiling (`decisions.saturating_streak`), backward
    through the index of scored attempts by prompt and id. Beside 10,000 older scored attempts
    of the 8 prompts it reads and 10,000 newer ones of other prompts (a long multi-epoch run;
    statistics taken after them), it touches about what three rows a prompt take: neither the
    prompts' whole history (the index by prompt alone) nor every newer attempt (the primary
    key walked back)."""
    from refill.models import skipping
    from refill.models.tables import Prompt

    d = Driver(pg_ledger, {"grpo": {"num_prompts_per_step": 8}}, num_prompts=16)
    d.admit()
    d.fill_step(0)
    with pg_ledger.session() as session:
        prompt_ids = sorted(session.scalars(select(Prompt.id).where(Prompt.run_id == d.run_id)))
    read, other = prompt_ids[:8], prompt_ids[8:]
    with plans.statements_run(pg_ledger, lambda statement, _: "LATERAL" in statement) as seen, pg_ledger.session() as session:
        found = skipping.streaks(session, d.run_id, read, 3)
    assert sorted(found) == read
    [(statement, parameters)] = seen

    def copies(ids: str, prompts: list[int]) -> str:
        return (
            f"INSERT INTO attempts SELECT r.* FROM (SELECT * FROM attempts WHERE run_id = {d.run_id} AND zero_variance IS NOT NULL LIMIT 1) t, "
            "generate_series(1, 10000) g, LATERAL jsonb_populate_record(NULL::attempts, to_jsonb(t) || jsonb_build_object("
            f"'id', {ids}, 'prompt_id', (ARRAY{prompts})[1 + g % {len(prompts)}])) r;"
        )

    history = (  # made up and rolled back: older attempts of the prompts read, newer ones of the others
        "SET LOCAL session_replication_role = replica;"
        + copies("-g", read)
        + copies("1000000 + g", other)
        + "ANALYZE attempts;"
    )
    rows, buffers = run_explained_generic(pg_ledger, statement, parameters, before=history)
    assert rows == 8 * 3
    assert buffers < 150, f"the streak read touched {buffers} buffers beside 20,000 other attempts: {plans.last_scans[:4]}"
