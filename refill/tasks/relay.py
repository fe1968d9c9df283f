"""The outbox relay: publish what the ledger decided, then record that it was published.

Claiming, publishing and marking happen in one transaction. If publishing fails half-way the
transaction rolls back and every row stays unsent, so some messages may go out twice: the
receivers are idempotent by attempt id or step (SPEC §2, at least once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import Celery

from refill.models.context import utcnow
from refill.models.db import Ledger
from refill.models.outbox import Outgoing, claim_outbox, mark_sent
from refill.tasks.queues import TASK_GENERATE, TASK_TRAIN_STEP

log = logging.getLogger(__name__)

TASK_OF_QUEUE = {"generate": TASK_GENERATE, "train": TASK_TRAIN_STEP}


def publish(app: Celery, messages: Iterable[Outgoing]) -> int:
    count = 0
    with app.producer_or_acquire() as producer:
        for message in messages:
            app.send_task(
                TASK_OF_QUEUE[message.queue],
                args=[message.body],
                queue=message.queue,
                routing_key=message.queue,
                producer=producer,
                serializer="json",
                # Celery would otherwise repr the whole body for the message's headers.
                argsrepr=_describe(message),
                kwargsrepr="{}",
            )
            count += 1
    return count


def _describe(message: Outgoing) -> str:
    body = message.body
    if "attempt_id" in body:
        return f"[run {body.get('run_id')} attempt {body['attempt_id']}]"
    return f"[run {body.get('run_id')} step {body.get('step')}]"


def relay(
    ledger: Ledger,
    app: Celery,
    *,
    claimer: str,
    ids: list[int] | None = None,
    run_id: int | None = None,
    limit: int = 1000,
) -> int:
    """Send due outbox rows (only `ids`, or those of `run_id`, when given); returns how many."""
    if ids is not None and not ids:
        return 0

    def send(session) -> int:  # type: ignore[no-untyped-def]
        now = utcnow()
        messages = claim_outbox(session, claimer=claimer, now=now, limit=limit, ids=ids, run_id=run_id)
        sent = publish(app, messages)
        mark_sent(session, messages, now)
        return sent

    return ledger.transaction(send, what="outbox relay")
