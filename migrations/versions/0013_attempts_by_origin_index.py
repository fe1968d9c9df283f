"""ix_attempts_run_id_origin_step_origin_slot: a run's attempts by the slot they were
dispatched for.

A step's release records `first_attempt_reward`, the mean reward of the first finished
generation of each slot's own prompt. Such an attempt may have moved to another slot or step
since (a hand-over, an extra's re-aim), so it is found by where it came from, `origin_step`,
which no index led with: the read scanned every attempt the run ever made, under the run's lock
(2,100 buffers on a run 3,000 steps of 16 prompts in, against 13 on a new one; linear in the
run's length). `refill slot` finds a slot's attempts by the same columns.

Building it reads every attempt once (about half a second a million rows on the development
machine) and holds other transactions' writes to `attempts` meanwhile, as 0010-0012 do: upgrade
between runs or with the fleet stopped.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NAME = "ix_attempts_run_id_origin_step_origin_slot"


def upgrade() -> None:
    op.create_index(_NAME, "attempts", ["run_id", "origin_step", "origin_slot"])


def downgrade() -> None:
    op.drop_index(_NAME, table_name="attempts")
