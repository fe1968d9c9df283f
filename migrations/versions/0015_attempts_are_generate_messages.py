"""A pending attempt is its own generate message: no `generate` rows in the outbox.

Until now every attempt was written with an outbox row saying "send a generate message for this
attempt", and marked sent with its attempt when the relay queued it. The attempt row already
said all of it: `state = 'pending'` is "not yet sent", `available_at` is when it is due (a
retry's back-off). The relay now reads pending attempts through `ix_attempts_unsent` (run, id,
of pending attempts only) and the outbox keeps the `train_step` messages, one per step. A
4096-group step writes about 7,700 rows and 7,700 updates fewer (bench/HISTORY.md, stop 52).

Upgrading deletes the generate rows, sent or not (an unsent row's attempt is pending, and the
relay finds it by its state), and the outbox's `attempt_id`. Downgrading writes an unsent
generate row again for every pending attempt, which is what the schema before this one expects.
Stop the fleet's controllers first either way: a relay of the other schema would not find what
it looks for.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PENDING = "state = 'pending'"
_UNSENT = "sent_at IS NULL"
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _drop_outbox_indexes() -> None:
    # Dropped around SQLite's table rebuild, and made again after it, rather than trusting the
    # rebuild to carry their WHERE clauses over.
    op.drop_index("ix_outbox_unsent_by_run", table_name="outbox")
    op.drop_index("ix_outbox_unsent", table_name="outbox")


def _create_outbox_indexes() -> None:
    op.create_index("ix_outbox_unsent", "outbox", ["available_at"], postgresql_where=sa.text(_UNSENT), sqlite_where=sa.text(_UNSENT))
    op.create_index(
        "ix_outbox_unsent_by_run", "outbox", ["run_id", "kind", "id"], postgresql_where=sa.text(_UNSENT), sqlite_where=sa.text(_UNSENT)
    )


def upgrade() -> None:
    op.create_index("ix_attempts_unsent", "attempts", ["run_id", "id"], postgresql_where=sa.text(_PENDING), sqlite_where=sa.text(_PENDING))
    op.execute("DELETE FROM outbox WHERE kind = 'generate'")
    _drop_outbox_indexes()
    with op.batch_alter_table("outbox") as batch:
        batch.drop_constraint(op.f("ck_outbox_kind"), type_="check")
        batch.drop_constraint(op.f("fk_outbox_attempt_id_attempts"), type_="foreignkey")
        batch.drop_column("attempt_id")
        batch.create_check_constraint(op.f("ck_outbox_kind"), "kind IN ('train_step')")
    _create_outbox_indexes()


def downgrade() -> None:
    _drop_outbox_indexes()
    with op.batch_alter_table("outbox") as batch:
        batch.drop_constraint(op.f("ck_outbox_kind"), type_="check")
        batch.add_column(sa.Column("attempt_id", _BIG_ID, nullable=True))
        batch.create_foreign_key(op.f("fk_outbox_attempt_id_attempts"), "attempts", ["attempt_id"], ["id"], ondelete="CASCADE")
        batch.create_check_constraint(op.f("ck_outbox_kind"), "kind IN ('generate', 'train_step')")
    _create_outbox_indexes()
    empty = "CAST('{}' AS jsonb)" if op.get_bind().dialect.name == "postgresql" else "'{}'"
    op.execute(
        "INSERT INTO outbox (run_id, kind, attempt_id, payload, created_at, available_at, send_count) "
        f"SELECT run_id, 'generate', id, {empty}, created_at, available_at, 0 FROM attempts "
        f"WHERE {_PENDING} ORDER BY id"
    )
    op.drop_index("ix_attempts_unsent", table_name="attempts")
