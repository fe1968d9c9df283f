"""ix_attempts_scored_prompt gains `id`: a prompt's scored attempts, newest last.

Pre-rollout skipping judges each prompt the data loader reaches by its zero-variance streak,
which it read from every scored attempt of the prompt: a history that grows with every epoch
(a run 1,000 steps of 16 prompts over 48 prompts: 2,100 buffers a draw, under the run's lock).
A streak longer than the one whose skip probability has reached its ceiling skips with the same
probability, so the loader now reads each prompt's newest few only
(`decisions.saturating_streak`), walking this index back from the prompt's newest attempt.

Building it reads every attempt once (about half a second a million rows on the development
machine) and holds other transactions' writes to `attempts` meanwhile, as 0010-0012 do: upgrade
between runs or with the fleet stopped.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NAME = "ix_attempts_scored_prompt"
_SCORED = "zero_variance IS NOT NULL"


def _create(columns: list[str]) -> None:
    op.create_index(_NAME, "attempts", columns, postgresql_where=text(_SCORED), sqlite_where=text(_SCORED))


def upgrade() -> None:
    op.drop_index(_NAME, table_name="attempts")
    _create(["run_id", "prompt_id", "id"])


def downgrade() -> None:
    op.drop_index(_NAME, table_name="attempts")
    _create(["run_id", "prompt_id"])
