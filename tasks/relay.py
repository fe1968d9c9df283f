"""The outbox relay: publish what the ledger decided, then record that it was published.

Claiming, publishing and marking happen in one transaction. If publishing fails half-way the
transaction rolls back and every row stays unsent, so some messages may go out twice: the
receivers are idempotent by attempt id or step (SPEC §2, at least once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import Celery

from refill.models.clock import ledger_now
from refill.models.db import Ledger
from refill.models.outbox import Outgoing, claim_outbox, mark_sent
from refill.tasks.queues import TASK_GENERATE, TASK_TRAIN_STEP

log = logging.getLogger(__name__)

TASK_OF_QUEUE = {"generate": TASK_GENERATE, "train": TASK_TRAIN_STEP}

#: Attempts of one run per `generate` message at most. Celery costs about a millisecond of CPU
#: per message on each side; the attempts a relay sends together share one message, and the
#: worker runs them concurrently, so its engine batches them as it did separate messages.
GENERATE_BUNDLE = 8


def publish(app: Celery, messages: Iterable[Outgoing]) -> int:
    """Send the messages (generate ones in bundles); returns how many outbox rows went out."""
    count = 0
    with app.producer_or_acquire() as producer:
        for queue, rows in _envelopes(messages):
            body = rows[0].body if len(rows) == 1 else {"bundle": [row.body for row in rows]}
            app.send_task(
                TASK_OF_QUEUE[queue],
                args=[body],
                queue=queue,
                routing_key=queue,
                producer=producer,
                serializer="json",
                # Celery would otherwise repr the whole body for the message's headers.
                argsrepr=_describe(rows),
                kwargsrepr="{}",
            )
            count += len(rows)
    return count


def _envelopes(messages: Iterable[Outgoing]) -> list[tuple[str, list[Outgoing]]]:
    """The messages in sending order, generate ones of the same run gathered into bundles of
    at most GENERATE_BUNDLE."""
    out: list[tuple[str, list[Outgoing]]] = []
    open_bundles: dict[int, list[Outgoing]] = {}
    for message in messages:
        if message.queue != "generate":
            out.append((message.queue, [message]))
            continue
        run = message.run_id
        bundle = open_bundles.get(run)
        if bundle is None or len(bundle) >= GENERATE_BUNDLE:
            bundle = open_bundles[run] = []
            out.append((message.queue, bundle))
        bundle.append(message)
    return out


def _describe(rows: list[Outgoing]) -> str:
    body = rows[0].body
    if "attempt_id" in body:
        return f"[run {body.get('run_id')} attempt {','.join(str(r.body.get('attempt_id')) for r in rows)}]"
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
        now = ledger_now(session)  # due times are the ledger's, not this machine's
        messages = claim_outbox(session, claimer=claimer, now=now, limit=limit, ids=ids, run_id=run_id)
        sent = publish(app, messages)
        mark_sent(session, messages, now)
        return sent

    return ledger.transaction(send, what="outbox relay")
