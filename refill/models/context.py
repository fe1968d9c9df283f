"""The unit of work of one run inside one transaction.

A `RunContext` is what every ledger operation that changes scheduling state works through:
the locked run row, its settings and sampler, the transaction's clock, and the outbox rows it
wrote (so a caller can relay them at once after commit instead of waiting for the relay's
next tick).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.models.db import lock_run
from refill.models.samplers import Sampler
from refill.models.settings import LedgerSettings, settings_for
from refill.models.tables import Outbox, Run, RunStatus, Slot, SparePrompt, Step


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
    _spare_count: int | None = None

    @classmethod
    def open(cls, session: Session, run_id: int, now: datetime | None = None) -> RunContext:
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

    # The spare pool size is read often (every replacement) and changed only through this
    # context while the run is locked, so it is counted once per transaction and kept here.
    @property
    def spare_count(self) -> int:
        if self._spare_count is None:
            self._spare_count = self.session.scalar(
                select(func.count())
                .select_from(SparePrompt)
                .where(SparePrompt.run_id == self.run.id, SparePrompt.taken_at.is_(None))
            ) or 0
        return self._spare_count

    def spare_changed(self, delta: int) -> None:
        self._spare_count = self.spare_count + delta

    @property
    def outbox_ids(self) -> list[int]:
        return [row.id for row in self.outbox]
