"""Indexes for the queries the consumer runs on every batch, and runs.spare_prompts_available.

- ix_slots_open, ix_slots_waiting: the first open slots of a run and the first slots waiting
  on a replacement, in (step, idx) order, read in index order and cut at the LIMIT (they sorted
  every open slot of the run).
- ix_attempts_live_step: a step's live attempts, which over-dispatch counts (the
  (run_id, step, slot_idx) index walked every attempt of the step).
- ix_attempts_unstarted_extras: the extras over-dispatch re-aims when their step settles (it
  walked every extra the run ever made).
- runs.spare_prompts_available: the spare pool's size as a counter, like 0004's, instead of a
  count of the pool on every batch.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OPEN = "status = 'open'"
_WAITING = "status = 'open' AND needs_replacement IS true"
_LIVE = "state IN ('pending', 'queued', 'running')"
_UNSTARTED_EXTRA = "slot_idx IS NULL AND state IN ('pending', 'queued')"


def upgrade() -> None:
    op.add_column(
        "runs", sa.Column("spare_prompts_available", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.execute(
        """
        UPDATE runs SET spare_prompts_available = (
            SELECT count(*) FROM spare_prompts
            WHERE spare_prompts.run_id = runs.id AND spare_prompts.taken_at IS NULL
        )
        """
    )
    op.create_index(
        "ix_slots_open",
        "slots",
        ["run_id", "step", "idx"],
        postgresql_where=sa.text(_OPEN),
        sqlite_where=sa.text(_OPEN),
    )
    op.create_index(
        "ix_slots_waiting",
        "slots",
        ["run_id", "step", "idx"],
        postgresql_where=sa.text(_WAITING),
        sqlite_where=sa.text(_WAITING),
    )
    op.create_index(
        "ix_attempts_live_step",
        "attempts",
        ["run_id", "step"],
        postgresql_where=sa.text(_LIVE),
        sqlite_where=sa.text(_LIVE),
    )
    op.create_index(
        "ix_attempts_unstarted_extras",
        "attempts",
        ["run_id", "step"],
        postgresql_where=sa.text(_UNSTARTED_EXTRA),
        sqlite_where=sa.text(_UNSTARTED_EXTRA),
    )


def downgrade() -> None:
    op.drop_index("ix_attempts_unstarted_extras", table_name="attempts")
    op.drop_index("ix_attempts_live_step", table_name="attempts")
    op.drop_index("ix_slots_waiting", table_name="slots")
    op.drop_index("ix_slots_open", table_name="slots")
    op.drop_column("runs", "spare_prompts_available")
