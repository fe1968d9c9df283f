"""The unit of work of one run inside one transaction.

A `RunContext` is what every ledger operation that changes scheduling state works through:
the locked run row, its settings and sampler, the transaction's clock, the rows it reads and
makes (`rows`, a `models.rows.RowStore`: plain rows read and written with Core, see there why),
and what it left to send (`to_send`: relayed at once after commit, not at the relay's next tick).

An operation runs inside `with RunContext.open(session, run_id) as ctx:`; the block's end
writes what it changed (`flush`, also called before a query that must see those changes).
Nothing is written behind the caller's back: the context registers no session hooks, and an
operation that raises writes nothing (its transaction is rolled back).

It also keeps what a batch of decisions reads again and again (the spare pool, the groups a
slot may borrow, the slots waiting on a replacement), loaded once per transaction and updated
as the batch changes them. The run's row is locked, so nothing else changes them; entries are
still checked against the rows when used, so a stale entry is skipped rather than trusted.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from operator import attrgetter
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from refill.models import sql
from refill.models.clock import ledger_now
from refill.models.clock import utcnow as utcnow  # re-exported: where its importers find it
from refill.models.db import lock_run
from refill.models.driver import insert_rows
from refill.models.ids import IdBlocks
from refill.models.joint_read import When, column_keys, condition
from refill.models.outbox import ToSend
from refill.models.rows import (
    AttemptRow,
    GroupRow,
    OutboxRow,
    Read,
    RowStore,
    RunRow,
    SlotRow,
    SpareRow,
    StepRow,
)
from refill.models.samplers import GroupView, Sampler
from refill.models.settings import LedgerSettings, settings_for
from refill.models.sql import (
    ATTEMPT_COLUMNS,
    GROUP_COLUMNS,
    SLOT_COLUMNS,
    SPARE_COLUMNS,
)
from refill.models.tables import (
    Attempt,
    AttemptReason,
    AttemptState,
    Group,
    RunStatus,
    Slot,
    SlotStatus,
    SparePrompt,
    StepStatus,
)

#: Rows loaded per query by the caches (lenders and waiting slots; spare prompts; open slots),
#: unless the operation sizes them (`size_caches`: a batch of results needs a prefix about its
#: own size); more are loaded when they run out.
CHUNK, SPARE_CHUNK, OPEN_CHUNK = 512, 128, 128
#: How many lenders a slot's sampler chooses among (`slots.lender_candidates`) and how many
#: open slots a group's placement looks at (`slots.placement_candidates`).
LENDER_CHOICES = 128
PLACEMENT_CHOICES = 32

# Enum members' .value is a property call; the hot loops compare against plain strings.
_SLOT_OPEN = SlotStatus.OPEN.value
_SLOT_COMMITTED, _RUN_RUNNING = SlotStatus.COMMITTED.value, RunStatus.RUNNING.value
_STEP_OPEN, _STEP_TRAINED = StepStatus.OPEN.value, StepStatus.TRAINED.value
_LIVE = tuple(s.value for s in AttemptState.live())

# Re-exported: the columns the ledger's modules read rows with (models/sql.py).
__all__ = ["ATTEMPT_COLUMNS", "GROUP_COLUMNS", "SLOT_COLUMNS", "SPARE_COLUMNS", "RunContext"]
_attempts, _slots, _groups = Attempt.__table__, Slot.__table__, Group.__table__


_slot_index, _step_number = attrgetter("idx"), attrgetter("step")


@dataclass
class RunContext:
    session: Session
    run: RunRow
    settings: LedgerSettings
    sampler: Sampler
    now: datetime
    #: the slots, attempts, groups and spare prompts this operation read or made
    rows: RowStore = field(default=None)  # type: ignore[assignment]
    outbox: list[OutboxRow] = field(default_factory=list)
    #: ids of the attempts made here: each a generate message to send (admission's bulk too)
    made_attempts: list[int] = field(default_factory=list)
    #: slots whose live attempts were read into `rows` with their rows locked (`live_attempt`)
    _live_locked: set[tuple[int, int]] = field(default_factory=set)
    #: running slot attempts whose weights are too old for a later step (overdispatch)
    old_running: dict[tuple[int, int], int] | None = None
    _spares_db: deque[SpareRow] | None = None
    _spares_db_done: bool = False
    _spares_last_id: int = 0
    #: lendable groups: parked ones, committed ones in (step desc, attempt desc) order as
    #: loaded, and those added during the transaction
    _lendable_parked: list[GroupView] | None = None
    _lendable_committed: list[GroupView] = field(default_factory=list)
    _lendable_added: list[GroupView] = field(default_factory=list)
    _waiting: dict[tuple[int, int], SlotRow] | None = None
    #: the same slots by step, each step's sorted by index, for placements that look only at
    #: the first few of the earlier steps
    _waiting_by_step: dict[int, list[SlotRow]] = field(default_factory=dict)
    #: the last (step, idx) loaded when the stored waiting slots were more than were loaded
    _waiting_loaded_to: tuple[int, int] | None = None
    #: rows the caches load (see `size_caches`)
    _waiting_chunk: int = CHUNK
    _lendable_chunk: int = CHUNK
    _open_chunk: int = field(default_factory=lambda: OPEN_CHUNK)
    _spare_chunk: int = field(default_factory=lambda: SPARE_CHUNK)
    #: a prefix (in placement order) of the open slots of open steps, and whether more exist
    _open_slots: list[SlotRow] | None = None
    _open_slots_truncated: bool = False
    #: whether `rows.steps` holds every step of the run not trained yet (`unfinished_steps`)
    _unfinished_read: bool = False
    #: a step opened or left 'open' here: extras may be stranded (`overdispatch.reaim_if_steps_changed`)
    steps_changed: bool = False
    #: ids for the attempts, outbox rows and spare prompts this transaction creates (`open`)
    ids: IdBlocks = field(default=None)  # type: ignore[assignment]

    @classmethod
    def open(cls, session: Session, run_id: int, now: datetime | None = None) -> RunContext:
        """Lock run `run_id` and read its row; use as `with RunContext.open(...) as ctx:`,
        whose end writes the operation's changes. Raises `UnknownRun` for no such run."""
        # The ledger code flushes where a query must see this transaction's changes and
        # nowhere else: autoflush before every query would write the session's objects (a
        # rejected result, a weight version) one at a time.
        session.autoflush = False
        rows = RowStore(session)
        found = lock_run(session, run_id)
        columns = column_keys(RunRow)
        (run,) = rows.adopt(RunRow, columns, [[found[name] for name in columns]])
        settings = settings_for(run)
        # The database's clock unless the caller brings its own (a test's, a simulation's).
        now = now or ledger_now(session)
        return cls(session, run, settings, settings.sampler(), now, rows=rows, ids=IdBlocks.for_session(session))

    def __enter__(self) -> RunContext:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        # An operation that raised decided nothing: its transaction is rolled back, and
        # writing half its decisions first would only add a second error to the first.
        if kind is None:
            self.flush()

    def flush(self) -> None:
        """Write this operation's changes so far: its rows (models/rows.py), then what it
        added to the session (the cold path's ORM objects: a rejected result, a weight version,
        a step's metrics). Called before a query that must see them, and at the end of the
        operation's `with` block."""
        self.rows.write()
        if self.session.new or self.session.dirty:
            self.session.flush()

    def new_attempt(self, values: dict[str, Any]) -> AttemptRow:
        row: AttemptRow = self.rows.new(AttemptRow, {**self.ids.ids("attempts"), **values})
        self.made_attempts.append(row.id)
        return row

    def new_outbox(self, values: dict[str, Any]) -> OutboxRow:
        row: OutboxRow = self.rows.new(OutboxRow, {**self.ids.ids("outbox"), **values})
        self.outbox.append(row)
        return row

    # --- the live attempt of a slot ------------------------------------------------------

    def live_attempt(self, slot: SlotRow) -> AttemptRow | None:
        """The live attempt aimed at `slot` (None if it has none), as this transaction sees it,
        read with its row locked, to be moved to another slot in memory (a re-aim: the attempt
        moves to another step, whose staleness floor it must meet) and written with the batch's
        other rows.

        A worker's lease handshake takes no run lock, so without the row lock it could start
        the attempt with weights too old for where it is being moved, between this read and the
        write; with it, the handshake waits for this transaction and then sees where the
        attempt went. The read skips a row that is locked already, and then the answer is None:
        a worker is starting that attempt (its handshake holds the row), so it is not moved, and
        the transaction never waits on a worker. Waiting there deadlocked: a handshake leases a
        bundle of attempts, and a batch locks the attempts it re-aims one by one, in no common
        order. The lock is `FOR NO KEY UPDATE`, which a handshake's update takes too, and not
        `FOR UPDATE`, which would also wait for the foreign-key checks of other transactions'
        writes (a row that names the attempt takes a key-share lock on it). An attempt made in
        this transaction needs no lock: nobody else can see it yet.
        """
        key = (slot.step, slot.idx)
        found = self._live_in_rows(key)
        if key in self._live_locked or self.handing_over(key):
            # A slot handed over and open again (its group lent) has only what was made here.
            return found
        if found is None or self.rows.saved(found, "id") is not None:
            # A locking read refreshes what it finds: another transaction may have written the
            # row since it was first read here.
            if not self.rows.load(AttemptRow, sql.live_attempts(self.run.id, [key]), refresh=True):
                # Locked by a worker's handshake, or no longer live: not this transaction's to move.
                return None
            found = self._live_in_rows(key)
        self._live_locked.add(key)
        return found

    def hand_over(self, slot: SlotRow) -> None:
        """The live attempt of `slot` (if it has one), which a group is about to fill, serves the
        slot's step as an extra from now on: its slot is cleared and its reason is `extra`.

        An attempt this transaction holds (the batch's own, or one it made or moved) is changed
        here. One it never read is changed by its slot with the next write, after the rows'
        UPDATEs (`RowStore.handed_over`, `sql.hand_over`, which locks its rows in id order),
        without being read first: a hand-over writes only the attempt's slot and reason, which
        no handshake writes, and the attempt serves the same step either way. Until then the
        batch takes the slot as having no attempt but those made here (`handing_over`); had the
        attempt a result in the batch, it would be held here. Reading the open slots' live
        attempts for their hand-overs cost a batch that placed extras 2 ms (stop 47).
        """
        attempt = self._live_in_rows((slot.step, slot.idx))
        if attempt is not None:
            attempt.slot_idx = None
            attempt.reason = AttemptReason.EXTRA.value
        else:
            self.rows.handed_over.setdefault(self.run.id, []).append((slot.step, slot.idx))

    def handing_over(self, key: tuple[int, int]) -> bool:
        """Whether the live attempt the slot at `key` had is handed over with the next write."""
        return key in self.rows.handed_over.get(self.run.id, ())

    def _live_in_rows(self, key: tuple[int, int]) -> AttemptRow | None:
        for row in self.rows.attempts.values():
            if row.slot_idx == key[1] and row.step == key[0] and row.state in _LIVE:
                return row
        return None

    @property
    def running(self) -> bool:
        return self.run.status == _RUN_RUNNING

    def later(self, seconds: float) -> datetime:
        return self.now + timedelta(seconds=seconds)

    def step(self, step: int) -> StepRow:
        row = self.find_step(step)
        if row is None:
            raise LookupError(f"run {self.run.id} has no step {step}")
        return row

    def find_step(self, step: int) -> StepRow | None:
        """Step `step` of the run, or None if it has none."""
        row = self.rows.steps.get(step)
        if row is None:
            found = self.rows.load(StepRow, sql.steps(self.run.id, [step]))
            row = found[0] if found else None
        return row

    def slot(self, step: int, idx: int) -> SlotRow:
        row = self.rows.slots.get((step, idx))
        if row is None:
            found = self.rows.load(SlotRow, sql.slots_at(self.run.id, [(step, idx)]))
            if not found:
                raise LookupError(f"run {self.run.id} has no slot ({step}, {idx})")
            row = found[0]
        return row

    def group(self, attempt_id: int) -> GroupRow | None:
        """A committed group (its payload columns left out), or None."""
        row = self.rows.groups.get(attempt_id)
        if row is None:
            found = self.rows.load(GroupRow, select(*GROUP_COLUMNS).where(_groups.c.attempt_id == attempt_id))
            row = found[0] if found else None
        return row

    def unfinished_steps(self) -> list[StepRow]:
        """The run's steps that are not trained yet, in step order: read once per transaction
        (or with a batch's other reads, `read_ahead`), then kept by this transaction's own
        changes, made on these same rows (a step it admits joins them). A step changes status
        only under the run's lock (admission, release, the trainer's claim and finish, the
        reaper), so what this transaction read stays true but for its own changes."""
        if not self._unfinished_read:
            self.rows.load(StepRow, sql.unfinished_steps(self.run.id))
            self._unfinished_read = True
        return sorted((row for row in self.rows.steps.values() if row.status != _STEP_TRAINED), key=_step_number)

    def _adopt_unfinished(self, rows: list[StepRow]) -> None:
        self._unfinished_read = True  # the rows are in `rows.steps` already

    def open_steps(self) -> list[StepRow]:
        """The run's open steps, in step order."""
        return [row for row in self.unfinished_steps() if row.status == _STEP_OPEN]

    def step_open(self, step: int) -> bool:
        # Called for every candidate slot of every placement: the row is looked up once per
        # transaction and its (in-memory) status read each time.
        row = self.rows.steps.get(step)
        if row is None:
            if self._unfinished_read:
                return False  # every unfinished step is here: this one is trained, or none
            row = self.find_step(step)
        return row is not None and row.status == _STEP_OPEN

    def _open_step_up_to(self, max_step: int) -> bool:
        """Whether the run may have an open step numbered `max_step` or less: False only when
        its unfinished steps are all here (`unfinished_steps`) and none of those is."""
        if not self._unfinished_read:
            return True
        return any(row.status == _STEP_OPEN and row.step <= max_step for row in self.rows.steps.values())

    @property
    def to_send(self) -> ToSend:
        runs = (self.run.id,) if self.made_attempts else ()
        return ToSend(tuple(self.made_attempts), tuple(row.id for row in self.outbox), runs)

    # --- the spare pool ------------------------------------------------------------------

    @property
    def spare_count(self) -> int:
        """Untaken prompts in the spare pool (the run's counter, kept by `add_spares` and
        `spare_taken`; `refill check` compares it with the pool)."""
        return int(self.run.spare_prompts_available or 0)

    def add_spares(self, rows: list[dict]) -> None:  # type: ignore[type-arg]
        """Write spare prompts to the pool (rows of `spare_prompts`), as one bulk insert
        rather than an ORM object each: admission adds thousands, and only the few taken in
        this transaction are loaded back, by `next_spare`."""
        if not rows:
            return
        insert_rows(self.session, SparePrompt.__table__, rows)
        self.run.spare_prompts_available = self.spare_count + len(rows)
        # Their ids are above every spare loaded so far: the next load finds them.
        self._spares_db_done = False

    def next_spare(self) -> SpareRow | None:
        """The oldest untaken spare, in id order (the order they were added in)."""
        while not self._spares_db_done:
            if self._spares_db:
                return self._spares_db.popleft()
            self.reserve_spares(1)
        return None

    def reserve_spares(self, count: int) -> None:
        """Load what the next `count` takes of spares need in one read, where fewer are loaded
        (over-dispatch takes hundreds at once). No flush first: the read starts past every
        spare loaded so far and this transaction takes only spares it loaded, so none it took
        can be read back as untaken; those it added are written already (`add_spares`)."""
        short = count - len(self._spares_db or ())
        if short > 0 and not self._spares_db_done:
            limit = max(short, self._spare_chunk)
            self._adopt_spares(self.rows.load(SpareRow, sql.spares(self.run.id, self._spares_last_id, limit)), limit)

    def _adopt_spares(self, rows: list[SpareRow], limit: int | None = None) -> None:
        if self._spares_db is None:
            self._spares_db = deque()
        self._spares_db.extend(r for r in rows if r.taken_at is None)
        if rows:
            self._spares_last_id = rows[-1].id
        if len(rows) < (limit or self._spare_chunk):
            self._spares_db_done = not self._spares_db

    def spare_taken(self) -> None:
        self.run.spare_prompts_available = self.spare_count - 1

    # --- groups a slot may borrow ----------------------------------------------------------

    def size_caches(self, results: int, filtered: int = 0) -> None:
        """Size the caches for a batch of `results` results, `filtered` of them zero-variance,
        before their first use.

        A result settles at most a couple of waiting slots (its own, a lender's), borrows at
        most one lender and fills at most one open slot, so a prefix of `2 * results` (of open
        slots, `results`) past what one decision looks at gives every decision of the batch the
        same choices the whole set would; a filtered result takes at most one spare prompt
        (over-dispatch reads its own, `reserve_spares`). A longer prefix costs a batch more in
        loading rows than in deciding; a short one is loaded again (`waiting_up_to`)."""
        self._waiting_chunk = 2 * results + PLACEMENT_CHOICES
        self._lendable_chunk = 2 * results + LENDER_CHOICES
        self._open_chunk = results + PLACEMENT_CHOICES
        self._spare_chunk = filtered + 16

    def lendable(self) -> list[GroupView]:
        """Groups committed in open steps, latest steps first, and parked groups."""
        parked, committed, added = self.lendable_parts()
        return parked + committed + added

    def lendable_parts(self) -> tuple[list[GroupView], list[GroupView], list[GroupView]]:
        """The lendable groups in three lists: parked (as loaded), committed in open steps
        (latest step first, then latest attempt: the order lenders are preferred in), and those
        committed or parked during this transaction (in no order).

        Groups of the earliest open step are left out: only an earlier step may borrow, and
        none is open.
        """
        if self._lendable_parked is None:
            self.flush()
            committed, parked = sql.lendable(self.run.id, self.settings.max_lookahead_versions, self._lendable_chunk)
            self._adopt_lendable(self.rows.load_with(SlotRow, committed), self.session.execute(*parked).all())
        return self._lendable_parked, self._lendable_committed, self._lendable_added

    def _adopt_lendable(self, committed: list[tuple[SlotRow, tuple[Any, ...]]], parked: list[Any]) -> None:
        self._lendable_parked = [GroupView(attempt_id, version, None, None) for attempt_id, version in parked]
        self._lendable_committed = [
            GroupView(slot.group_attempt_id, version, slot.step, slot.idx) for slot, (version,) in committed
        ]

    def lendable_added(self, view: GroupView) -> None:
        if self._lendable_parked is not None:
            self._lendable_added.append(view)

    def still_lendable(self, view: GroupView) -> bool:
        if view.step is None:
            # Parked when the cache was loaded (or parked since, then in memory); only this
            # transaction can have moved it, and then its row is here.
            group = self.rows.groups.get(view.attempt_id)
            return group is None or bool(group.parked)
        slot = self.slot(view.step, view.idx)
        return (
            slot.status == _SLOT_COMMITTED
            and slot.group_attempt_id == view.attempt_id
            and self.step_open(view.step)
        )

    # --- slots waiting on a replacement ----------------------------------------------------

    def waiting(self) -> dict[tuple[int, int], SlotRow]:
        """Open slots of open steps whose own prompt was filtered or dropped."""
        if self._waiting is None:
            self.flush()
            self._adopt_waiting(self.rows.load(SlotRow, sql.open_slots(self.run.id, limit=self._waiting_chunk, waiting=True)))
        return self._waiting

    def _adopt_waiting(self, rows: list[SlotRow] | None) -> None:
        if rows is None:
            return  # not read (its `read_ahead` condition did not hold): loaded on first use
        self._waiting = {}
        self._waiting_by_step = {}
        self._waiting_loaded_to = (rows[-1].step, rows[-1].idx) if len(rows) == self._waiting_chunk else None
        for slot in rows:
            # In (step, idx) order: appended, not sorted in.
            self._waiting[(slot.step, slot.idx)] = slot
            self._waiting_by_step.setdefault(slot.step, []).append(slot)

    def waiting_up_to(self, max_step: int, limit: int) -> list[SlotRow]:
        """The first `limit` waiting slots, in (step, index) order, of steps up to `max_step`
        (a placement looks at the first few of the earlier steps; scanning every waiting slot
        for each group would make a batch cost O(n^2)).

        The cache holds a prefix of the stored waiting slots (plus those this transaction
        added); when its part up to `max_step` has run short of `limit` while more are stored,
        it is loaded again (after a flush, so the slots settled since drop out)."""
        if self._waiting is None and not self._open_step_up_to(max_step):
            return []  # nothing to load: every waiting slot is in an open step
        for _ in range(2):
            self.waiting()
            found: list[SlotRow] = []
            for step in sorted(self._waiting_by_step):
                if step > max_step or len(found) >= limit:
                    break
                found.extend(self._waiting_by_step[step][: limit - len(found)])
            bound = self._waiting_loaded_to
            # Stored slots that were not loaded all come after `bound`: the answer is exact
            # unless it needs slots past `bound` (it ran short, or holds slots this
            # transaction added past it) of steps that unloaded slots may belong to.
            if (
                bound is None
                or bound[0] > max_step
                or (len(found) >= limit and (found[-1].step, found[-1].idx) <= bound)
            ):
                break
            # A fresh prefix, at least `limit` long: then the second look is exact.
            self._waiting = None
            self._waiting_chunk = max(self._waiting_chunk, limit)
        return found

    # --- open slots, for placements that may take any of them ---------------------------------

    def open_slots(self, max_step: int, limit: int) -> list[SlotRow]:
        """The first `limit` open slots of open steps up to `max_step` in (step, index) order,
        as the database would return them after a flush, without a flush and a query per
        placement.

        Placement order puts a step's slots waiting on a replacement first; the caller merges
        `waiting_up_to` (those, exactly) and sorts. That holds every slot of the first `limit`
        in placement order: a slot not waiting has no more slots before it in (step, index)
        order than in placement order.

        A prefix of that order is loaded once per transaction (read in the order of the
        `ix_slots_open` index, not sorted). Slots only leave it during the transaction (filled
        or shrunk, checked here on use), except a lender's slot that a borrow re-opens, which
        `waiting()` holds. While the prefix still has `limit` usable slots, or reaches past
        `max_step`, or is the whole set, its usable slots are the answer; otherwise it is
        loaded again.
        """
        found: list[SlotRow] = []
        if self._open_slots is None and not self._open_step_up_to(max_step):
            return found
        for _ in range(2):
            if self._open_slots is None:
                self.flush()
                self._adopt_open_slots(self.rows.load(SlotRow, sql.open_slots(self.run.id, limit=self._open_chunk)))
            # A scan that stops at the answer: this runs for every placement of a batch, and
            # the prefix is about a batch long.
            loaded = self._open_slots
            found, settled, scanned, step_open = [], 0, 0, {}
            past_max_step = False
            for slot in loaded:
                scanned += 1
                if slot.status != _SLOT_OPEN:
                    settled += 1
                    continue
                step = slot.step
                if step > max_step:
                    past_max_step = True
                    break
                is_open = step_open.get(step)
                if is_open is None:
                    is_open = step_open[step] = self.step_open(step)
                if is_open:
                    found.append(slot)
                    if len(found) >= limit:
                        break
            if settled:
                # Drop what has settled, so later calls do not look at it again.
                self._open_slots = [s for s in loaded[:scanned] if s.status == _SLOT_OPEN] + loaded[scanned:]
            # A slot's place in (step, index) order never changes, so the loaded order is the
            # current one: the answer is exact when it is whole, when the prefix reaches past
            # `max_step`, or when the prefix is every stored open slot.
            if len(found) >= limit or past_max_step or not self._open_slots_truncated:
                return found
            self._open_slots = None
        return found

    def _adopt_open_slots(self, rows: list[SlotRow] | None) -> None:
        if rows is None:
            return  # not read (its `read_ahead` condition did not hold): loaded on first use
        self._open_slots = rows
        self._open_slots_truncated = len(rows) == self._open_chunk

    # --- what a batch of results reads before it decides -------------------------------------

    def read_ahead(self, reads: list[Read], *, waiting: When, lendable: bool, open_slots: When) -> list[Any]:
        """Run the caller's `reads` with the run's unfinished steps, the first loads of the
        caches a batch of results will look up (`waiting` slots, `lendable` groups and spare
        prompts, a prefix of `open_slots`, whose live attempts `live_attempt` reads on first use)
        and the blocks of ids it said it expects to use (`IdBlocks.expect`) in one round trip
        (`RowStore.load_all`), before the batch changes anything; returns the rows of the
        caller's reads. A cache's flag may be a condition (SQL over the parameters of the
        caller's reads, `joint_read.When`): where it does not hold, the cache is not read, and
        loads on first use if used after all.

        Loaded one by one on first use, each cache would flush the batch's changes first."""
        self.flush()
        parts: list[tuple[list[Read], Callable[..., None]]] = []
        if not self._unfinished_read:
            parts.append(([Read(StepRow, sql.unfinished_steps(self.run.id))], self._adopt_unfinished))
        if waiting is not False and self._waiting is None:
            parts.append(([Read(SlotRow, sql.open_slots(self.run.id, limit=self._waiting_chunk, waiting=True), when=condition(waiting))], self._adopt_waiting))
        if lendable and self._lendable_parked is None:
            committed, parked = sql.lendable(self.run.id, self.settings.max_lookahead_versions, self._lendable_chunk)
            parts.append(([Read(SlotRow, committed, extra=("lender_version",)), Read(None, parked, extra=("attempt_id", "weight_version"))], self._adopt_lendable))
        if lendable and self._spares_db is None and not self._spares_db_done:
            parts.append(([Read(SpareRow, sql.spares(self.run.id, self._spares_last_id, self._spare_chunk))], self._adopt_spares))
        if open_slots is not False and self._open_slots is None:
            parts.append(([Read(SlotRow, sql.open_slots(self.run.id, limit=self._open_chunk), when=condition(open_slots))], self._adopt_open_slots))
        drawing = self.ids.expected_read() if self.ids is not None else None
        if drawing is not None:
            parts.append(([drawing], self.ids.adopt_expected))
        found = self.rows.load_all([*reads, *(read for part, _ in parts for read in part)])
        at = len(reads)
        for part, adopt in parts:
            adopt(*found[at : at + len(part)])
            at += len(part)
        return found[: len(reads)]

    def waiting_added(self, slot: SlotRow) -> None:
        if self._waiting is not None:
            key = (slot.step, slot.idx)
            if key in self._waiting:
                return
            self._waiting[key] = slot
            insort(self._waiting_by_step.setdefault(slot.step, []), slot, key=_slot_index)

    def waiting_removed(self, slot: SlotRow) -> None:
        if self._waiting is not None and self._waiting.pop((slot.step, slot.idx), None) is not None:
            by_step = self._waiting_by_step[slot.step]
            del by_step[bisect_left(by_step, slot.idx, key=_slot_index)]
            if not by_step:
                del self._waiting_by_step[slot.step]
