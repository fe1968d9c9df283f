"""The results consumer: group commit of results into the ledger.

Each `refill.record_result` task (one per result, on a `threads` pool) submits its body and
blocks until the batch it joined is committed; only then does Celery acknowledge the message.
A consumer killed mid-batch therefore rolls back and leaves every message of the batch to be
delivered again, and the ledger's attempt-keyed idempotency makes the second delivery of an
already-committed result a recorded no-op.

Batching several results per transaction amortises the run-row lock and the round trips;
after commit, what the batch left to send (its new attempts: replacements, extras; the
train_step of a release) is relayed at once rather than at the controller's next tick, and the
stored payloads it did not commit (filtered, failed, refused claim checks) are removed, both on
threads of their own.
A claim check's body is a few hundred bytes whatever the rollout's length: the consumer never
reads a payload.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from refill.config import from_snapshot
from refill.drain import Drain
from refill.microbatcher import MicroBatcher
from refill.models.clock import ledger_now
from refill.models.db import Ledger
from refill.models.outbox import ToSend
from refill.models.payload import PayloadError, ResultMessage
from refill.models.payload_store import FileStore, Remover
from refill.models.results import record_results
from refill.models.tables import RejectedResult, RejectReason, Run
from refill.tasks.chaos import ConsumerChaos

log = logging.getLogger(__name__)


class ResultConsumer:
    def __init__(
        self,
        ledger: Ledger,
        *,
        after_commit: Callable[[ToSend], int] | None = None,
        max_batch: int = 256,
        max_wait_ms: float = 20.0,
    ) -> None:
        """A batch records at most `max_batch` results, gathered for at most `max_wait_ms` after
        the first. A fleet's consumer serves every run, so these defaults are its, not a run's
        config's; its threads (`refill worker consume --concurrency`) bound the messages a batch
        can gather (each a result or a worker's bundle of them)."""
        self.ledger = ledger
        # What a batch left to send is relayed by a thread of their own, so publishing
        # them overlaps the next batch instead of delaying it (they are in the ledger: a relay
        # that fails or never runs leaves them to the controller's).
        self._relay = Drain(_relaying(after_commit), name="consumer-relay") if after_commit is not None else None
        self._chaos = ConsumerChaos()  # inert unless the fault suite sets its knob
        self._max_bytes: dict[int, int] = {}  # run -> infra.max_result_bytes (runs' configs never change)
        self._stores: dict[int, FileStore] = {}  # run -> its payload store
        self._remover = Remover()
        self._batcher: MicroBatcher[ResultMessage | _Malformed, str] = MicroBatcher(
            self._process, max_batch=max_batch, max_wait_ms=max_wait_ms, name="results-consumer"
        )

    def submit(self, body: dict[str, Any]) -> str:
        """Record one result, or a bundle of them (`{"bundle": [result, ...]}`, as a worker's
        ResultSender sends them); returns the outcome(s) once every batch they joined is
        committed, so the message is acknowledged only then.

        Results are decoded here, in the task's thread, not in the batch's: the batches are
        recorded one at a time, and decoding 16 completions of token ids and log-probs
        overlaps the batch in flight instead of adding to it."""
        bundle = body.get("bundle") if isinstance(body, dict) else None
        if not isinstance(bundle, list):
            return self._batcher.submit(_decode(body))
        # Queued together: the batcher's thread is woken once for the bundle, not once per
        # result, and a batch that starts takes the whole bundle.
        outcomes = self._batcher.submit_many([_decode(item) for item in bundle])
        counts: dict[str, int] = {}
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # the batch failed: the message is delivered again
            counts[outcome] = counts.get(outcome, 0) + 1
        return " ".join(f"{outcome}x{count}" for outcome, count in sorted(counts.items()))

    def _process(self, items: list[ResultMessage | _Malformed]) -> list[str]:
        decoded: list[tuple[int, ResultMessage]] = []
        malformed: list[tuple[int, dict[str, Any], str]] = []
        for i, item in enumerate(items):
            if isinstance(item, _Malformed):
                malformed.append((i, item.body, item.error))
            else:
                decoded.append((i, item))

        def write(session: Session):  # type: ignore[no-untyped-def]
            # The clock comes with the run lock in record_results; only refusals read it here.
            now = ledger_now(session) if malformed else None
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
            limits = self._result_limits(session, {message.run_id for _, message in decoded})
            messages = [_within_limit(message, limits.get(message.run_id)) for _, message in decoded]
            recorded = record_results(session, messages, now)
            self._chaos.before_commit([message.attempt_id for _, message in decoded])
            return recorded

        batch = self.ledger.transaction(write, what="record results")
        outcomes = ["MALFORMED"] * len(items)
        for (i, _), recorded in zip(decoded, batch.outcomes, strict=True):
            outcomes[i] = recorded.outcome.value
        for _, _, error in malformed:
            log.error("refused malformed result: %s", error)
        if self._relay is not None and batch.to_send:
            self._relay.submit([batch.to_send])
        discarded: dict[int, list[str]] = {}
        for run_id, name in batch.discarded:
            discarded.setdefault(run_id, []).append(name)
        for run_id, names in discarded.items():
            store = self._stores.get(run_id)
            if store is not None:
                self._remover.submit(store, names)
        return outcomes

    def _result_limits(self, session: Session, run_ids: set[int]) -> dict[int, int]:
        missing = [r for r in run_ids if r not in self._max_bytes]
        if missing:
            # Only the config column: loading Run entities here would put rows read before the
            # run lock into the session that record_results then locks and trusts.
            for run_id, config, run_dir in session.execute(
                select(Run.id, Run.config, Run.run_dir).where(Run.id.in_(missing))
            ):
                limit = from_snapshot(config, source=f"run {run_id}'s stored config").infra.max_result_bytes
                self._stores[run_id] = FileStore.of_run(run_dir)
                self._max_bytes[run_id] = limit
        return self._max_bytes

    def close(self) -> None:
        self._batcher.close(timeout=30)
        if self._relay is not None:
            self._relay.close(timeout=30)
        self._remover.close(timeout=30)


#: attempts per relay transaction (the relay claims at most 1000 at a time)
RELAY_CHUNK = 1000


def _relaying(relay: Callable[[ToSend], int]) -> Callable[[list[ToSend]], None]:
    """What the consumer's relay thread does with what the batches committed since it last ran
    left to send: relays it, RELAY_CHUNK attempts to a transaction."""

    def handle(parts: list[ToSend]) -> None:
        for chunk in ToSend.merged(parts).chunks(RELAY_CHUNK):
            try:
                relay(chunk)
            except Exception as error:  # noqa: BLE001 - it stays in the ledger
                log.warning("immediate relay failed (%r); the controller's relay will send them", error)

    return handle


@dataclass(frozen=True)
class _Malformed:
    """A result body that did not decode: recorded in `rejected_results` with its batch."""

    body: dict[str, Any]
    error: str


def _decode(body: Any) -> ResultMessage | _Malformed:
    try:
        return ResultMessage.from_json(body)
    except PayloadError as error:
        return _Malformed(body if isinstance(body, dict) else {}, str(error))


def _within_limit(message: ResultMessage, limit: int | None) -> ResultMessage:
    """An oversized result becomes a data failure of its attempt: the limit holds on receipt,
    not only in workers that check before sending. (A claim check keeps its payload reference,
    so the payload is removed with the failure.)"""
    if limit is None or message.error_kind is not None:
        return message
    size = message.estimated_bytes()
    if size <= limit:
        return message
    log.error("result for attempt %s from %s is about %d bytes, over %d", message.attempt_id, message.worker, size, limit)
    return replace(
        message,
        prompt_token_ids=[],
        completions=[],
        rewards=[],
        error_kind="data",
        error=f"result of about {size} bytes exceeds infra.max_result_bytes={limit} (refused by the consumer)",
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
