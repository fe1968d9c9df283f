"""ix_outbox_unsent_by_run: a run's unsent outbox rows of one kind, in id order.

The controller's relay asks, every pass, for the first due rows of its run and kind (a train
step's message, then as many generate rows as the run's share of the queue has room for). The
only index of unsent rows was by `available_at`, across every run: while PostgreSQL's statistics
had not yet seen a step's rows (a new run's first steps, any burst of admissions) it read every
due row of every run, joined each to its run and sorted them to keep the first few: 6 ms a pass
at 5,000 waiting rows, 55 ms at 50,000, against about 1 ms through this index, whatever the
statistics say (bench/HISTORY.md, stop 33).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNSENT = "sent_at IS NULL"


def upgrade() -> None:
    op.create_index(
        "ix_outbox_unsent_by_run",
        "outbox",
        ["run_id", "kind", "id"],
        postgresql_where=text(_UNSENT),
        sqlite_where=text(_UNSENT),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_unsent_by_run", table_name="outbox")
