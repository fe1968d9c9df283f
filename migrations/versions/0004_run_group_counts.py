"""runs.scored_groups, runs.zero_variance_groups: the run's measured zero-variance fraction,
kept as counters instead of counted from its attempts on every batch.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE on both ledgers, as in 0003.
    op.add_column("runs", sa.Column("scored_groups", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("runs", sa.Column("zero_variance_groups", sa.BigInteger(), server_default="0", nullable=False))
    # Runs recorded before this revision: count what the counters would have counted.
    op.execute(
        """
        UPDATE runs SET
            scored_groups = (
                SELECT count(*) FROM attempts
                WHERE attempts.run_id = runs.id AND attempts.zero_variance IS NOT NULL
            ),
            zero_variance_groups = (
                SELECT count(*) FROM attempts
                WHERE attempts.run_id = runs.id AND attempts.zero_variance = true
            )
        """
    )


def downgrade() -> None:
    op.drop_column("runs", "zero_variance_groups")
    op.drop_column("runs", "scored_groups")
