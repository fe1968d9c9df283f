"""The results consumer: group commit of results into the ledger.

Each `refill.record_result` task (one per result, on a `threads` pool) submits its body and
blocks until the batch it joined is committed; only then does Celery acknowledge the message.
A consumer killed mid-batch therefore rolls back and leaves every message of the batch to be
delivered again, and the ledger's attempt-keyed idempotency makes the second delivery of an
already-committed result a recorded no-op.

Batching several results per transaction amortises the run-row lock and the round trips;
after commit, the outbox rows the batch wrote (replacement dispatches, train_step releases)
are relayed at once rather than at the controller's next tick.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from refill.batching import MicroBatcher
from refill.models.context import utcnow
from refill.models.db import Ledger
from refill.models.payload import PayloadError, ResultMessage
from refill.models.results import record_results
from refill.models.tables import RejectedResult, RejectReason
from refill.tasks.chaos import ConsumerChaos

log = logging.getLogger(__name__)


class ResultConsumer:
    def __init__(
        self,
        ledger: Ledger,
        *,
        after_commit: Callable[[list[int]], int] | None = None,
        max_batch: int = 64,
        max_wait_ms: float = 20.0,
    ) -> None:
        self.ledger = ledger
        self.after_commit = after_commit
        self._chaos = ConsumerChaos()  # inert unless the fault suite sets its knob
        self._batcher: MicroBatcher[dict[str, Any], str] = MicroBatcher(
            self._process, max_batch=max_batch, max_wait_ms=max_wait_ms, name="results-consumer"
        )

    def submit(self, body: dict[str, Any]) -> str:
        """Record one result; returns its outcome once the batch it joined is committed."""
        return self._batcher.submit(body)

    def _process(self, bodies: list[dict[str, Any]]) -> list[str]:
        decoded: list[tuple[int, ResultMessage]] = []
        malformed: list[tuple[int, dict[str, Any], str]] = []
        for i, body in enumerate(bodies):
            try:
                decoded.append((i, ResultMessage.from_json(body)))
            except PayloadError as error:
                malformed.append((i, body if isinstance(body, dict) else {}, str(error)))

        def write(session: Session):  # type: ignore[no-untyped-def]
            now = utcnow()
            for _, body, error in malformed:
                session.add(
                    RejectedResult(
                        run_id=_int_or_none(body.get("run_id")),
                        attempt_id=_int_or_none(body.get("attempt_id")),
                        reason=RejectReason.MALFORMED.value,
                        worker=str(body.get("worker", "?"))[:200],
                        detail=error[:2000],
                        received_at=now,
                    )
                )
            recorded = record_results(session, [message for _, message in decoded], now)
            self._chaos.before_commit([message.attempt_id for _, message in decoded])
            return recorded

        batch = self.ledger.transaction(write, what="record results")
        outcomes = ["MALFORMED"] * len(bodies)
        for (i, _), recorded in zip(decoded, batch.outcomes, strict=True):
            outcomes[i] = recorded.outcome.value
        for _, _, error in malformed:
            log.error("refused malformed result: %s", error)
        if self.after_commit is not None and batch.outbox_ids:
            try:
                self.after_commit(batch.outbox_ids)
            except Exception as error:  # noqa: BLE001 - the rows stay in the outbox for the relay
                log.warning("immediate relay failed (%r); the controller's relay will send them", error)
        return outcomes

    def close(self) -> None:
        self._batcher.close(timeout=30)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
