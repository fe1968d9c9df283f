"""Prompt history and pre-rollout skipping (issue 15).

- prompt_draws: each place of an epoch's order the data loader reached while skipping is on,
  skipped or not, with the streak, exploration rate, probability and seeded uniform behind it;
- runs.skip_exploration_solved / _failed: skipping's adapted exploration rates;
- step_metrics: skipped_prompts, rollouts_per_trained_group,
  generated_tokens_per_trained_group and the exploration rates after the step;
- ix_attempts_scored_prompt: a prompt's scored attempts, which skipping reads;
- the view prompt_history: one row per prompt of a run, its attempts, its zero-variance streak
  (all-solved and all-failed apart), its last pass rate, its skip state and when it was last
  seen. A zero-variance group is all-solved when its (equal) reward is above 0, as in
  `refill.models.decisions.group_kind`.

The view's SQL is portable but for `prompt_key`, the row's `data.prompt_id_field` (else its
position), read from JSON in each dialect's own way. Columns are added with plain ALTER TABLE
on both ledgers (see 0003).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import refill.models.tables

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SCORED = "zero_variance IS NOT NULL"

_KEY = {
    "postgresql": """COALESCE(p."row" ->> (r.config #>> '{data,prompt_id_field}'), CAST(p.position AS TEXT))""",
    "sqlite": (
        """COALESCE(CAST(json_extract(p."row", '$."' || json_extract(r.config, '$.data.prompt_id_field') """
        """|| '"') AS TEXT), CAST(p.position AS TEXT))"""
    ),
}

#: One row per prompt of each run. `zero_variance_streak` counts the prompt's latest scored
#: groups that were all of `streak_kind` (0 and NULL when its latest group had spread);
#: `skip_state` is what the loader did the last time it reached the prompt under skipping.
PROMPT_HISTORY = """
CREATE VIEW prompt_history AS
WITH kinds AS (
    SELECT
        run_id,
        prompt_id,
        id,
        reward_mean,
        CASE WHEN zero_variance
            THEN CASE WHEN reward_mean > 0 THEN 'solved' ELSE 'failed' END
            ELSE 'mixed' END AS kind
    FROM attempts
    WHERE zero_variance IS NOT NULL
),
ranked AS (
    SELECT
        run_id,
        prompt_id,
        reward_mean,
        kind,
        ROW_NUMBER() OVER (PARTITION BY run_id, prompt_id ORDER BY id DESC) AS recency,
        FIRST_VALUE(kind) OVER (PARTITION BY run_id, prompt_id ORDER BY id DESC) AS latest_kind
    FROM kinds
),
scored AS (
    SELECT
        run_id,
        prompt_id,
        COUNT(*) AS scored,
        SUM(CASE WHEN kind <> 'mixed' THEN 1 ELSE 0 END) AS zero_variance_groups,
        MAX(CASE WHEN recency = 1 THEN reward_mean END) AS last_pass_rate,
        MAX(CASE WHEN recency = 1 THEN kind END) AS last_kind,
        MIN(CASE WHEN kind <> latest_kind THEN recency END) AS first_break
    FROM ranked
    GROUP BY run_id, prompt_id
),
tried AS (
    SELECT run_id, prompt_id, COUNT(*) AS attempts, MAX(origin_step) AS last_seen_step
    FROM attempts
    GROUP BY run_id, prompt_id
),
draws AS (
    SELECT
        run_id,
        prompt_id,
        epoch,
        skipped,
        probability,
        ROW_NUMBER() OVER (PARTITION BY run_id, prompt_id ORDER BY epoch DESC, position DESC) AS recency
    FROM prompt_draws
),
drawn AS (
    SELECT
        run_id,
        prompt_id,
        COUNT(*) AS draws,
        SUM(CASE WHEN skipped THEN 1 ELSE 0 END) AS skips,
        MAX(CASE WHEN recency = 1 THEN epoch END) AS last_seen_epoch,
        MAX(CASE WHEN recency = 1 THEN CASE WHEN skipped THEN 'skipped' ELSE 'tried' END END) AS skip_state,
        MAX(CASE WHEN recency = 1 THEN probability END) AS last_skip_probability
    FROM draws
    GROUP BY run_id, prompt_id
)
SELECT
    p.run_id,
    p.id AS prompt_id,
    p.position,
    {key} AS prompt_key,
    COALESCE(t.attempts, 0) AS attempts,
    COALESCE(s.scored, 0) AS scored,
    COALESCE(s.zero_variance_groups, 0) AS zero_variance_groups,
    s.last_pass_rate,
    CASE WHEN s.last_kind <> 'mixed' THEN s.last_kind END AS streak_kind,
    CASE
        WHEN s.last_kind IS NULL OR s.last_kind = 'mixed' THEN 0
        ELSE COALESCE(s.first_break - 1, s.scored)
    END AS zero_variance_streak,
    d.skip_state,
    d.last_skip_probability,
    COALESCE(d.draws, 0) AS draws,
    COALESCE(d.skips, 0) AS skips,
    t.last_seen_step,
    d.last_seen_epoch
FROM prompts p
JOIN runs r ON r.id = p.run_id
LEFT JOIN scored s ON s.run_id = p.run_id AND s.prompt_id = p.id
LEFT JOIN tried t ON t.run_id = p.run_id AND t.prompt_id = p.id
LEFT JOIN drawn d ON d.run_id = p.run_id AND d.prompt_id = p.id
"""


def upgrade() -> None:
    op.create_table(
        "prompt_draws",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("prompt_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("skipped", sa.Boolean(), nullable=False),
        sa.Column("streak_kind", sa.String(length=8), nullable=True),
        sa.Column("streak", sa.Integer(), nullable=False),
        sa.Column("exploration", sa.Float(), nullable=True),
        sa.Column("probability", sa.Float(), nullable=False),
        sa.Column("uniform", sa.Float(), nullable=False),
        sa.Column("drawn_at", refill.models.tables.UTCDateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "streak_kind IS NULL OR streak_kind IN ('solved', 'failed')",
            name=op.f("ck_prompt_draws_streak_kind"),
        ),
        sa.CheckConstraint("(streak_kind IS NULL) = (streak = 0)", name=op.f("ck_prompt_draws_streak_has_kind")),
        sa.CheckConstraint(
            "probability >= 0 AND probability < 1", name=op.f("ck_prompt_draws_probability_range")
        ),
        sa.CheckConstraint("skipped = (uniform < probability)", name=op.f("ck_prompt_draws_skipped_iff_below")),
        sa.ForeignKeyConstraint(
            ["prompt_id"], ["prompts.id"], name=op.f("fk_prompt_draws_prompt_id_prompts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_prompt_draws_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "epoch", "position", name=op.f("pk_prompt_draws")),
    )
    op.create_index(op.f("ix_prompt_draws_run_id_prompt_id"), "prompt_draws", ["run_id", "prompt_id"])
    op.create_index(op.f("ix_prompt_draws_run_id_step"), "prompt_draws", ["run_id", "step"])
    op.create_index(
        "ix_attempts_scored_prompt",
        "attempts",
        ["run_id", "prompt_id"],
        postgresql_where=sa.text(_SCORED),
        sqlite_where=sa.text(_SCORED),
    )
    op.add_column("runs", sa.Column("skip_exploration_solved", sa.Float(), nullable=True))
    op.add_column("runs", sa.Column("skip_exploration_failed", sa.Float(), nullable=True))
    op.add_column("step_metrics", sa.Column("skipped_prompts", sa.Integer(), server_default="0", nullable=False))
    for name in (
        "rollouts_per_trained_group",
        "generated_tokens_per_trained_group",
        "skip_exploration_solved",
        "skip_exploration_failed",
    ):
        op.add_column("step_metrics", sa.Column(name, sa.Float(), nullable=True))
    dialect = op.get_bind().dialect.name
    op.execute(PROMPT_HISTORY.format(key=_KEY.get(dialect, _KEY["sqlite"])))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS prompt_history")
    for name in (
        "skip_exploration_failed",
        "skip_exploration_solved",
        "generated_tokens_per_trained_group",
        "rollouts_per_trained_group",
        "skipped_prompts",
    ):
        op.drop_column("step_metrics", name)
    op.drop_column("runs", "skip_exploration_failed")
    op.drop_column("runs", "skip_exploration_solved")
    op.drop_index("ix_attempts_scored_prompt", table_name="attempts")
    op.drop_index(op.f("ix_prompt_draws_run_id_step"), table_name="prompt_draws")
    op.drop_index(op.f("ix_prompt_draws_run_id_prompt_id"), table_name="prompt_draws")
    op.drop_table("prompt_draws")
