"""Retention (`refill gc RUN`): a finished run's bulky rows, measured and removed.

What goes, and why nothing that reads the ledger afterwards misses it:

- **payloads**: each committed group's token ids and log-probs (`groups.rollout`) and its
  completions' texts (`groups.completion_texts`), emptied in place. Only the trainer reads them,
  and a finished run trains no more; the group rows stay, with the rewards, weight version,
  step and tokens that the views of migration 0002 and `refill check` read.
- **stored payloads**: the files of the claim check (`<run_dir>/payloads`,
  `refill.models.payload_store`), the same data for groups committed by reference; the whole
  store goes (`refill check` does not look for a finished run's store once it is gone).
- **rejected results**: `rejected_results` rows (duplicates, late results, malformed bodies):
  a record of what had no effect; `refill run show` and `refill slot` count them, nothing
  checks them.
- **relayed outbox rows**: train_step messages that went out; `refill check` reads the outbox
  only while a run runs (a released step's train_step message).

A run that can still resume (stopped, or failed with its fleet) is refused: its trainer would
need the payloads. Everything is removed in chunks, one transaction each, so a large run does
not hold locks or a huge transaction; a gc that is interrupted is simply run again.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, cast, delete, func, select, update
from sqlalchemy.orm import Session

from refill.models.db import Ledger
from refill.models.payload_store import FileStore
from refill.models.tables import Group, Outbox, RejectedResult, Run, RunStatus

#: rows per transaction
CHUNK = 5000


class NotFinished(ValueError):
    """The run may still train (or resume), so its rows are not garbage yet."""


@dataclass(frozen=True)
class Garbage:
    """What gc would remove (or removed) of one kind: rows and about how many bytes."""

    kind: str
    rows: int
    bytes: int

    def as_dict(self) -> dict[str, int | str]:
        return {"kind": self.kind, "rows": self.rows, "bytes": self.bytes}


def finished_run(session: Session, run_id: int) -> Run:
    """The run, if it is finished for good; LookupError or NotFinished otherwise."""
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    if run.status == RunStatus.COMPLETED.value:
        return run
    if run.status == RunStatus.FAILED.value and run.end_reason != "fleet_failed":
        return run
    if run.status in (RunStatus.STOPPED.value, RunStatus.FAILED.value):
        raise NotFinished(
            f"run {run_id} is {run.status} and can be resumed (`refill run resume {run_id}`), "
            "which needs its payloads; gc only a completed or finally failed run"
        )
    raise NotFinished(f"run {run_id} is {run.status}; gc only a completed or finally failed run")


def _payload_left(run_id: int):  # type: ignore[no-untyped-def]
    return (Group.run_id == run_id, func.length(Group.rollout) > 0)


def measure(session: Session, run_id: int) -> list[Garbage]:
    """What `collect` would remove of a finished run, per kind."""
    run = finished_run(session, run_id)
    stored_files, stored_bytes = FileStore.of_run(run.run_dir).measure()
    payload_rows, payload_bytes = session.execute(
        select(
            func.count(),
            func.coalesce(
                func.sum(func.length(Group.rollout) + func.length(cast(Group.completion_texts, String))), 0
            ),
        ).where(*_payload_left(run_id))
    ).one()
    rejected_rows, rejected_bytes = session.execute(
        select(func.count(), func.coalesce(func.sum(func.length(func.coalesce(RejectedResult.detail, ""))), 0)).where(
            RejectedResult.run_id == run_id
        )
    ).one()
    outbox_rows, outbox_bytes = session.execute(
        select(func.count(), func.coalesce(func.sum(func.length(cast(Outbox.payload, String))), 0)).where(
            Outbox.run_id == run_id, Outbox.sent_at.is_not(None)
        )
    ).one()
    return [
        Garbage("payloads", int(payload_rows), int(payload_bytes)),
        Garbage("stored payloads", stored_files, stored_bytes),
        Garbage("rejected results", int(rejected_rows), int(rejected_bytes)),
        Garbage("relayed outbox rows", int(outbox_rows), int(outbox_bytes)),
    ]


def collect(ledger: Ledger, run_id: int) -> list[Garbage]:
    """Remove a finished run's bulky rows (see the module's docstring); returns what went."""
    before = ledger.transaction(lambda s: measure(s, run_id), what="measure garbage")
    payloads = _in_chunks(ledger, lambda s: _empty_payloads(s, run_id))
    run_dir = ledger.transaction(lambda s: finished_run(s, run_id).run_dir, what="find the run's directory")
    stored = FileStore.of_run(run_dir).remove_all()
    rejected = _in_chunks(ledger, lambda s: _delete_ids(s, run_id, RejectedResult, RejectedResult.run_id == run_id))
    relayed = _in_chunks(
        ledger, lambda s: _delete_ids(s, run_id, Outbox, Outbox.run_id == run_id, Outbox.sent_at.is_not(None))
    )
    sizes = {g.kind: g.bytes for g in before}
    return [
        Garbage("payloads", payloads, sizes["payloads"]),
        Garbage("stored payloads", stored, sizes["stored payloads"]),
        Garbage("rejected results", rejected, sizes["rejected results"]),
        Garbage("relayed outbox rows", relayed, sizes["relayed outbox rows"]),
    ]


def _in_chunks(ledger: Ledger, step) -> int:  # type: ignore[no-untyped-def]
    total = 0
    while True:
        done = ledger.transaction(step, what="gc")
        total += done
        if done < CHUNK:
            return total


def _empty_payloads(session: Session, run_id: int) -> int:
    # The run is checked in every chunk's transaction: a resume between two chunks stops gc.
    finished_run(session, run_id)
    ids = list(
        session.scalars(select(Group.attempt_id).where(*_payload_left(run_id)).order_by(Group.attempt_id).limit(CHUNK))
    )
    if ids:
        session.execute(
            update(Group).where(Group.attempt_id.in_(ids)).values(rollout=b"", completion_texts=[]),
            execution_options={"synchronize_session": False},
        )
    return len(ids)


def _delete_ids(session: Session, run_id: int, table, *where) -> int:  # type: ignore[no-untyped-def]
    finished_run(session, run_id)
    ids = list(session.scalars(select(table.id).where(*where).order_by(table.id).limit(CHUNK)))
    if ids:
        session.execute(delete(table).where(table.id.in_(ids)), execution_options={"synchronize_session": False})
    return len(ids)
