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
    query = (
        select(Outbox)
        .where(
            Outbox.sent_at.is_(None),
            Outbox.available_at <= now,
            or_(Outbox.claimed_until.is_(None), Outbox.claimed_until < now),
        )
        .order_by(Outbox.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if ids is not None:
        query = query.where(Outbox.id.in_(ids))
    if run_id is not None:
        query = query.where(Outbox.run_id == run_id)
    rows = list(session.scalars(query))
    if not rows:
        return []
    runs = {r.id: r for r in session.scalars(select(Run).where(Run.id.in_({row.run_id for row in rows})))}
    attempt_ids = [row.attempt_id for row in rows if row.attempt_id is not None]
    attempts = {
        a.id: (a, p)
        for a, p in session.execute(
            select(Attempt, Prompt).join(Prompt, Prompt.id == Attempt.prompt_id).where(Attempt.id.in_(attempt_ids))
        ).all()
    }
    until = now + timedelta(seconds=claim_seconds)
    out: list[Outgoing] = []
    for row in rows:
        run = runs[row.run_id]
        body = _body(row, run, attempts)
        if body is None:
            row.sent_at = now
            continue
        row.claimed_by = claimer[:200]
        row.claimed_until = until
        row.send_count += 1
        out.append(Outgoing(row.id, row.kind, QUEUE_OF[row.kind], row.run_id, body))
    return out


def _body(row: Outbox, run: Run, attempts: dict[int, tuple[Attempt, Prompt]]) -> dict[str, Any] | None:
    if run.status != RunStatus.RUNNING.value:
        return None
    if row.kind == OutboxKind.TRAIN_STEP.value:
        return dict(row.payload)
    found = attempts.get(row.attempt_id or -1)
    if found is None:
        return None
    attempt, prompt = found
    if attempt.state not in (AttemptState.PENDING.value, AttemptState.QUEUED.value):
        return None
    settings = settings_for(run)
    return GenerateMessage(
        run_id=run.id,
        attempt_id=attempt.id,
        prompt=prompt.text,
        row=prompt.row,
        n=settings.group_size,
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=(settings.seed * 1_000_003 + attempt.id) % 2**31,
        min_weight_version=attempt.min_weight_version,
    ).to_json()


def mark_sent(session: Session, sent: list[Outgoing], now: datetime) -> None:
    """Record that these messages reached the broker; their attempts are now queued."""
    if not sent:
        return
    session.execute(
        update(Outbox)
        .where(Outbox.id.in_([m.outbox_id for m in sent]))
        .values(sent_at=now)
        .execution_options(synchronize_session=False)
    )
    by_run: dict[int, list[int]] = {}
    for message in sent:
        if message.kind == OutboxKind.GENERATE.value:
            by_run.setdefault(message.run_id, []).append(message.body["attempt_id"])
    for run_id, attempt_ids in by_run.items():
        run = session.get(Run, run_id)
        assert run is not None
        timeout = timedelta(seconds=settings_for(run).queue_timeout_seconds)
        # Only a pending attempt becomes queued: a fast worker may already hold its lease.
        session.execute(
            update(Attempt)
            .where(Attempt.id.in_(attempt_ids), Attempt.state == AttemptState.PENDING.value)
            .values(state=AttemptState.QUEUED.value, dispatched_at=now, leased_until=now + timeout)
            .execution_options(synchronize_session=False)
        )
