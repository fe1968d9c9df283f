"""The claim check of a finished group: checked, packed, stored beside the broker, named by a
small message (issue 17).

A generation worker checks a group's token ids and log-probs here, where they are cheapest to
check (the consumer's path is serial), packs it as the ledger packs rollouts, writes and fsyncs
it into the run's payload store, and sends a `ClaimCheckResult` of a few hundred bytes that names
it. `publish_batch` puts the payloads of attempts that finish together into place with one
directory fsync. A group the run will filter (zero-variance under dynamic sampling) is not
stored: nothing would read it, and its message says why (`unstored`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from refill.models import decisions, rollout_codec
from refill.models.payload import (
    UNSTORED_ZERO_VARIANCE,
    ClaimCheckResult,
    PayloadRef,
    ResultMessage,
)
from refill.models.payload_store import FileStore, Staged
from refill.models.settings import LedgerSettings

log = logging.getLogger(__name__)


def publish_batch(batch: list[tuple[FileStore, Staged]]) -> list[None]:
    """Put the staged payloads of a batch into place: one `FileStore.publish` per store (one
    directory fsync per directory). An error fails every result of the batch (infra)."""
    by_store: dict[Path, tuple[FileStore, list[Staged]]] = {}
    for store, staged in batch:
        by_store.setdefault(store.root, (store, []))[1].append(staged)
    for store, staged_list in by_store.values():
        store.publish(staged_list)
    return [None] * len(batch)


def claim_check(
    result: ResultMessage,
    store: FileStore,
    settings: LedgerSettings,
    max_result_bytes: int,
) -> ClaimCheckResult:
    """The claim check of a finished group (`result`, inline): the group checked (as the ledger
    would check it inline, here where it is cheapest), packed and stored in the run's payload
    store, and the small message that names it. A group that cannot be used is a data failure
    and one that cannot be stored an infra failure, with nothing stored. The payload is durably
    in the store before this returns the message that names it. (The generation service does
    the same in two halves: `stage_claim_check` for each result of a bundle, then one
    `publish_batch` for all of them.)"""
    claim, staged = stage_claim_check(result, store, settings, max_result_bytes)
    if staged is None:
        return claim
    try:
        store.publish([staged])
    except OSError as error:
        return not_stored(result, store, error)
    return claim


def stage_claim_check(
    result: ResultMessage, store: FileStore, settings: LedgerSettings, max_result_bytes: int
) -> tuple[ClaimCheckResult, Staged | None]:
    """The first half of `claim_check`: the group checked, packed, then written and fsynced
    under a temporary name (`FileStore.stage`). Returns the message that names the payload and
    what to publish, or a failure's message and None (nothing stored), or for a group the run
    will filter the message that says so (`unstored`) and None. The message may be sent only
    once its payload was published."""
    problem, rollout = decisions.checked_payload(result, settings.group_size, settings.vocab_size)
    if problem is not None:
        return _failure(result, "data", problem), None
    assert rollout is not None  # no problem: checked_payload built it
    payload = rollout_codec.pack_payload(rollout, rollout_codec.texts(result.completions))
    if len(payload) > max_result_bytes:
        return _failure(result, "data", oversized_error(len(payload), max_result_bytes)), None
    # After every check that makes the group a data failure (SPEC §3: an invalid payload is
    # judged before the filter).
    if settings.use_dynamic_sampling and decisions.is_zero_variance(result.rewards, settings.zero_variance_tolerance):
        # The run filters this group, and nothing reads a filtered group's rollout: storing it
        # cost a write and an fsync here and an unlink in the consumer, for a third to half of
        # a DAPO run's groups.
        return _claim(result, None, UNSTORED_ZERO_VARIANCE), None
    try:
        staged = store.stage(result.attempt_id, payload)
    except OSError as error:
        return not_stored(result, store, error), None
    return _claim(result, staged.ref, None), staged


def _claim(result: ResultMessage, ref: PayloadRef | None, unstored: str | None) -> ClaimCheckResult:
    return ClaimCheckResult(
        run_id=result.run_id,
        attempt_id=result.attempt_id,
        worker=result.worker,
        weight_version=result.weight_version,
        rewards=result.rewards,
        generation_seconds=result.generation_seconds,
        payload=ref,
        prompt_length=len(result.prompt_token_ids),
        lengths=[len(c.token_ids) for c in result.completions],
        unstored=unstored,
    )


def not_stored(result: ResultMessage, store: FileStore, error: OSError) -> ClaimCheckResult:
    """The infra failure of a group that could not be stored: the shared storage is full or
    unreachable from this worker, so the prompt is tried again (elsewhere, or once the storage
    is back)."""
    log.warning("attempt %s: storing its payload under %s failed: %r", result.attempt_id, store.root, error)
    return _failure(result, "infra", f"could not store the payload under {store.root}: {error}")


def _failure(result: ResultMessage, kind: str, error: str) -> ClaimCheckResult:
    return ClaimCheckResult(
        run_id=result.run_id,
        attempt_id=result.attempt_id,
        worker=result.worker,
        weight_version=result.weight_version,
        error_kind=kind,
        error=error,
        generation_seconds=result.generation_seconds,
    )


def oversized_error(size: int, limit: int) -> str:
    return (
        f"result of about {size} bytes exceeds infra.max_result_bytes={limit}; "
        "lower generation.max_new_tokens or raise the limit"
    )
