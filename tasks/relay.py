"""The relay: publish what the ledger decided, then record that it was published.

What it sends is in the ledger (`refill.models.outbox`): pending attempts, each a generate
message, and the outbox's train_step rows. Claiming, publishing and marking happen in one
transaction. If publishing fails half-way the transaction rolls back and every attempt stays
pending and every row unsent, so some messages may go out twice: the receivers are idempotent by
attempt id or step (SPEC §2, at least once).

Runs that share a fleet share its generation workers by `run.share`: the relay keeps at most
`run.share * REFILL_QUEUED_PER_SHARE` of a run's attempts waiting on the broker and sends the
rest as workers take them (`refill.models.outbox.queue_room` says why that is fair).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from celery import Celery

from refill.config.environment import positive_int
from refill.models.clock import ledger_now_in
from refill.models.db import Ledger
from refill.models.outbox import Outgoing, ToSend, claim_outbox, mark_sent
from refill.tasks.queues import TASK_GENERATE, TASK_TRAIN_STEP

log = logging.getLogger(__name__)

TASK_OF_QUEUE = {"generate": TASK_GENERATE, "train": TASK_TRAIN_STEP}

#: Attempts of one run per `generate` message at most. Celery costs about a millisecond of CPU
#: per message on each side; the attempts a relay sends together share one message, and the
#: worker runs them concurrently, so its engine batches them as it did separate messages.
GENERATE_BUNDLE = 8

#: Attempts of a run with `run.share: 1` that may wait on the broker at once. It must cover what
#: the fleet takes between two relay passes (else workers idle), and shares bite only while a
#: run has more work than this (else every run sends all it has). See docs/SCALE.md.
QUEUED_PER_SHARE_ENV = "REFILL_QUEUED_PER_SHARE"
DEFAULT_QUEUED_PER_SHARE = 256


def queued_per_share() -> int:
    """REFILL_QUEUED_PER_SHARE, or its default; a value that is not a positive integer is refused."""
    return positive_int(QUEUED_PER_SHARE_ENV, DEFAULT_QUEUED_PER_SHARE, "attempts per unit of run.share")


def publish(app: Celery, messages: Iterable[Outgoing]) -> int:
    """Send the messages (generate ones in bundles); returns how many went out."""
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
    only: ToSend | None = None,
    run_id: int | None = None,
    limit: int = 1000,
) -> int:
    """Send due messages (only those `only` names, or those of `run_id`, when given); returns
    how many."""
    if only is not None and not only:
        return 0

    def send(session) -> int:  # type: ignore[no-untyped-def]
        # Due times are the ledger's, not this machine's: its now(), written into the statements
        # (`ledger_now_in`) rather than read first, a round trip per pass.
        now = ledger_now_in(session)
        # No claim of its own (`claim_seconds=None`): this transaction marks them sent, and
        # until it ends its row locks keep other relays off them.
        messages = claim_outbox(
            session,
            claimer=claimer,
            now=now,
            limit=limit,
            only=only,
            run_id=run_id,
            queued_per_share=window,
            claim_seconds=None,
        )
        sent = publish(app, messages)
        mark_sent(session, messages, now)
        return sent

    window = queued_per_share()
    return ledger.transaction(send, what="outbox relay")

