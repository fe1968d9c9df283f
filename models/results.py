"""Recording finished attempts: SPEC §3, the entry point of the results consumer.

`record_results` takes a batch of results, groups them by run, locks each run once and applies
every result in order. Each result has exactly one outcome; a result that changes nothing
(duplicate, late, unknown) is written to `rejected_results` so that it stays visible.

A result comes with its group inline (`ResultMessage`) or as a claim check
(`ClaimCheckResult`: rewards, lengths and a `PayloadRef` to the run's payload store). A
claim check commits the reference, never the payload's bytes, so recording one costs the
same at any rollout length; the payloads the batch did not commit are returned to the caller
to remove once the transaction committed (`BatchResult.discarded`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from refill.models import decisions, rollout_codec, sql
from refill.models.clock import ledger_now
from refill.models.context import RunContext
from refill.models.db import UnknownRun
from refill.models.metrics import zero_variance_from_counters
from refill.models.outbox import ToSend
from refill.models.overdispatch import Counted, counted, counts_read, place_extra, top_up
from refill.models.payload import ClaimCheckResult, ResultMessage
from refill.models.rows import AttemptRow, GroupRow, Read, SlotRow
from refill.models.slots import (
    ERROR_CHARS,
    LIVE,
    RunFailed,
    aimed_slot,
    data_failure,
    dispatch_retry,
    fail_run,
    infra_failure,
    place,
    placement_candidates,
    replace,
)
from refill.models.tables import (
    AttemptState,
    FailureKind,
    RejectedResult,
    RejectReason,
    Slot,
    SlotStatus,
)

log = logging.getLogger(__name__)

# The states a result looks at and sets, as plain strings: an enum member's `.value` is a
# Python property call, and a step's 6,272 results made about 50,000 of them.
_RUNNING, _FILTERED = AttemptState.RUNNING.value, AttemptState.FILTERED.value
_COMMITTED, _FAILED = AttemptState.COMMITTED.value, AttemptState.FAILED.value

#: What an infra-failure report without a message is recorded as.
INFRA_ERROR_DEFAULT = "engine error"


class Outcome(enum.StrEnum):
    COMMITTED = "COMMITTED"
    FILTERED = "FILTERED"
    FAILED = "FAILED"
    DUPLICATE = "DUPLICATE"
    LATE = "LATE"
    UNKNOWN = "UNKNOWN"
    RUN_FINISHED = "RUN_FINISHED"


@dataclass(frozen=True)
class Recorded:
    attempt_id: int
    outcome: Outcome
    detail: str | None = None


@dataclass
class BatchResult:
    outcomes: list[Recorded]
    to_send: ToSend
    #: `(run id, payload name)` of each stored payload this batch judged nothing will read (its
    #: attempt settled without committing it): the caller removes them after the commit.
    discarded: list[tuple[int, str]] = field(default_factory=list)


def record_results(
    session: Session, results: Sequence[ResultMessage], now: datetime | None = None
) -> BatchResult:
    """Apply a batch of results in one transaction (the caller's), at `now` or, by default, the
    database's clock (read with each run's lock, no round trip of its own)."""
    by_run: dict[int, list[tuple[int, ResultMessage]]] = {}
    for position, result in enumerate(results):
        by_run.setdefault(result.run_id, []).append((position, result))
    outcomes: list[Recorded | None] = [None] * len(results)
    to_send: list[ToSend] = []
    discarded: list[tuple[int, str]] = []
    # Lock runs in id order so that two consumers with mixed batches cannot deadlock.
    for run_id in sorted(by_run):
        items = by_run[run_id]
        try:
            ctx = RunContext.open(session, run_id, now)
        except UnknownRun:
            at = now or ledger_now(session)
            for position, result in items:
                outcomes[position] = _reject(session, result, RejectReason.UNKNOWN, f"there is no run {run_id}", at)
            continue
        with ctx:
            tolerance = ctx.settings.zero_variance_tolerance
            ctx.size_caches(len(items), sum(not r.error_kind and decisions.is_zero_variance(r.rewards, tolerance) for _, r in items))
            # About one new attempt per result; more come in growing blocks. Drawn with the
            # batch's reads.
            ctx.ids.expect({"attempts": len(items)})
            attempts, ahead = _read_batch(ctx, [r.attempt_id for _, r in items])
            for position, result in items:
                attempt = attempts.get(result.attempt_id)
                outcomes[position] = _record_one(ctx, attempt, result)
                name = _discarded_payload(ctx, attempt, result)
                if name is not None:
                    discarded.append((run_id, name))
            top_up(ctx, ahead)
        to_send.append(ctx.to_send)
    return BatchResult([o for o in outcomes if o is not None], ToSend.merged(to_send), discarded)


def _discarded_payload(ctx: RunContext, attempt: AttemptRow | None, result: ResultMessage) -> str | None:
    """The stored payload of `result` if nothing will ever read it: its attempt is settled (or
    unknown to this ledger) and no committed group holds it. An attempt still in flight keeps
    it (a result from a worker that does not hold the lease must not remove the holder's)."""
    if not isinstance(result, ClaimCheckResult) or result.payload is None:
        return None
    if attempt is not None:
        if attempt.state in LIVE:
            return None
        if attempt.state == _COMMITTED:
            group = ctx.group(attempt.id)
            if group is not None and group.payload_ref == result.payload.name:
                return None
    return result.payload.name


def _read_batch(ctx: RunContext, attempt_ids: list[int]) -> tuple[dict[int, AttemptRow], Counted | None]:
    """Read what the batch's decisions will look up, before they change anything: its attempts,
    the slots they serve, over-dispatch's counts (`overdispatch.counts_read`), and the first
    loads of the context's caches and the run's unfinished steps (`RunContext.read_ahead`: one
    round trip)."""
    run_id = ctx.run.id
    settings, running = ctx.settings, ctx.running
    counts = counts_read(ctx)
    in_order = settings.sampler_name == "in_order"
    found = ctx.read_ahead(
        [
            Read(AttemptRow, sql.attempts_by_id(run_id, attempt_ids)),
            Read(SlotRow, sql.slots_of_attempts(run_id, attempt_ids, postgres=ctx.rows.postgres)),
            *([counts] if counts else []),
        ],
        # `in_order` fills a waiting slot with a later step's group or an extra's
        waiting=running and (sql.batch_places_elsewhere() if in_order else True),
        # a filtered group's slot borrows, or takes a spare prompt
        lendable=running and settings.use_dynamic_sampling,
        # an extra's group, or any group under another sampler, takes an open slot
        open_slots=running and (settings.over_dispatch or not in_order) and (sql.batch_has_extra() if in_order else True),
    )
    return {a.id: a for a in found[0]}, counted(ctx, counts, found[2]) if counts else None


def _reject(
    session: Session, result: ResultMessage, reason: RejectReason, detail: str, now: datetime
) -> Recorded:
    session.add(
        RejectedResult(
            run_id=result.run_id,
            attempt_id=result.attempt_id,
            reason=reason.value,
            worker=result.worker[:200],
            detail=detail[:2000],
            received_at=now,
        )
    )
    outcome = {
        RejectReason.DUPLICATE: Outcome.DUPLICATE,
        RejectReason.LATE: Outcome.LATE,
        RejectReason.RUN_FINISHED: Outcome.RUN_FINISHED,
    }.get(reason, Outcome.UNKNOWN)
    log.info("result for attempt %s refused: %s (%s)", result.attempt_id, outcome.value, detail)
    return Recorded(result.attempt_id, outcome, detail)


def _same_failure_report(attempt: AttemptRow, result: ResultMessage) -> bool:
    """Whether `result` is the worker's own infra-failure report that failed `attempt`, come
    again (delivery is at least once): a duplicate, where an attempt the reaper failed (its
    lease expired, its message was lost) records the reaper's reason and any result is late."""
    return (
        result.error_kind == FailureKind.INFRA.value
        and result.worker == attempt.worker
        and attempt.error == (result.error or INFRA_ERROR_DEFAULT)[:ERROR_CHARS]
    )


def _record_one(ctx: RunContext, attempt: AttemptRow | None, result: ResultMessage) -> Recorded:
    session, now = ctx.session, ctx.now
    if attempt is None:
        return _reject(
            session, result, RejectReason.UNKNOWN, "the ledger never dispatched this attempt", now
        )
    if attempt.state not in LIVE:
        late = attempt.state == AttemptState.CANCELLED.value or (
            attempt.state == AttemptState.FAILED.value
            and attempt.failure_kind == FailureKind.INFRA.value
            and not _same_failure_report(attempt, result)
        )
        reason = RejectReason.LATE if late else RejectReason.DUPLICATE
        return _reject(session, result, reason, f"attempt is already {attempt.state}", now)
    if not ctx.running:
        return _reject(session, result, RejectReason.RUN_FINISHED, f"run is {ctx.run.status}", now)
    if attempt.state != _RUNNING:
        # Workers take the lease before generating; a result without one was never issued
        # by a worker of this ledger.
        return _reject(
            session, result, RejectReason.UNKNOWN, f"attempt is {attempt.state}, not leased", now
        )
    if attempt.worker and result.worker != attempt.worker:
        return _reject(
            session,
            result,
            RejectReason.UNKNOWN,
            f"attempt is leased to {attempt.worker}, not {result.worker}",
            now,
        )
    attempt.finished_at = now
    attempt.weight_version = result.weight_version
    attempt.generation_seconds = result.generation_seconds
    try:
        return _apply(ctx, attempt, result)
    except RunFailed as failure:
        return Recorded(attempt.id, _outcome_of(attempt), str(failure).splitlines()[0])


def _outcome_of(attempt: AttemptRow) -> Outcome:
    return {
        AttemptState.COMMITTED.value: Outcome.COMMITTED,
        AttemptState.FILTERED.value: Outcome.FILTERED,
    }.get(attempt.state, Outcome.FAILED)


def _apply(ctx: RunContext, attempt: AttemptRow, result: ResultMessage) -> Recorded:
    settings = ctx.settings
    if result.error_kind == "infra":
        infra_failure(ctx, attempt, result.error or INFRA_ERROR_DEFAULT)
        return Recorded(attempt.id, Outcome.FAILED, "infra")
    if result.error_kind == "data":
        data_failure(ctx, attempt, result.error or "data error")
        return Recorded(attempt.id, Outcome.FAILED, "data")
    rollout: rollout_codec.Rollout | None = None
    if isinstance(result, ClaimCheckResult):
        # The worker checked its payload's token ids and log-probs where they were cheapest;
        # what is left to check here needs the run's config and only the message.
        problem, num_tokens = _claim_problem(result, settings.group_size), result.num_tokens
    else:
        problem, rollout = decisions.checked_payload(result, settings.group_size, settings.vocab_size)
        num_tokens = rollout.num_tokens if rollout is not None else 0
    if problem is None and result.weight_version is None:
        problem = "result does not say which weight version generated it"
    zero_variance = problem is None and decisions.is_zero_variance(result.rewards, settings.zero_variance_tolerance)
    if problem is None and isinstance(result, ClaimCheckResult) and result.payload is None and not (zero_variance and settings.use_dynamic_sampling):
        # The worker judged the group filtered (`unstored`) and stored nothing; this run trains it.
        problem = f"the worker stored no payload ({result.unstored}) for a group this run does not filter"
    if problem is not None:
        data_failure(ctx, attempt, problem)
        return Recorded(attempt.id, Outcome.FAILED, problem)

    rewards = result.rewards
    attempt.rewards = rewards
    attempt.reward_mean = sum(rewards) / len(rewards)
    attempt.reward_min = min(rewards)
    attempt.reward_max = max(rewards)
    attempt.num_tokens = num_tokens
    attempt.zero_variance = zero_variance
    ctx.run.scored_groups += 1
    if zero_variance:
        ctx.run.zero_variance_groups += 1
    # A generation that came back is a healthy fleet, whatever the filter then decides. (Set
    # where it changes: once per result otherwise, and nearly always 0 already.)
    if ctx.run.consecutive_dropped:
        ctx.run.consecutive_dropped = 0

    if zero_variance and settings.use_dynamic_sampling:
        _filter(ctx, attempt)
        return Recorded(attempt.id, Outcome.FILTERED)
    _commit(ctx, attempt, result, rollout)
    if attempt.state == _FAILED:  # too stale to train: regenerated
        return Recorded(attempt.id, Outcome.FAILED, attempt.error)
    return Recorded(attempt.id, Outcome.COMMITTED)


def _filter(ctx: RunContext, attempt: AttemptRow) -> None:
    """SPEC §3.3: a zero-variance group is a data decision about a rollout that succeeded; it
    spends the slot's dynamic-sampling budget, never the fault-tolerance one."""
    attempt.state = _FILTERED
    slot = aimed_slot(ctx, attempt)
    if slot is None:
        return
    slot.filtered += 1
    # The slot's stored budget, not the config's: a run's budgets are what its slots say.
    budget = slot.filter_budget
    if slot.filter_replacements >= budget:
        zero, total = zero_variance_from_counters(ctx)
        fail_run(
            ctx,
            decisions.budget_exhausted_message(
                step=slot.step,
                slot=slot.idx,
                budget=budget,
                p=zero / total if total else 1.0,
                num_prompts_per_step=ctx.settings.num_prompts_per_step,
                max_num_steps=ctx.settings.max_num_steps,
                config_budget=ctx.settings.filter_budget,
            ),
            "budget_exhausted",
        )
    replace(ctx, slot, after_filter=True)


def _commit(ctx: RunContext, attempt: AttemptRow, result: ResultMessage, rollout: rollout_codec.Rollout | None) -> None:
    settings = ctx.settings
    version = int(result.weight_version or 0)
    own = aimed_slot(ctx, attempt)
    if own is not None and decisions.staleness(own.step, version) > settings.max_lookahead_versions:
        # The re-aim rule keeps this from happening; if it does, training the group would
        # break the staleness bound, so it is discarded and the prompt generated again.
        log.warning(
            "attempt %s generated with weights v%s, too stale for step %s; regenerating",
            attempt.id,
            version,
            own.step,
        )
        attempt.state = AttemptState.FAILED.value
        attempt.failure_kind = FailureKind.STALE.value
        attempt.error = f"weights v{version} too stale for step {own.step}"
        dispatch_retry(ctx, attempt, own, spend_try=False)
        return
    attempt.state = _COMMITTED
    group: GroupRow = ctx.rows.new(
        GroupRow,
        {
            "attempt_id": attempt.id,
            "run_id": ctx.run.id,
            "prompt_id": attempt.prompt_id,
            "origin_step": attempt.origin_step,
            "weight_version": version,
            "rewards": list(result.rewards),
            "reward_mean": attempt.reward_mean,
            "zero_variance": bool(attempt.zero_variance),
            **_payload_columns(result, rollout),
            "num_tokens": attempt.num_tokens or 0,
            "committed_at": ctx.now,
            "parked": False,
            "moves": 0,
        },
    )
    if own is None:
        place_extra(ctx, group)
        return
    if place(ctx, group, own, placement_candidates(ctx, group, own)) is None:
        # The sampler parked the group rather than train it in its own slot (windowed: too
        # stale for the window). The slot must not be left without a live attempt: generate
        # its prompt again, with weights newer than the declined group's (at most the step's
        # own version, which the trainer reaches without this slot).
        retry = dispatch_retry(ctx, attempt, own, spend_try=False)
        retry.min_weight_version = max(retry.min_weight_version, min(version + 1, own.step))


def _claim_problem(result: ClaimCheckResult, group_size: int) -> str | None:
    """What makes a claim check unusable, as `decisions.checked_payload` words it for a group
    inline; None when nothing does."""
    if len(result.lengths) != group_size:
        return f"group has {len(result.lengths)} completions, the run expects {group_size}"
    if len(result.rewards) != group_size:
        return f"group has {len(result.rewards)} rewards for {group_size} completions"
    if not all(map(math.isfinite, result.rewards)):
        i, reward = next((i, r) for i, r in enumerate(result.rewards) if not math.isfinite(r))
        return f"reward of completion {i} is {reward}, not a finite number"
    if not result.prompt_length:
        return "prompt_token_ids is empty"
    return None


def _payload_columns(result: ResultMessage, rollout: rollout_codec.Rollout | None) -> dict[str, object]:
    """A group's payload columns: the packed rollout and texts inline, or the claim check's
    reference (its bytes stay in the payload store)."""
    if isinstance(result, ClaimCheckResult):
        assert result.payload is not None  # decoding refuses a claim check with neither payload nor error
        return {
            "payload_ref": result.payload.name,
            "payload_bytes": result.payload.size,
            "payload_checksum": result.payload.checksum,
        }
    assert rollout is not None  # no problem: checked_payload built it
    return {"rollout": rollout.pack(), "completion_texts": rollout_codec.texts(result.completions)}


def committed_slot_of(session: Session, run_id: int, attempt_id: int) -> tuple[int, int] | None:
    """Where a committed group sits now (used by tests and the CLI)."""
    row = session.execute(
        select(Slot.step, Slot.idx).where(
            Slot.run_id == run_id,
            Slot.group_attempt_id == attempt_id,
            Slot.status == SlotStatus.COMMITTED.value,
        )
    ).first()
    return (row[0], row[1]) if row else None
