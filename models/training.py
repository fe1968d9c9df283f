"""The trainer's side of the ledger: claim a released step, read its batch, publish the
weight version it produced, mark it trained.

Steps train strictly in order: step s trains from weight version s and publishes s+1. A
released step whose predecessor is not trained yet waits; the transaction that finishes step
s queues step s+1 if it is already released.

A group committed as a claim check has its payload in the run's payload store
(`refill.models.payload_store`); the claim reads only its reference under the run's lock, and
the payloads are read and verified (size, checksum, layout) when the trainer first asks for
the batch's groups, after the claim's transaction: reading a step's rollouts under the lock
would hold up every consumer of the run for as long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from refill.models import decisions, driver, rollout_codec, sql
from refill.models.admission import admit
from refill.models.barrier import queue_training
from refill.models.clock import ledger_now_in
from refill.models.column_types import read_json
from refill.models.context import RunContext
from refill.models.metrics import seconds_between
from refill.models.outbox import ToSend
from refill.models.payload import PayloadRef, TrainGroup
from refill.models.payload_store import FileStore, StoredGroup, read_groups
from refill.models.runs import check_completion
from refill.models.slots import RunFailed, fail_run
from refill.models.tables import (
    Group,
    Slot,
    Step,
    StepMetrics,
    StepStatus,
    WeightVersion,
)


@dataclass(frozen=True)
class _Stored:
    """A claimed group whose payload is still in the run's payload store."""

    stored: StoredGroup
    rewards: list[float]
    weight_version: int


@dataclass
class TrainBatch:
    run_id: int
    step: int
    weight_version: int
    claimed: list[TrainGroup | _Stored]
    config: dict[str, Any]
    run_dir: str
    _groups: list[TrainGroup] | None = field(default=None, init=False, repr=False)

    @property
    def groups(self) -> list[TrainGroup]:
        """The step's groups in slot order. Payloads in the run's payload store are read and
        verified on the first call (DamagedPayload names the run, step and group of one that is
        missing or not what its worker wrote)."""
        if self._groups is None:
            stored = [item for item in self.claimed if isinstance(item, _Stored)]
            read = iter(
                read_groups(FileStore.of_run(self.run_dir), [s.stored for s in stored], f"run {self.run_id} step {self.step}")
            )
            groups = []
            for item in self.claimed:
                if isinstance(item, TrainGroup):
                    groups.append(item)
                    continue
                prompt_token_ids, completions = next(read)
                groups.append(
                    TrainGroup(
                        attempt_id=item.stored.attempt_id,
                        prompt_token_ids=prompt_token_ids,
                        completions=completions,
                        rewards=item.rewards,
                        weight_version=item.weight_version,
                    )
                )
            self._groups = groups
        return self._groups


def claim_training(
    session: Session, run_id: int, step: int, trainer_id: str, now: datetime | None = None
) -> TrainBatch | None:
    """Claim `step` for this trainer; None when it is not (or no longer) this trainer's to do:
    already trained, claimed by a live trainer, or waiting for its predecessor."""
    with RunContext.open(session, run_id, now) as ctx:
        if not ctx.running:
            return None
        row = ctx.find_step(step)
        if row is None or row.status not in (StepStatus.RELEASED.value, StepStatus.TRAINING.value):
            return None
        if (
            row.status == StepStatus.TRAINING.value
            and row.trainer_id not in (None, trainer_id)
            and row.trainer_lease_until is not None
            and row.trainer_lease_until > ctx.now
        ):
            return None
        if ctx.run.weight_version != step:
            return None
        if row.train_claims >= ctx.settings.max_train_attempts:
            # Claimed that often and never finished: its trainers keep dying on it.
            try:
                fail_run(
                    ctx,
                    f"step {step} was claimed by a trainer {row.train_claims} times without finishing "
                    f"(infra.max_train_attempts={ctx.settings.max_train_attempts}): trainers crash or "
                    "lose their lease on it. See the trainer workers' logs.",
                    "trainer_failed",
                )
            except RunFailed:
                return None
        # Plain rows, not Group objects: the step's groups are read once, under the run's lock,
        # and the session need not track thousands of large rows it never changes. Read before
        # the claim is written: a group too stale fails the run, and the step stays as it was.
        rows = driver.rows(session, *sql.step_groups(run_id, step))
        for group in rows:
            if decisions.staleness(step, group.weight_version) > ctx.settings.max_lookahead_versions:
                # Every placement is checked against the bound, so only a ledger edited by hand
                # (or a bug) gets here; retrying the claim would meet it again, forever.
                try:
                    fail_run(
                        ctx,
                        f"group {group.attempt_id} was generated with weights v{group.weight_version}, "
                        f"staler than max_lookahead_versions={ctx.settings.max_lookahead_versions} for "
                        f"step {step}; refusing to train it",
                        "staleness_violated",
                    )
                except RunFailed:
                    return None
        row.status = StepStatus.TRAINING.value
        row.trainer_id = trainer_id[:200]
        row.trainer_lease_until = ctx.now + timedelta(seconds=ctx.settings.trainer_lease_seconds)
        row.train_claims += 1
        if row.train_started_at is None:
            row.train_started_at = ctx.now
            metrics = session.get(StepMetrics, (run_id, step))
            previous = ctx.find_step(step - 1) if step > 0 else None
            if metrics is not None:
                # Time the trainer stood idle waiting for this step (0 when it was ready first).
                since = previous.trained_at if previous is not None else ctx.run.started_at
                idle = seconds_between(since, row.released_at)
                metrics.trainer_idle_seconds = max(0.0, idle) if idle is not None else None
        groups: list[TrainGroup | _Stored] = []
        for group in rows:
            rewards = read_json(group.rewards)
            if group.payload_ref is not None:
                ref = PayloadRef(group.payload_ref, group.payload_bytes, group.payload_checksum)
                stored = StoredGroup(group.attempt_id, ref, len(rewards), group.num_tokens)
                groups.append(_Stored(stored, rewards, group.weight_version))
                continue
            try:
                prompt_token_ids, completions = rollout_codec.decode(group.rollout, group.completion_texts, arrays=True)
            except rollout_codec.RolloutFormatError as error:
                raise rollout_codec.RolloutFormatError(
                    f"run {run_id} step {step}: the stored payload of group {group.attempt_id} does not decode ({error})"
                ) from error
            groups.append(
                TrainGroup(
                    attempt_id=group.attempt_id,
                    prompt_token_ids=prompt_token_ids,
                    completions=completions,
                    rewards=rewards,
                    weight_version=group.weight_version,
                )
            )
        return TrainBatch(run_id, step, ctx.run.weight_version, groups, ctx.run.config, ctx.run.run_dir)


def training_failed(
    session: Session, run_id: int, step: int, trainer_id: str, error: str, now: datetime | None = None
) -> ToSend:
    """A trainer's update raised: give the step back (sent again after a short back-off), or
    fail the run with the error once it has had `infra.max_train_attempts` tries."""
    with RunContext.open(session, run_id, now) as ctx:
        row = ctx.find_step(step)
        if row is None or row.status != StepStatus.TRAINING.value or row.trainer_id != trainer_id[:200]:
            return ToSend()
        row.status = StepStatus.RELEASED.value
        row.trainer_id = None
        row.trainer_lease_until = None
        if row.train_claims >= ctx.settings.max_train_attempts:
            try:
                fail_run(
                    ctx,
                    f"training step {step} failed {row.train_claims} times "
                    f"(infra.max_train_attempts={ctx.settings.max_train_attempts}); last error: {error}",
                    "trainer_failed",
                )
            except RunFailed:
                return ToSend()
        queue_training(ctx, step, delay_seconds=min(60.0, 5.0 * row.train_claims))
    return ctx.to_send


def extend_training_lease(
    session: Session, run_id: int, step: int, trainer_id: str, seconds: float, now: datetime | None = None
) -> bool:
    """Renew the trainer's lease on the database's clock (`now` only where a test sets it)."""
    now = ledger_now_in(session, now)  # the trainer's heartbeat: now() inside the statement
    return bool(
        session.execute(
            update(Step)
            .where(
                Step.run_id == run_id,
                Step.step == step,
                Step.status == StepStatus.TRAINING.value,
                Step.trainer_id == trainer_id[:200],
            )
            .values(trainer_lease_until=now + timedelta(seconds=seconds))
            .execution_options(synchronize_session=False)
        ).rowcount
    )


def finish_training(
    session: Session,
    run_id: int,
    step: int,
    trainer_id: str,
    weights_path: str | None,
    metrics: dict[str, float],
    now: datetime | None = None,
) -> ToSend | None:
    """Publish version step+1 and mark the step trained, then admit what the new version
    unlocks. Returns what it left to send (to relay at once), or None if this trainer lost
    the step (another trainer finished it, or the run ended) and its work must be discarded."""
    with RunContext.open(session, run_id, now) as ctx:
        row = ctx.find_step(step)
        if row is None or row.status != StepStatus.TRAINING.value or row.trainer_id != trainer_id[:200]:
            return None
        if ctx.run.weight_version != step:
            return None
        publish_weight_version(ctx, step + 1, weights_path, trained_step=step)
        row.status = StepStatus.TRAINED.value
        row.trained_at = ctx.now
        row.trainer_lease_until = None
        session.execute(
            update(Group)
            .where(
                Group.attempt_id.in_(
                    select(Slot.group_attempt_id).where(Slot.run_id == run_id, Slot.step == step)
                )
            )
            .values(trained_step=step)
            .execution_options(synchronize_session=False)
        )
        stored = session.get(StepMetrics, (run_id, step))
        if stored is not None:
            known = {"loss", "grad_norm", "clip_fraction", "entropy", "kl", "train_seconds"}
            for key in known & metrics.keys():
                setattr(stored, key, float(metrics[key]))
            stored.extra = {k: float(v) for k, v in metrics.items() if k not in known}
        following = ctx.find_step(step + 1)
        if following is not None and following.status == StepStatus.RELEASED.value:
            queue_training(ctx, step + 1)
        admit(ctx)
        check_completion(ctx)
    return ctx.to_send


def publish_weight_version(ctx: RunContext, version: int, path: str | None, trained_step: int | None) -> None:
    """One row per (run, version) — the primary key refuses a second publication."""
    if version != ctx.run.weight_version + 1 and not (version == 0 and trained_step is None):
        raise ValueError(
            f"weight versions are published in order: run {ctx.run.id} is at "
            f"v{ctx.run.weight_version}, cannot publish v{version}"
        )
    ctx.session.add(
        WeightVersion(
            run_id=ctx.run.id, version=version, path=path, trained_step=trained_step, created_at=ctx.now
        )
    )
    ctx.run.weight_version = version


def newest_weights(session: Session, run_id: int) -> tuple[int, str | None] | None:
    row = session.execute(
        select(WeightVersion.version, WeightVersion.path)
        .where(WeightVersion.run_id == run_id)
        .order_by(WeightVersion.version.desc())
        .limit(1)
    ).first()
    return (int(row[0]), row[1]) if row else None
