"""The unit of work of one run inside one transaction.

A `RunContext` is what every ledger operation that changes scheduling state works through:
the locked run row, its settings and sampler, the transaction's clock, and the outbox rows it
wrote (so a caller can relay them at once after commit instead of waiting for the relay's
next tick).

It also keeps what a batch of decisions reads again and again — the spare pool, the groups a
slot may borrow, the slots waiting on a replacement — loaded once per transaction and updated
as the batch changes them. Because the run's row is locked, nothing else changes them
meanwhile; entries are still checked against the session's objects when used, so a stale
entry is skipped rather than trusted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from refill.models.db import lock_run
from refill.models.samplers import GroupView, Sampler
from refill.models.settings import LedgerSettings, settings_for
from refill.models.tables import (
    Attempt,
    Group,
    Outbox,
    Run,
    RunStatus,
    Slot,
    SlotStatus,
    SparePrompt,
    Step,
    StepStatus,
)

#: Rows loaded per query by the caches (the spare pool, lenders, waiting slots).
CHUNK = 512


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass
class RunContext:
    session: Session
    run: Run
    settings: LedgerSettings
    sampler: Sampler
    now: datetime
    outbox: list[Outbox] = field(default_factory=list)
    #: live slot-bound attempts created in this transaction, by the slot they serve: no other
    #: transaction can see them yet, so they can be re-aimed in memory.
    new_live: dict[tuple[int, int], Attempt] = field(default_factory=dict)
    _spare_count: int | None = None
    _spares_db: deque[SparePrompt] | None = None
    _spares_db_done: bool = False
    _spares_last_id: int = 0
    _spares_new: deque[SparePrompt] = field(default_factory=deque)
    _lendable: list[GroupView] | None = None
    _waiting: dict[tuple[int, int], Slot] | None = None
    #: groups committed in this transaction (not flushed yet, so not found by session.get)
    new_groups: dict[int, Group] = field(default_factory=dict)
    #: strong references to rows loaded in bulk: the session's identity map holds objects
    #: weakly, and a preloaded row that is dropped would be fetched again one by one.
    pinned: list[object] = field(default_factory=list)

    def pin(self, rows: list) -> list:  # type: ignore[type-arg]
        self.pinned.extend(rows)
        return rows

    @classmethod
    def open(cls, session: Session, run_id: int, now: datetime | None = None) -> RunContext:
        # The ledger code flushes where a query must see this transaction's changes and
        # nowhere else: autoflush before every query would write each result's rows one at
        # a time instead of once per batch.
        session.autoflush = False
        run = lock_run(session, run_id)
        settings = settings_for(run)
        return cls(session, run, settings, settings.sampler(), now or utcnow())

    @property
    def running(self) -> bool:
        return self.run.status == RunStatus.RUNNING.value

    def later(self, seconds: float) -> datetime:
        return self.now + timedelta(seconds=seconds)

    def step(self, step: int) -> Step:
        row = self.session.get(Step, (self.run.id, step))
        if row is None:
            raise LookupError(f"run {self.run.id} has no step {step}")
        return row

    def slot(self, step: int, idx: int) -> Slot:
        row = self.session.get(Slot, (self.run.id, step, idx))
        if row is None:
            raise LookupError(f"run {self.run.id} has no slot ({step}, {idx})")
        return row

    def group(self, attempt_id: int) -> Group | None:
        return self.new_groups.get(attempt_id) or self.session.get(Group, attempt_id)

    def step_open(self, step: int) -> bool:
        # Unfinished steps are preloaded (and pinned) by the operations that need this; a step
        # not in the session is trained or does not exist.
        row = self.session.identity_map.get(identity_key(Step, (self.run.id, step)))
        if row is None:
            row = self.session.get(Step, (self.run.id, step))
            if row is not None:
                self.pinned.append(row)
        return row is not None and row.status == StepStatus.OPEN.value

    @property
    def outbox_ids(self) -> list[int]:
        return [row.id for row in self.outbox]

    # --- the spare pool ------------------------------------------------------------------

    @property
    def spare_count(self) -> int:
        if self._spare_count is None:
            self._spare_count = self.session.scalar(
                select(func.count())
                .select_from(SparePrompt)
                .where(SparePrompt.run_id == self.run.id, SparePrompt.taken_at.is_(None))
            ) or 0
        return self._spare_count

    def spare_added(self, spares: list[SparePrompt]) -> None:
        """Call before adding `spares` to the session (the stored pool is counted first)."""
        self.spare_count  # noqa: B018 - a property that loads the stored count
        self._spares_new.extend(spares)
        self._spare_count = (self._spare_count or 0) + len(spares)

    def next_spare(self) -> SparePrompt | None:
        """The oldest untaken spare: stored ones first (in id order), then this
        transaction's."""
        while not self._spares_db_done:
            if self._spares_db:
                return self._spares_db.popleft()
            self.session.flush()
            fresh = {id(s) for s in self._spares_new}
            rows = list(
                self.session.scalars(
                    select(SparePrompt)
                    .where(
                        SparePrompt.run_id == self.run.id,
                        SparePrompt.taken_at.is_(None),
                        SparePrompt.id > self._spares_last_id,
                    )
                    .order_by(SparePrompt.id)
                    .limit(CHUNK)
                )
            )
            self._spares_db = deque(r for r in rows if r.taken_at is None and id(r) not in fresh)
            if rows:
                self._spares_last_id = rows[-1].id
            if len(rows) < CHUNK:
                self._spares_db_done = not self._spares_db
        if self._spares_new:
            return self._spares_new.popleft()
        return None

    def spare_taken(self) -> None:
        self._spare_count = max(0, self.spare_count - 1)

    # --- groups a slot may borrow ----------------------------------------------------------

    def lendable(self) -> list[GroupView]:
        """Groups committed in open steps, latest steps first, and parked groups."""
        if self._lendable is None:
            self.session.flush()
            rows = self.session.execute(
                select(Slot, Group.weight_version)
                .join(Group, Group.attempt_id == Slot.group_attempt_id)
                .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
                .where(
                    Slot.run_id == self.run.id,
                    Slot.status == SlotStatus.COMMITTED.value,
                    Step.status == StepStatus.OPEN.value,
                )
                .order_by(Slot.step.desc(), Slot.group_attempt_id.desc())
                .limit(CHUNK)
            ).all()
            parked = self.session.scalars(
                select(Group)
                .where(Group.run_id == self.run.id, Group.parked.is_(True))
                .order_by(Group.weight_version, Group.attempt_id)
                .limit(CHUNK)
            ).all()
            self.pin([slot for slot, _ in rows])
            self.pin(list(parked))
            self._lendable = [GroupView(g.attempt_id, g.weight_version, None, None) for g in parked] + [
                GroupView(slot.group_attempt_id, version, slot.step, slot.idx) for slot, version in rows
            ]
        return self._lendable

    def lendable_added(self, view: GroupView) -> None:
        if self._lendable is not None:
            self._lendable.append(view)

    def still_lendable(self, view: GroupView) -> bool:
        if view.step is None:
            group = self.group(view.attempt_id)
            return group is not None and group.parked
        slot = self.session.get(Slot, (self.run.id, view.step, view.idx))
        return (
            slot is not None
            and slot.status == SlotStatus.COMMITTED.value
            and slot.group_attempt_id == view.attempt_id
            and self.step_open(view.step)
        )

    # --- slots waiting on a replacement ----------------------------------------------------

    def waiting(self) -> dict[tuple[int, int], Slot]:
        """Open slots of open steps whose own prompt was filtered or dropped."""
        if self._waiting is None:
            self.session.flush()
            rows = self.session.scalars(
                select(Slot)
                .join(Step, (Step.run_id == Slot.run_id) & (Step.step == Slot.step))
                .where(
                    Slot.run_id == self.run.id,
                    Slot.status == SlotStatus.OPEN.value,
                    Slot.needs_replacement.is_(True),
                    Step.status == StepStatus.OPEN.value,
                )
                .order_by(Slot.step, Slot.idx)
                .limit(CHUNK)
            ).all()
            self._waiting = {(s.step, s.idx): s for s in self.pin(list(rows))}
        return self._waiting

    def waiting_added(self, slot: Slot) -> None:
        if self._waiting is not None:
            self._waiting[(slot.step, slot.idx)] = slot

    def waiting_removed(self, slot: Slot) -> None:
        if self._waiting is not None:
            self._waiting.pop((slot.step, slot.idx), None)
