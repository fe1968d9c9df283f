"""steps.extras: how many over-dispatched attempts a step has sent.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE on both ledgers (SQLite adds and drops columns natively since 3.35): a
# batch-mode copy of `steps` on SQLite would break the views of 0002 that read it.


def upgrade() -> None:
    op.add_column("steps", sa.Column("extras", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    op.drop_column("steps", "extras")
