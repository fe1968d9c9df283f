"""runs.tracked_steps: the last step each experiment tracker was given (issue 19).

The run's controller logs each trained step's metrics to the trackers the config enables
(refill.tracking) and records here, per tracker, the last step it logged, so a controller that
takes over after a crash (`refill run resume`) goes on from there.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    # Plain ALTER TABLE on both ledgers, as in 0003. A run recorded before this revision has
    # logged nothing to a tracker (NULL).
    op.add_column("runs", sa.Column("tracked_steps", _JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "tracked_steps")
