"""The ledger: runs, prompts, steps, slots, attempts, groups, spare pool, weight versions,
step metrics, outbox, rejected results.

Revision ID: 0001
Revises:
Create Date: 2026-12-02 13:22:51.051122
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

import refill.models.tables

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rejected_results",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("received_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "reason IN ('duplicate', 'late', 'unknown', 'run_finished', 'malformed')",
            name=op.f("ck_rejected_results_reason"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rejected_results")),
    )
    op.create_index(
        op.f("ix_rejected_results_run_id_attempt_id"),
        "rejected_results",
        ["run_id", "attempt_id"],
        unique=False,
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column(
            "config",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("data_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=False),
        sa.Column("created_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("started_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("finished_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(length=32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("num_prompts_per_step", sa.Integer(), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column("max_num_steps", sa.Integer(), nullable=False),
        sa.Column("max_lookahead_versions", sa.Integer(), nullable=False),
        sa.Column("num_prompts", sa.Integer(), nullable=False),
        sa.Column("loader_epoch", sa.Integer(), nullable=False),
        sa.Column("loader_cursor", sa.Integer(), nullable=False),
        sa.Column("loader_exhausted", sa.Boolean(), nullable=False),
        sa.Column("next_step", sa.Integer(), nullable=False),
        sa.Column("weight_version", sa.Integer(), nullable=False),
        sa.Column("consecutive_dropped", sa.Integer(), nullable=False),
        sa.Column("stop_requested", sa.Boolean(), nullable=False),
        sa.Column("controller_id", sa.String(length=200), nullable=True),
        sa.Column(
            "controller_seen_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True
        ),
        sa.CheckConstraint(
            "status IN ('created', 'running', 'completed', 'failed', 'stopped')",
            name=op.f("ck_runs_status"),
        ),
        sa.CheckConstraint("group_size >= 1", name=op.f("ck_runs_group_size")),
        sa.CheckConstraint("num_prompts_per_step >= 1", name=op.f("ck_runs_num_prompts_per_step")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_table(
        "prompts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column(
            "row",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_prompts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prompts")),
    )
    op.create_index(
        op.f("ix_prompts_run_id_position"), "prompts", ["run_id", "position"], unique=True
    )
    op.create_table(
        "steps",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("num_slots", sa.Integer(), nullable=False),
        sa.Column("committed", sa.Integer(), nullable=False),
        sa.Column("shrunk", sa.Integer(), nullable=False),
        sa.Column("dropped_shrunk", sa.Integer(), nullable=False),
        sa.Column("admitted_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("released_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column(
            "train_started_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("trained_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("trainer_id", sa.String(length=200), nullable=True),
        sa.Column(
            "trainer_lease_until", refill.models.tables.UTCDateTime(timezone=True), nullable=True
        ),
        sa.Column("train_claims", sa.Integer(), nullable=False),
        sa.CheckConstraint(
            "status = 'open' OR committed = num_slots - shrunk",
            name=op.f("ck_steps_released_steps_are_full"),
        ),
        sa.CheckConstraint(
            "status IN ('open', 'released', 'training', 'trained')", name=op.f("ck_steps_status")
        ),
        sa.CheckConstraint(
            "committed >= 0 AND committed <= num_slots - shrunk",
            name=op.f("ck_steps_committed_le_target"),
        ),
        sa.CheckConstraint("dropped_shrunk <= shrunk", name=op.f("ck_steps_dropped_shrunk_range")),
        sa.CheckConstraint(
            "shrunk >= 0 AND shrunk <= num_slots", name=op.f("ck_steps_shrunk_range")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_steps_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_steps")),
    )
    op.create_table(
        "weight_versions",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("trained_step", sa.Integer(), nullable=True),
        sa.Column("created_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_weight_versions_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "version", name=op.f("pk_weight_versions")),
    )
    op.create_table(
        "slots",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("prompt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column(
            "group_attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("shrink_reason", sa.String(length=16), nullable=True),
        sa.Column("needs_replacement", sa.Boolean(), nullable=False),
        sa.Column("filtered", sa.Integer(), nullable=False),
        sa.Column("filter_replacements", sa.Integer(), nullable=False),
        sa.Column("filter_budget", sa.Integer(), nullable=False),
        sa.Column("infra_failures", sa.Integer(), nullable=False),
        sa.Column("data_failures", sa.Integer(), nullable=False),
        sa.Column("drops", sa.Integer(), nullable=False),
        sa.Column("drop_replacements", sa.Integer(), nullable=False),
        sa.Column("drop_budget", sa.Integer(), nullable=False),
        sa.Column("borrowed_in", sa.Integer(), nullable=False),
        sa.Column("lent_out", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("settled_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(status = 'committed') = (group_attempt_id IS NOT NULL)",
            name=op.f("ck_slots_committed_has_group"),
        ),
        sa.CheckConstraint(
            "(status = 'shrunk') = (shrink_reason IS NOT NULL)",
            name=op.f("ck_slots_shrunk_has_reason"),
        ),
        sa.CheckConstraint(
            "status IN ('open', 'committed', 'shrunk')", name=op.f("ck_slots_status")
        ),
        sa.CheckConstraint("drop_replacements <= drop_budget", name=op.f("ck_slots_drop_budget")),
        sa.CheckConstraint(
            "filter_replacements <= filter_budget", name=op.f("ck_slots_filter_budget")
        ),
        sa.CheckConstraint("filtered <= filter_budget + 1", name=op.f("ck_slots_filtered_range")),
        sa.ForeignKeyConstraint(
            ["prompt_id"], ["prompts.id"], name=op.f("fk_slots_prompt_id_prompts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "step"],
            ["steps.run_id", "steps.step"],
            name=op.f("fk_slots_run_id_step_steps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "idx", name=op.f("pk_slots")),
    )
    op.create_index(op.f("ix_slots_group_attempt_id"), "slots", ["group_attempt_id"], unique=True)
    op.create_table(
        "spare_prompts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column(
            "prompt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("added_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("taken_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column(
            "taken_by_attempt", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.ForeignKeyConstraint(
            ["prompt_id"], ["prompts.id"], name=op.f("fk_spare_prompts_prompt_id_prompts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_spare_prompts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_spare_prompts")),
    )
    op.create_index(
        "ix_spare_prompts_available",
        "spare_prompts",
        ["run_id", "id"],
        unique=False,
        postgresql_where=sa.text("taken_at IS NULL"),
        sqlite_where=sa.text("taken_at IS NULL"),
    )
    op.create_table(
        "step_metrics",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("unfiltered_reward", sa.Float(), nullable=True),
        sa.Column("first_attempt_reward", sa.Float(), nullable=True),
        sa.Column("zero_variance_fraction", sa.Float(), nullable=True),
        sa.Column("zero_variance_groups", sa.Integer(), nullable=False),
        sa.Column("filtered_groups", sa.Integer(), nullable=False),
        sa.Column("replaced_prompt_groups", sa.Integer(), nullable=False),
        sa.Column("promoted_prompt_groups", sa.Integer(), nullable=False),
        sa.Column("dropped_prompt_groups", sa.Integer(), nullable=False),
        sa.Column("failed_attempts", sa.Integer(), nullable=False),
        sa.Column("trained_groups", sa.Integer(), nullable=False),
        sa.Column("spare_pool_size", sa.Integer(), nullable=False),
        sa.Column("staleness_mean", sa.Float(), nullable=True),
        sa.Column("staleness_max", sa.Integer(), nullable=True),
        sa.Column("step_fill_seconds", sa.Float(), nullable=True),
        sa.Column("trainer_idle_seconds", sa.Float(), nullable=True),
        sa.Column("generated_tokens", sa.Integer(), nullable=False),
        sa.Column("budget_exhaustion_risk", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("grad_norm", sa.Float(), nullable=True),
        sa.Column("clip_fraction", sa.Float(), nullable=True),
        sa.Column("entropy", sa.Float(), nullable=True),
        sa.Column("kl", sa.Float(), nullable=True),
        sa.Column("train_seconds", sa.Float(), nullable=True),
        sa.Column(
            "extra",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "step"],
            ["steps.run_id", "steps.step"],
            name=op.f("fk_step_metrics_run_id_step_steps"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_step_metrics")),
    )
    op.create_table(
        "attempts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("slot_idx", sa.Integer(), nullable=True),
        sa.Column("origin_step", sa.Integer(), nullable=False),
        sa.Column("origin_slot", sa.Integer(), nullable=True),
        sa.Column(
            "prompt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("try_no", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(length=24), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("failure_kind", sa.String(length=16), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("min_weight_version", sa.Integer(), nullable=False),
        sa.Column("weight_version", sa.Integer(), nullable=True),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("created_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("available_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("dispatched_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("leased_until", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("finished_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("generation_seconds", sa.Float(), nullable=True),
        sa.Column(
            "rewards",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("reward_min", sa.Float(), nullable=True),
        sa.Column("reward_max", sa.Float(), nullable=True),
        sa.Column("zero_variance", sa.Boolean(), nullable=True),
        sa.Column("num_tokens", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "(state = 'failed') = (failure_kind IS NOT NULL)",
            name=op.f("ck_attempts_failed_has_kind"),
        ),
        sa.CheckConstraint(
            "failure_kind IS NULL OR failure_kind IN ('infra', 'data', 'stale')",
            name=op.f("ck_attempts_failure_kind"),
        ),
        sa.CheckConstraint(
            "reason IN ('first', 'retry', 'filter_replacement', 'drop_replacement', 'respawn', 'extra')",
            name=op.f("ck_attempts_reason"),
        ),
        sa.CheckConstraint(
            "state IN ('pending', 'queued', 'running', 'committed', 'filtered', 'failed', 'cancelled')",
            name=op.f("ck_attempts_state"),
        ),
        sa.CheckConstraint("try_no >= 1", name=op.f("ck_attempts_try_no")),
        sa.ForeignKeyConstraint(
            ["prompt_id"], ["prompts.id"], name=op.f("fk_attempts_prompt_id_prompts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "step", "slot_idx"],
            ["slots.run_id", "slots.step", "slots.idx"],
            name=op.f("fk_attempts_run_id_step_slot_idx_slots"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
    )
    op.create_index(
        "ix_attempts_live_lease",
        "attempts",
        ["run_id", "leased_until"],
        unique=False,
        postgresql_where=sa.text("state IN ('queued', 'running')"),
        sqlite_where=sa.text("state IN ('queued', 'running')"),
    )
    op.create_index(op.f("ix_attempts_run_id_state"), "attempts", ["run_id", "state"], unique=False)
    op.create_index(
        op.f("ix_attempts_run_id_step_slot_idx"),
        "attempts",
        ["run_id", "step", "slot_idx"],
        unique=False,
    )
    op.create_table(
        "groups",
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column(
            "prompt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("origin_step", sa.Integer(), nullable=False),
        sa.Column("weight_version", sa.Integer(), nullable=False),
        sa.Column(
            "rewards",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("reward_mean", sa.Float(), nullable=False),
        sa.Column("zero_variance", sa.Boolean(), nullable=False),
        sa.Column(
            "prompt_token_ids",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "completions",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("committed_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("parked", sa.Boolean(), nullable=False),
        sa.Column("moves", sa.Integer(), nullable=False),
        sa.Column("trained_step", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_groups_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["prompt_id"], ["prompts.id"], name=op.f("fk_groups_prompt_id_prompts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_groups_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("attempt_id", name=op.f("pk_groups")),
    )
    op.create_index(op.f("ix_groups_run_id_parked"), "groups", ["run_id", "parked"], unique=False)
    op.create_index(
        op.f("ix_groups_run_id_trained_step"), "groups", ["run_id", "trained_step"], unique=False
    )
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column(
            "attempt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("created_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("available_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.Column("claimed_by", sa.String(length=200), nullable=True),
        sa.Column("claimed_until", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("sent_at", refill.models.tables.UTCDateTime(timezone=True), nullable=True),
        sa.Column("send_count", sa.Integer(), nullable=False),
        sa.CheckConstraint("kind IN ('generate', 'train_step')", name=op.f("ck_outbox_kind")),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_outbox_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_outbox_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
    )
    op.create_index(
        "ix_outbox_unsent",
        "outbox",
        ["available_at"],
        unique=False,
        postgresql_where=sa.text("sent_at IS NULL"),
        sqlite_where=sa.text("sent_at IS NULL"),
    )
    # slots.group_attempt_id and attempts(run_id, step, slot_idx) reference each other, so one
    # of the two foreign keys is added once both tables exist.
    with op.batch_alter_table("slots") as batch:
        batch.create_foreign_key(
            op.f("fk_slots_group_attempt_id_attempts"), "attempts", ["group_attempt_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("slots") as batch:
        batch.drop_constraint(op.f("fk_slots_group_attempt_id_attempts"), type_="foreignkey")
    op.drop_index(
        "ix_outbox_unsent",
        table_name="outbox",
        postgresql_where=sa.text("sent_at IS NULL"),
        sqlite_where=sa.text("sent_at IS NULL"),
    )
    op.drop_table("outbox")
    op.drop_index(op.f("ix_groups_run_id_trained_step"), table_name="groups")
    op.drop_index(op.f("ix_groups_run_id_parked"), table_name="groups")
    op.drop_table("groups")
    op.drop_index(op.f("ix_attempts_run_id_step_slot_idx"), table_name="attempts")
    op.drop_index(op.f("ix_attempts_run_id_state"), table_name="attempts")
    op.drop_index(
        "ix_attempts_live_lease",
        table_name="attempts",
        postgresql_where=sa.text("state IN ('queued', 'running')"),
        sqlite_where=sa.text("state IN ('queued', 'running')"),
    )
    op.drop_table("attempts")
    op.drop_table("step_metrics")
    op.drop_index(
        "ix_spare_prompts_available",
        table_name="spare_prompts",
        postgresql_where=sa.text("taken_at IS NULL"),
        sqlite_where=sa.text("taken_at IS NULL"),
    )
    op.drop_table("spare_prompts")
    op.drop_index(op.f("ix_slots_group_attempt_id"), table_name="slots")
    op.drop_table("slots")
    op.drop_table("weight_versions")
    op.drop_table("steps")
    op.drop_index(op.f("ix_prompts_run_id_position"), table_name="prompts")
    op.drop_table("prompts")
    op.drop_table("runs")
    op.drop_index(op.f("ix_rejected_results_run_id_attempt_id"), table_name="rejected_results")
    op.drop_table("rejected_results")
