"""A run played in the ledger as a long run's would be, with the statements it runs recorded.

`played_beside` plays a run's first steps, copies their rows as the history of a long run (under
steps and ids of their own), then plays more steps beside that history, while PostgreSQL's
`auto_explain` reports every statement the ledger runs with the work its plan did (`Recorder`).
The tests of what a statement may cost as a run grows (`tests/integration/test_run_length.py`)
or as its steps do (`test_step_size.py`) compare two such runs.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event, func, select, text

from refill.admin.exporter import read_ledger
from refill.admin.progress_queries import run_progress, step_metrics
from refill.admin.tail_command import TAIL_STEPS
from refill.models.db import Ledger
from refill.models.payload import ResultMessage
from refill.models.tables import Attempt, AttemptState, Base, Step, StepStatus
from tests.support.driver import FLAT, SPREAD, Driver

CONFIG = {
    "grpo": {"num_prompts_per_step": 16, "max_num_steps": 40, "max_num_epochs": 100, "dynamic_sampling_max_replacements_per_slot": 16},
    "data": {"prompt_skipping": {"enabled": True}},
    "async_rl": {"over_dispatch": {"enabled": True}, "max_lookahead_versions": 1},
}
TABLES = [table.name for table in Base.metadata.sorted_tables]
#: Steps played before the history is copied: the copies' template.
TEMPLATE_STEPS = 3

class Recorder:
    """The statements `auto_explain` reports on the ledger's connections (as its NOTICE), with
    what each one's plan did (`measure` of the plan: by default `examined`, the rows its scans
    looked at), by the statement's `key` (by default its `shape`), while `on`."""

    def __init__(
        self,
        ledger: Ledger,
        measure: Callable[[dict[str, Any]], int] | None = None,
        key: Callable[[str], str] | None = None,
    ) -> None:
        self.ledger = ledger
        self.on = False
        self.rows: dict[str, list[int]] = defaultdict(list)
        self.measure = measure or examined
        self.key = key or shape

    def _connect(self, dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.add_notice_handler(self._notice)
        with dbapi_connection.cursor() as cursor:
            cursor.execute(
                "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; SET auto_explain.log_analyze = on;"
                " SET auto_explain.log_timing = off;"
                " SET auto_explain.log_format = json; SET auto_explain.log_level = NOTICE"
            )
        dbapi_connection.commit()

    def _notice(self, diagnostic: Any) -> None:
        message = diagnostic.message_primary or ""
        if self.on and "{" in message:
            found = json.loads(message[message.index("{") :])
            plan = found["Plan"]
            self.rows[self.key(found["Query Text"])].append(self.measure(plan))

    @contextmanager
    def recording(self) -> Iterator[dict[str, list[int]]]:
        self.ledger.engine.dispose()  # new connections, which load auto_explain
        event.listen(self.ledger.engine, "connect", self._connect)
        self.rows = defaultdict(list)
        try:
            yield self.rows
        finally:
            event.remove(self.ledger.engine, "connect", self._connect)
            self.ledger.engine.dispose()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The test's own reads (which step is released, which attempts are live) are not the
        ledger's: they go unrecorded."""
        self.on = False
        try:
            yield
        finally:
            self.on = True


def examined(node: dict[str, Any]) -> int:
    """The rows a statement's scans looked at: each scan's rows and the rows its filters (and a
    bitmap's recheck) removed, over its loops. A read served by its indexes looks at about what
    it returns however deep those indexes are or wherever the rows lie; one that walks the
    run's history looks at that history. (Buffers would count index depth and heap layout too:
    a key lookup of 26 outbox rows touched 17 buffers beside 300 copies, 63 beside 1,000.)"""
    rows = 0
    if "Scan" in node["Node Type"]:
        rows = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
        rows = int(rows * node.get("Actual Loops", 1))
    return rows + sum(examined(child) for child in node.get("Plans", []))


def handled(node: dict[str, Any]) -> int:
    """The rows every node of a plan handled: what each returned and what its filters (a join's
    too) removed, over its loops. Unlike `examined` it counts a join's work as well: a nested
    loop that goes over a step's attempts again for each of its slots handles their product,
    however few rows its scans read (from a materialized inner side)."""
    rows = 0
    # A bitmap's entries are counted by the heap scan above it (the rows it found, and those its
    # recheck removed): the index's own count includes entries of rows that are dead (extras
    # started since the last vacuum), which plain index scans mark and skip, so it moved with
    # the plan and with vacuum's timing.
    if node["Node Type"] != "Bitmap Index Scan":
        rows = sum(node.get(name, 0) for name in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Join Filter", "Rows Removed by Index Recheck"))
    return int(rows * node.get("Actual Loops", 1)) + sum(handled(child) for child in node.get("Plans", []))


def shape(statement: str) -> str:
    """A statement's text with its numbers as N: the reads that write a batch's ids into the
    SQL compare with one another by their shape (and the lists' lengths)."""
    return re.sub(r"\b\d+\b", "N", " ".join(statement.split()))


def shape_any_length(statement: str) -> str:
    """`shape`, with a list of numbers of any length as one: a read of a step's prompts by id
    has one shape whatever the step's size."""
    return re.sub(r"N(, N)+", "N, ...", shape(statement))


def failed(d: Driver, attempt_id: int, version: int) -> ResultMessage:
    """An engine's crash, reported for `attempt_id` (an infra failure: its slot retries)."""
    return ResultMessage(
        run_id=d.run_id, attempt_id=attempt_id, worker=d.worker, weight_version=version, error_kind="infra", error="engine crashed"
    )


def watch(d: Driver) -> None:
    """The reads that watch a run while it goes, polled every second or so: the controller's
    progress (`refill run start`'s display), `refill tail`'s, and the metrics exporter's."""
    with d.ledger.session() as session:
        run_progress(session, d.run_id)
        step_metrics(session, d.run_id, last=TAIL_STEPS)
    read_ledger(d.ledger, recent_minutes=60)


def play_steps(d: Driver, steps: int, recorder: Recorder, scale: int = 1) -> None:
    """Train `steps` more steps; every move's statements recorded. Each move starts the first
    `24 * scale` live attempts and finishes all but the last few, whose results come in batches
    of 24: a third of the prompts (by attempt id) always solved, so that slots filter and borrow,
    and one attempt in 13 an engine's crash, so that slots retry; every third move the
    leases of every running attempt expire. Attempt ids count from the run's first (other
    tests' runs take ids from the same sequence), so that two runs play alike; a run of steps
    `scale` times as large plays alike in proportion."""
    first = d.query(lambda s: s.scalar(select(func.min(Attempt.id)).where(Attempt.run_id == d.run_id))) or 0
    trained = 0
    recorder.on = True
    try:
        for move in range(200):
            d.admit()
            d.reap()
            d.relay()
            with recorder.paused():
                live = d.query(
                    lambda s: list(
                        s.scalars(
                            select(Attempt.id)
                            .where(Attempt.run_id == d.run_id, Attempt.state.in_([state.value for state in AttemptState.live()]))
                            .order_by(Attempt.id)
                            .limit(24 * scale)
                        )
                    )
                )
            if live:
                d.start_all(live)
                with recorder.paused():
                    version = d.run().weight_version
                finished = live[: -4 * scale]  # the last few stay running into the next move
                for batch in range(0, len(finished), 24):
                    d.record(
                        *(
                            failed(d, a, version) if (a - first) % 13 == 12 else d.result(a, FLAT if (a - first) % 3 == 0 else SPREAD, version)
                            for a in finished[batch : batch + 24]
                        )
                    )
            with recorder.paused():
                released = d.query(
                    lambda s: list(
                        s.scalars(select(Step.step).where(Step.run_id == d.run_id, Step.status == StepStatus.RELEASED.value))
                    )
                )
            for step in released:
                assert d.train(step)
                trained += 1
                if trained == steps:
                    return
            watch(d)
            # Now and then every running lease expires (the reaper retries their attempts).
            d.tick(120 if move % 3 == 2 else 1)
    finally:
        recorder.on = False
    raise AssertionError(f"{steps} steps did not train in 200 moves")


#: Prompts in the ledger beside a run's own: other runs' data sets. A few hundred prompts fit in
#: a few pages, which PostgreSQL scans again for each row it joins to them (the relay's read of
#: its attempts' prompts, planned so, handled the batch times the data set); a ledger's data
#: sets are larger than that.
LEDGER_PROMPTS = 10_000


def other_runs_prompts(ledger: Ledger, run_id: int) -> None:
    """Copies of `run_id`'s prompts, `LEDGER_PROMPTS` in all, as other runs' (runs that are not
    there: their foreign keys go unchecked, and nothing reads another run's prompts)."""
    with ledger.engine.begin() as connection:
        own = connection.execute(text(f"SELECT count(*) FROM prompts WHERE run_id = {run_id}")).scalar_one()
        connection.execute(text("SET LOCAL session_replication_role = replica"))
        connection.execute(
            text(
                f"INSERT INTO prompts SELECT r.* FROM (SELECT * FROM prompts WHERE run_id = {run_id}) t, "
                f"generate_series(1, {LEDGER_PROMPTS // own}) k, LATERAL jsonb_populate_record(NULL::prompts, "
                "to_jsonb(t) || jsonb_build_object('id', id + 1000000 * k, 'run_id', -k)) r"
            )
        )


def copy_history(ledger: Ledger, run_id: int, first: int, last: int) -> None:
    """Copies `first` to `last` of the template's rows: copy k has steps (and weight
    versions) 10k below the template's, attempt ids a million k above, and its draws in epoch
    -k. Foreign keys go unchecked for the copy (its rows name one another). Outbox rows are not
    copied: one train_step row a step, they are nothing beside the rest."""

    def copies(table: str, where: str, changes: str) -> str:
        return (
            f"INSERT INTO {table} SELECT r.* FROM (SELECT * FROM {table} WHERE run_id = {run_id} AND {where}) t, "
            f"generate_series({first}, {last}) k, LATERAL jsonb_populate_record(NULL::{table}, to_jsonb(t) || {changes}) r;"
        )

    step, ids, template = "step - 10 * k", "1000000::bigint * k", f"step BETWEEN 0 AND {TEMPLATE_STEPS - 1}"
    with ledger.engine.begin() as connection:
        connection.execute(text("SET LOCAL session_replication_role = replica"))
        connection.execute(
            text(
                copies("steps", template, f"jsonb_build_object('step', {step})")
                + copies("slots", template, f"jsonb_build_object('step', {step}, 'group_attempt_id', group_attempt_id + {ids})")
                + copies(
                    "groups",
                    f"origin_step BETWEEN 0 AND {TEMPLATE_STEPS - 1} AND trained_step IS NOT NULL",
                    f"jsonb_build_object('attempt_id', attempt_id + {ids}, 'origin_step', origin_step - 10 * k,"
                    " 'weight_version', weight_version - 10 * k, 'trained_step', trained_step - 10 * k)",
                )
                + copies("attempts", template, f"jsonb_build_object('id', id + {ids}, 'step', {step}, 'origin_step', origin_step - 10 * k)")
                + copies("step_metrics", template, f"jsonb_build_object('step', {step})")
                + copies("weight_versions", f"version BETWEEN 1 AND {TEMPLATE_STEPS}", "jsonb_build_object('version', version - 10 * k)")
                + copies("prompt_draws", "epoch = 0", "jsonb_build_object('epoch', -k)")
            )
        )
        # Statistics from every row, not ANALYZE's random sample of 30,000 (the attempts beside
        # 1,000 copies are more): a sample's plans changed from one run of the test to the next.
        connection.execute(text("SET LOCAL default_statistics_target = 10000"))
        connection.execute(text("ANALYZE"))


def mean(values: list[int]) -> float:
    return sum(values) / len(values)


def played_beside(
    ledger: Ledger, recorder: Recorder, copies: int, sampler: str, prompts_per_step: int = 16
) -> tuple[Driver, dict[str, list[int]]]:
    """A run of `prompts_per_step` prompts a step over a data set of three steps' prompts: its
    template steps played on empty tables, copied `copies` times as its history, then two steps
    played beside it; returns the run, and what each statement of those two steps did
    (`recorder.measure`). The tables are truncated first and their ids start again, so that each
    run finds only its own rows and has the same ids as another of its size."""
    with ledger.engine.begin() as connection:
        connection.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    # Not checked by `refill check` at the end: the copied history is not a run's (its slots'
    # groups, counters and draws repeat the template's).
    config = {
        **CONFIG,
        "grpo": {**CONFIG["grpo"], "num_prompts_per_step": prompts_per_step},
        "async_rl": {**CONFIG["async_rl"], "sampler": {"name": sampler}},
    }
    d = Driver(ledger, config, num_prompts=3 * prompts_per_step, check=False)
    scale = max(1, prompts_per_step // 16)
    play_steps(d, TEMPLATE_STEPS, recorder, scale)
    other_runs_prompts(ledger, d.run_id)
    copy_history(ledger, d.run_id, 1, copies)
    with recorder.recording() as rows:
        recorder.on = True
        d.resume()  # its controller starts again, as after a crash or a stop
        play_steps(d, 2, recorder, scale)
    return d, rows
