"""ix_groups_parked_version: a run's parked groups in weight-version order.

Every batch of results reads the parked groups a slot may still borrow (`weight_version >=`
the earliest open step's floor, in (weight_version, attempt_id) order) and over-dispatch counts
them. A parked group too stale to train stays parked for good, so through the (run_id, parked)
index both walked every group the run ever parked and filtered them: a cost that grew with the
run (`bench scale`: 15,000 parked groups and 14 ms per batch after 700,000 attempts). This
index serves them as a range of the fresh ones, in order.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PARKED = "parked IS true"


def upgrade() -> None:
    op.create_index(
        "ix_groups_parked_version",
        "groups",
        ["run_id", "weight_version", "attempt_id"],
        postgresql_where=text(_PARKED),
        sqlite_where=text(_PARKED),
    )


def downgrade() -> None:
    op.drop_index("ix_groups_parked_version", table_name="groups")
