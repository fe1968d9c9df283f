"""The outbox relay's side of the ledger: claim unsent messages, build them, mark them sent.

Rows are written in the same transaction as the decision that needs them (SPEC §2) and sent at
least once: a relay that dies after publishing and before `mark_sent` makes the row
claimable again when its claim expires, and the receivers ignore the repeat (a generate
message for an attempt that is no longer pending is skipped by the worker's lease handshake;
a train_step for a trained step is a no-op).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from refill.models.context import literal_in
from refill.models.payload import GenerateMessage
from refill.models.settings import settings_for
from refill.models.tables import (
    Attempt,
    AttemptState,
    Outbox,
    OutboxKind,
    Prompt,
    Run,
    RunStatus,
)

QUEUE_OF = {OutboxKind.GENERATE.value: "generate", OutboxKind.TRAIN_STEP.value: "train"}


@dataclass(frozen=True)
class Outgoing:
    outbox_id: int
    kind: str
    queue: str
    run_id: int
    body: dict[str, Any]


def claim_outbox(
    session: Session,
    *,
    claimer: str,
    now: datetime,
    limit: int = 500,
    claim_seconds: float = 30.0,
    ids: list[int] | None = None,
    run_id: int | None = None,
) -> list[Outgoing]:
    """Claim up to `limit` due, unsent rows and return the messages to publish.

    Rows whose message no longer makes sense (the attempt was cancelled, the run ended) are
    marked sent without a message, so the outbox drains.
    """
    table = Outbox.__table__
    query = (
        select(table.c.id, table.c.run_id, table.c.kind, table.c.attempt_id, table.c.payload)
        .where(
            table.c.sent_at.is_(None),
            table.c.available_at <= now,
            or_(table.c.claimed_until.is_(None), table.c.claimed_until < now),
        )
        .order_by(table.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if ids is not None:
        query = query.where(literal_in(table.c.id, ids))
    if run_id is not None:
        query = query.where(table.c.run_id == run_id)
    # Plain rows, not ORM objects, and one UPDATE per kind of change below: a relay pass
    # handles up to `limit` rows, and the ORM's per-object bookkeeping cost more than the SQL.
    rows = session.execute(query).all()
    if not rows:
        return []
    runs = {r.id: r for r in session.scalars(select(Run).where(literal_in(Run.id, {row.run_id for row in rows})))}
    attempt_ids = [row.attempt_id for row in rows if row.attempt_id is not None]
    attempts = {
        found.id: found
        for found in session.execute(
            select(Attempt.id, Attempt.state, Attempt.min_weight_version, Prompt.text, Prompt.row)
            .join(Prompt, Prompt.id == Attempt.prompt_id)
            .where(literal_in(Attempt.id, attempt_ids))
        ).all()
    } if attempt_ids else {}
    out: list[Outgoing] = []
    moot: list[int] = []
    for row in rows:
        body = _body(row, runs[row.run_id], attempts)
        if body is None:
            moot.append(row.id)
            continue
        out.append(Outgoing(row.id, row.kind, QUEUE_OF[row.kind], row.run_id, body))
    if moot:
        session.execute(update(table).where(literal_in(table.c.id, moot)).values(sent_at=now))
    if out:
        session.execute(
            update(table)
            .where(literal_in(table.c.id, [m.outbox_id for m in out]))
            .values(
                claimed_by=claimer[:200],
                claimed_until=now + timedelta(seconds=claim_seconds),
                send_count=table.c.send_count + 1,
            )
        )
    return out


def _body(row: Any, run: Run, attempts: dict[int, Any]) -> dict[str, Any] | None:
    if run.status != RunStatus.RUNNING.value:
        return None
    if row.kind == OutboxKind.TRAIN_STEP.value:
        return dict(row.payload)
    found = attempts.get(row.attempt_id or -1)
    if found is None:
        return None
    if found.state not in (AttemptState.PENDING.value, AttemptState.QUEUED.value):
        return None
    settings = settings_for(run)
    return GenerateMessage(
        run_id=run.id,
        attempt_id=found.id,
        prompt=found.text,
        row=found.row,
        n=settings.group_size,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=(settings.seed * 1_000_003 + found.id) % 2**31,
        min_weight_version=found.min_weight_version,
    ).to_json()


def mark_sent(session: Session, sent: list[Outgoing], now: datetime) -> None:
    """Record that these messages reached the broker; their attempts are now queued."""
    if not sent:
        return
    table = Outbox.__table__
    session.execute(update(table).where(literal_in(table.c.id, [m.outbox_id for m in sent])).values(sent_at=now))
    by_run: dict[int, list[int]] = {}
    for message in sent:
        if message.kind == OutboxKind.GENERATE.value:
            by_run.setdefault(message.run_id, []).append(message.body["attempt_id"])
    for run_id, attempt_ids in by_run.items():
        run = session.get(Run, run_id)
        assert run is not None
        timeout = timedelta(seconds=settings_for(run).queue_timeout_seconds)
        # Only a pending attempt becomes queued: a fast worker may already hold its lease.
        attempts = Attempt.__table__
        session.execute(
            update(attempts)
            .where(literal_in(attempts.c.id, attempt_ids), attempts.c.state == AttemptState.PENDING.value)
            .values(state=AttemptState.QUEUED.value, dispatched_at=now, leased_until=now + timeout)
        )
