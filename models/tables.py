"""The run ledger: every table of refill, in SQLAlchemy 2.0 declarative style.

The ledger is the source of truth. Redis only carries messages; anything a message says is
checked against these rows before it has an effect. Constraints here make the impossible
states of SPEC §3 impossible in the database itself, whatever code writes to it:

- a slot holds at most one group (`slots.group_attempt_id`), and a group sits in at most one
  slot (unique on that column);
- a step's committed count never exceeds its target (`committed <= num_slots - shrunk`);
- per-slot budgets are stored on the slot and checked against it (`filter_replacements <=
  filter_budget`, `drop_replacements <= drop_budget`);
- one weight version per (run, version).
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from refill.models.column_types import NAMING_CONVENTION, BigId, JSONType, UTCDateTime

Timestamp = UTCDateTime()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSONType, list[Any]: JSONType, datetime: Timestamp}


def _in(column: str, enum_cls: type[enum.Enum]) -> str:
    values = ", ".join(f"'{member.value}'" for member in enum_cls)
    return f"{column} IN ({values})"


class RunStatus(enum.StrEnum):
    CREATED = "created"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"


class StepStatus(enum.StrEnum):
    OPEN = "open"  # admitted, filling
    RELEASED = "released"  # full; handed to the trainer exactly once
    TRAINING = "training"  # a trainer claimed it
    TRAINED = "trained"  # weight version step+1 published


class SlotStatus(enum.StrEnum):
    OPEN = "open"
    COMMITTED = "committed"
    SHRUNK = "shrunk"


class ShrinkReason(enum.StrEnum):
    END_OF_DATA = "end_of_data"  # spare pool dry and loader exhausted: not a tuning problem
    DROPPED = "dropped"  # rollout failures used up the slot's drop budget


class AttemptState(enum.StrEnum):
    PENDING = "pending"  # not yet handed to the broker: a generate message to send
    QUEUED = "queued"  # on the generate queue
    RUNNING = "running"  # a worker holds the lease
    COMMITTED = "committed"
    FILTERED = "filtered"
    FAILED = "failed"
    CANCELLED = "cancelled"  # its slot was settled otherwise and nothing else needed it

    @classmethod
    def live(cls) -> tuple[AttemptState, ...]:
        return (cls.PENDING, cls.QUEUED, cls.RUNNING)


class AttemptReason(enum.StrEnum):
    FIRST = "first"  # the slot's own prompt
    RETRY = "retry"  # same prompt after an infra failure
    FILTER_REPLACEMENT = "filter_replacement"  # spare prompt after a zero-variance group
    DROP_REPLACEMENT = "drop_replacement"  # spare prompt after a dropped prompt
    RESPAWN = "respawn"  # spare prompt for a slot whose group was lent to an earlier step
    EXTRA = "extra"  # over-dispatch: serves the step, not one slot


class FailureKind(enum.StrEnum):
    INFRA = "infra"
    DATA = "data"
    STALE = "stale"  # finished, but too stale for every step still open


class RejectReason(enum.StrEnum):
    DUPLICATE = "duplicate"
    LATE = "late"
    UNKNOWN = "unknown"
    RUN_FINISHED = "run_finished"
    MALFORMED = "malformed"


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_in("status", RunStatus), name="status"),
        CheckConstraint("num_prompts_per_step >= 1", name="num_prompts_per_step"),
        CheckConstraint("group_size >= 1", name="group_size"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.CREATED.value)
    config: Mapped[dict[str, Any]]
    config_hash: Mapped[str] = mapped_column(String(64))
    data_fingerprint: Mapped[str] = mapped_column(String(64))
    run_dir: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)

    # Copied out of the config so that SQL (and constraints) can use them.
    num_prompts_per_step: Mapped[int] = mapped_column(Integer)
    group_size: Mapped[int] = mapped_column(Integer)
    max_num_steps: Mapped[int] = mapped_column(Integer)
    max_lookahead_versions: Mapped[int] = mapped_column(Integer)
    num_prompts: Mapped[int] = mapped_column(Integer)

    # Data loader position: the prompt order of an epoch is a permutation seeded by
    # (run seed, epoch), so the cursor is all the state a restart needs.
    loader_epoch: Mapped[int] = mapped_column(Integer, default=0)
    loader_cursor: Mapped[int] = mapped_column(Integer, default=0)
    loader_exhausted: Mapped[bool] = mapped_column(Boolean, default=False)

    next_step: Mapped[int] = mapped_column(Integer, default=0)
    weight_version: Mapped[int] = mapped_column(Integer, default=0)
    consecutive_dropped: Mapped[int] = mapped_column(Integer, default=0)
    # Groups scored so far and how many of them had zero variance: the measured p that
    # over-dispatch, the budget error and the metrics read on every batch, kept here so that
    # reading it does not count a run's attempts (refill check compares them).
    scored_groups: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    zero_variance_groups: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Untaken prompts of the spare pool, for the same reason: counting them took a scan of
    # the pool's index (and a heap fetch per row) on every batch.
    spare_prompts_available: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Pre-rollout skipping's adapted exploration rates (NULL: not adapted yet, the config's).
    skip_exploration_solved: Mapped[float | None] = mapped_column(Float)
    skip_exploration_failed: Mapped[float | None] = mapped_column(Float)
    stop_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    controller_id: Mapped[str | None] = mapped_column(String(200))
    controller_seen_at: Mapped[datetime | None]
    # The last step each experiment tracker was given ({"tensorboard": 7, ...}; refill.tracking):
    # after a crash the next controller goes on from there, so no step is logged twice or skipped.
    tracked_steps: Mapped[dict[str, Any] | None]


class Prompt(Base):
    __tablename__ = "prompts"
    __table_args__ = (Index(None, "run_id", "position", unique=True),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)  # row index in the data set
    line_no: Mapped[int | None] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)  # formatted with data.prompt_template
    row: Mapped[dict[str, Any]]


class Step(Base):
    __tablename__ = "steps"
    __table_args__ = (
        CheckConstraint(_in("status", StepStatus), name="status"),
        CheckConstraint("shrunk >= 0 AND shrunk <= num_slots", name="shrunk_range"),
        CheckConstraint("dropped_shrunk <= shrunk", name="dropped_shrunk_range"),
        CheckConstraint("committed >= 0 AND committed <= num_slots - shrunk", name="committed_le_target"),
        CheckConstraint(
            "status = 'open' OR committed = num_slots - shrunk", name="released_steps_are_full"
        ),
        # The steps not trained yet: every batch reads them, and the earliest open one; by the
        # primary key alone both walked every step the run ever had (migration 0011).
        Index(
            "ix_steps_unfinished",
            "run_id",
            "step",
            postgresql_where=text("status <> 'trained'"),
            sqlite_where=text("status <> 'trained'"),
        ),
    )

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default=StepStatus.OPEN.value)
    num_slots: Mapped[int] = mapped_column(Integer)
    committed: Mapped[int] = mapped_column(Integer, default=0)
    shrunk: Mapped[int] = mapped_column(Integer, default=0)
    dropped_shrunk: Mapped[int] = mapped_column(Integer, default=0)
    admitted_at: Mapped[datetime]
    released_at: Mapped[datetime | None]
    train_started_at: Mapped[datetime | None]
    trained_at: Mapped[datetime | None]
    trainer_id: Mapped[str | None] = mapped_column(String(200))
    trainer_lease_until: Mapped[datetime | None]
    train_claims: Mapped[int] = mapped_column(Integer, default=0)
    #: over-dispatched attempts sent for this step (bounded by async_rl.over_dispatch)
    extras: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    @property
    def target(self) -> int:
        return self.num_slots - self.shrunk


class Slot(Base):
    __tablename__ = "slots"
    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "step"], ["steps.run_id", "steps.step"], ondelete="CASCADE"
        ),
        CheckConstraint(_in("status", SlotStatus), name="status"),
        CheckConstraint(
            "(status = 'committed') = (group_attempt_id IS NOT NULL)", name="committed_has_group"
        ),
        CheckConstraint("(status = 'shrunk') = (shrink_reason IS NOT NULL)", name="shrunk_has_reason"),
        CheckConstraint("filter_replacements <= filter_budget", name="filter_budget"),
        CheckConstraint("drop_replacements <= drop_budget", name="drop_budget"),
        CheckConstraint("filtered <= filter_budget + 1", name="filtered_range"),
        Index(None, "group_attempt_id", unique=True),
        # The consumer reads the first open slots of the open steps, and the first slots waiting
        # on a replacement, in (step, idx) order on every batch: walked in order and cut at the
        # LIMIT instead of sorting every open slot of the run (both scanned ~4000 rows for a
        # 4096-prompt step). The queries spell these predicates out with literal values.
        Index(
            "ix_slots_open",
            "run_id",
            "step",
            "idx",
            postgresql_where=text("status = 'open'"),
            sqlite_where=text("status = 'open'"),
        ),
        Index(
            "ix_slots_waiting",
            "run_id",
            "step",
            "idx",
            postgresql_where=text("status = 'open' AND needs_replacement IS true"),
            sqlite_where=text("status = 'open' AND needs_replacement IS true"),
        ),
    )

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default=SlotStatus.OPEN.value)
    prompt_id: Mapped[int | None] = mapped_column(ForeignKey("prompts.id"))
    group_attempt_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("attempts.id", use_alter=True)
    )
    shrink_reason: Mapped[str | None] = mapped_column(String(16))
    # True while the slot waits on a replacement (its own prompt was filtered or dropped):
    # such a slot may take a group committed for a later step (SPEC §3.4).
    needs_replacement: Mapped[bool] = mapped_column(Boolean, default=False)
    filtered: Mapped[int] = mapped_column(Integer, default=0)
    filter_replacements: Mapped[int] = mapped_column(Integer, default=0)
    filter_budget: Mapped[int] = mapped_column(Integer)
    infra_failures: Mapped[int] = mapped_column(Integer, default=0)
    data_failures: Mapped[int] = mapped_column(Integer, default=0)
    drops: Mapped[int] = mapped_column(Integer, default=0)
    drop_replacements: Mapped[int] = mapped_column(Integer, default=0)
    drop_budget: Mapped[int] = mapped_column(Integer)
    borrowed_in: Mapped[int] = mapped_column(Integer, default=0)  # groups moved here
    lent_out: Mapped[int] = mapped_column(Integer, default=0)  # groups moved away
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    settled_at: Mapped[datetime | None]


_SCORED = "zero_variance IS NOT NULL"


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (
        ForeignKeyConstraint(
            ["run_id", "step", "slot_idx"], ["slots.run_id", "slots.step", "slots.idx"]
        ),
        CheckConstraint(_in("state", AttemptState), name="state"),
        CheckConstraint(_in("reason", AttemptReason), name="reason"),
        CheckConstraint(
            "failure_kind IS NULL OR " + _in("failure_kind", FailureKind), name="failure_kind"
        ),
        CheckConstraint("(state = 'failed') = (failure_kind IS NOT NULL)", name="failed_has_kind"),
        CheckConstraint("try_no >= 1", name="try_no"),
        Index(None, "run_id", "step", "slot_idx"),
        Index(None, "run_id", "state"),
        Index(
            "ix_attempts_live_lease",
            "run_id",
            "leased_until",
            postgresql_where=text("state IN ('queued', 'running')"),
            sqlite_where=text("state IN ('queued', 'running')"),
        ),
        # Live attempts by step: over-dispatch counts the newest step's on every batch (the
        # (run_id, step, slot_idx) index walked every attempt of the step, finished or not).
        Index(
            "ix_attempts_live_step",
            "run_id",
            "step",
            postgresql_where=text("state IN ('pending', 'queued', 'running')"),
            sqlite_where=text("state IN ('pending', 'queued', 'running')"),
        ),
        # By the slot dispatched for: a release reads each slot's first attempt, wherever it
        # moved (else every attempt of the run, under its lock: migration 0013).
        Index(None, "run_id", "origin_step", "origin_slot"),
        # Scored attempts by prompt, newest last: skipping reads a prompt's newest few (0014).
        Index("ix_attempts_scored_prompt", "run_id", "prompt_id", "id", postgresql_where=text(_SCORED), sqlite_where=text(_SCORED)),
        # Pending attempts, the generate messages not sent yet, of a run in id order: the
        # relay's pass (0015).
        Index("ix_attempts_unsent", "run_id", "id", postgresql_where=text("state = 'pending'"), sqlite_where=text("state = 'pending'")),
        # Extras not started yet: the ones over-dispatch re-aims when their step settles, looked
        # for on every batch; a handful at any time, among every extra the run ever made.
        Index(
            "ix_attempts_unstarted_extras",
            "run_id",
            "step",
            postgresql_where=text("slot_idx IS NULL AND state IN ('pending', 'queued')"),
            sqlite_where=text("slot_idx IS NULL AND state IN ('pending', 'queued')"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    # The slot it serves now. A live attempt can be re-aimed (a group placed elsewhere hands
    # over its slot); an EXTRA attempt serves its step without a slot.
    step: Mapped[int] = mapped_column(Integer)
    slot_idx: Mapped[int | None] = mapped_column(Integer)
    origin_step: Mapped[int] = mapped_column(Integer)
    origin_slot: Mapped[int | None] = mapped_column(Integer)
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id"))
    try_no: Mapped[int] = mapped_column(Integer, default=1)
    reason: Mapped[str] = mapped_column(String(24))
    state: Mapped[str] = mapped_column(String(16), default=AttemptState.PENDING.value)
    failure_kind: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    min_weight_version: Mapped[int] = mapped_column(Integer)
    weight_version: Mapped[int | None] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime]
    available_at: Mapped[datetime]  # not before (retry back-off)
    dispatched_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    leased_until: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    generation_seconds: Mapped[float | None] = mapped_column(Float)
    rewards: Mapped[list[Any] | None]
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_min: Mapped[float | None] = mapped_column(Float)
    reward_max: Mapped[float | None] = mapped_column(Float)
    zero_variance: Mapped[bool | None] = mapped_column(Boolean)
    num_tokens: Mapped[int | None] = mapped_column(Integer)


class Group(Base):
    """The payload of a committed attempt: what the trainer trains on.

    Where the group sits is `slots.group_attempt_id` (one source of truth); a committed group
    that no slot references is parked surplus, kept for a later step within the staleness
    bound."""

    __tablename__ = "groups"
    __table_args__ = (
        Index(None, "run_id", "trained_step"),
        Index(None, "run_id", "parked"),
        # Parked groups by weight version: every batch reads those still fresh enough to lend
        # (and over-dispatch counts them). A parked group too stale to train stays parked for
        # good, so (run_id, parked) walked every one the run ever parked: 15,000 rows per
        # batch, 14 ms, after 700,000 attempts (`bench scale`).
        Index(
            "ix_groups_parked_version",
            "run_id",
            "weight_version",
            "attempt_id",
            postgresql_where=text("parked IS true"),
            sqlite_where=text("parked IS true"),
        ),
        # The payload is inline (rollout, texts) or in the run's payload store, never both.
        CheckConstraint(
            "(payload_ref IS NULL) = (rollout IS NOT NULL) AND (payload_ref IS NULL) = (completion_texts IS NOT NULL)"
            " AND (payload_ref IS NULL) = (payload_bytes IS NULL) AND (payload_ref IS NULL) = (payload_checksum IS NULL)",
            name="payload_in_one_place",
        ),
    )

    attempt_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("attempts.id", ondelete="CASCADE"), primary_key=True
    )
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id"))
    origin_step: Mapped[int] = mapped_column(Integer)
    weight_version: Mapped[int] = mapped_column(Integer)
    rewards: Mapped[list[Any]]
    reward_mean: Mapped[float] = mapped_column(Float)
    zero_variance: Mapped[bool] = mapped_column(Boolean)
    # The prompt's and the completions' token ids and the log-probs, packed
    # (`refill.models.rollout_codec`): as JSONB numbers PostgreSQL parsed each one on insert.
    # Stored uncompressed on PostgreSQL (migration 0006): token ids barely compress. Both
    # payload columns are deferred: the ledger moves and lends groups by their other columns
    # and only the trainer's claim reads the payload (as columns). NULL for a claim check.
    rollout: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)
    # Each completion's text and finish reason, in order, readable in SQL.
    completion_texts: Mapped[list[Any] | None] = mapped_column(JSONType, deferred=True)
    # A claim check's payload: `<run_dir>/payloads/<payload_ref>` (models/payload_store.py)
    # and its size and checksum as the worker wrote them, which the trainer's claim verifies.
    payload_ref: Mapped[str | None] = mapped_column(String(64))
    payload_bytes: Mapped[int | None] = mapped_column(BigInteger)
    payload_checksum: Mapped[str | None] = mapped_column(String(71))
    num_tokens: Mapped[int] = mapped_column(Integer)
    committed_at: Mapped[datetime]
    # Committed but in no slot: surplus kept for a later step (derivable from slots, but
    # flagged so that finding a lender is an index lookup).
    parked: Mapped[bool] = mapped_column(Boolean, default=False)
    moves: Mapped[int] = mapped_column(Integer, default=0)
    trained_step: Mapped[int | None] = mapped_column(Integer)


class SparePrompt(Base):
    __tablename__ = "spare_prompts"
    __table_args__ = (
        Index(
            "ix_spare_prompts_available",
            "run_id",
            "id",
            postgresql_where=text("taken_at IS NULL"),
            sqlite_where=text("taken_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id"))
    epoch: Mapped[int] = mapped_column(Integer)
    added_at: Mapped[datetime]
    taken_at: Mapped[datetime | None]
    taken_by_attempt: Mapped[int | None] = mapped_column(BigId)

    # Lets a spare be linked to an attempt that is not inserted yet; the unit of work fills in
    # the id at flush. (No database foreign key: the column is an audit trail.)
    taken_by: Mapped[Attempt | None] = relationship(
        primaryjoin="foreign(SparePrompt.taken_by_attempt) == Attempt.id"
    )


class PromptDraw(Base):
    """Each place of each epoch's order the loader reached, under pre-rollout skipping only:
    skipped or not, and why (streak, exploration rate, probability, the seeded uniform)."""

    __tablename__ = "prompt_draws"
    __table_args__ = (
        CheckConstraint("streak_kind IS NULL OR streak_kind IN ('solved', 'failed')", name="streak_kind"),
        CheckConstraint("(streak_kind IS NULL) = (streak = 0)", name="streak_has_kind"),
        CheckConstraint("probability >= 0 AND probability < 1", name="probability_range"),
        CheckConstraint("skipped = (uniform < probability)", name="skipped_iff_below"),
        Index(None, "run_id", "prompt_id"),
        Index(None, "run_id", "step"),
    )

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)  # in the epoch's order
    prompt_id: Mapped[int] = mapped_column(ForeignKey("prompts.id"))
    step: Mapped[int] = mapped_column(Integer)  # admitted, or the spare pool's earliest open
    skipped: Mapped[bool] = mapped_column(Boolean)
    streak_kind: Mapped[str | None] = mapped_column(String(8))
    streak: Mapped[int] = mapped_column(Integer)  # up to `decisions.saturating_streak`
    exploration: Mapped[float | None] = mapped_column(Float)
    probability: Mapped[float] = mapped_column(Float)
    uniform: Mapped[float] = mapped_column(Float)
    drawn_at: Mapped[datetime]


class WeightVersion(Base):
    __tablename__ = "weight_versions"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str | None] = mapped_column(Text)
    trained_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]


class StepMetrics(Base):
    """SPEC §6, one row per step: written at release, completed by the trainer."""

    __tablename__ = "step_metrics"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "step"], ["steps.run_id", "steps.step"], ondelete="CASCADE"),
    )

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    reward: Mapped[float | None] = mapped_column(Float)
    unfiltered_reward: Mapped[float | None] = mapped_column(Float)
    first_attempt_reward: Mapped[float | None] = mapped_column(Float)
    zero_variance_fraction: Mapped[float | None] = mapped_column(Float)
    zero_variance_groups: Mapped[int] = mapped_column(Integer, default=0)
    filtered_groups: Mapped[int] = mapped_column(Integer, default=0)
    replaced_prompt_groups: Mapped[int] = mapped_column(Integer, default=0)
    promoted_prompt_groups: Mapped[int] = mapped_column(Integer, default=0)
    dropped_prompt_groups: Mapped[int] = mapped_column(Integer, default=0)
    failed_attempts: Mapped[int] = mapped_column(Integer, default=0)
    trained_groups: Mapped[int] = mapped_column(Integer, default=0)
    spare_pool_size: Mapped[int] = mapped_column(Integer, default=0)
    staleness_mean: Mapped[float | None] = mapped_column(Float)
    staleness_max: Mapped[int | None] = mapped_column(Integer)
    step_fill_seconds: Mapped[float | None] = mapped_column(Float)
    trainer_idle_seconds: Mapped[float | None] = mapped_column(Float)
    generated_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Issue 15: cost per trained group, prompts skipped for the step, rates after its release.
    skipped_prompts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    rollouts_per_trained_group: Mapped[float | None] = mapped_column(Float)
    generated_tokens_per_trained_group: Mapped[float | None] = mapped_column(Float)
    skip_exploration_solved: Mapped[float | None] = mapped_column(Float)
    skip_exploration_failed: Mapped[float | None] = mapped_column(Float)
    budget_exhaustion_risk: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    clip_fraction: Mapped[float | None] = mapped_column(Float)
    entropy: Mapped[float | None] = mapped_column(Float)
    kl: Mapped[float | None] = mapped_column(Float)
    train_seconds: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None]


class OutboxKind(enum.StrEnum):
    # A generate message is its attempt: a pending attempt is one not sent yet (migration 0015).
    TRAIN_STEP = "train_step"


class Outbox(Base):
    """The train_step messages that must follow a commit, written in the same transaction and
    sent by a relay at least once (SPEC §2); the trainer is idempotent by step. A generate
    message needs no row here: a pending attempt is one (`refill.models.outbox`)."""

    __tablename__ = "outbox"
    __table_args__ = (
        CheckConstraint(_in("kind", OutboxKind), name="kind"),
        Index(
            "ix_outbox_unsent",
            "available_at",
            postgresql_where=text("sent_at IS NULL"),
            sqlite_where=text("sent_at IS NULL"),
        ),
        # The controller's relay: its run's first due rows, not every waiting row (0012; the
        # `kind` column has had one value since 0015).
        Index("ix_outbox_unsent_by_run", "run_id", "kind", "id", postgresql_where=text("sent_at IS NULL"), sqlite_where=text("sent_at IS NULL")),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    step: Mapped[int | None] = mapped_column(Integer)
    payload: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]
    available_at: Mapped[datetime]
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    claimed_until: Mapped[datetime | None]
    sent_at: Mapped[datetime | None]
    send_count: Mapped[int] = mapped_column(Integer, default=0)


class RejectedResult(Base):
    """A result that had no effect, and why (duplicate, late, unknown attempt...)."""

    __tablename__ = "rejected_results"
    __table_args__ = (
        CheckConstraint(_in("reason", RejectReason), name="reason"),
        Index(None, "run_id", "attempt_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int | None] = mapped_column(Integer)
    attempt_id: Mapped[int | None] = mapped_column(BigId)
    reason: Mapped[str] = mapped_column(String(16))
    worker: Mapped[str | None] = mapped_column(String(200))
    detail: Mapped[str | None] = mapped_column(Text)
    received_at: Mapped[datetime]
