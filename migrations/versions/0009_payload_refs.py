"""groups.payload_ref: a committed group's rollout stored beside the broker (issue 17).

A generation worker stores a group's rollout in the run's payload store
(`refill.models.payload_store`: `<run_dir>/payloads/<name>`) and sends only its name, size and
checksum; the committed group keeps those three (`payload_ref`, `payload_bytes`,
`payload_checksum`) and `rollout` / `completion_texts` stay NULL. A group is in one place or
the other, never both (`ck_groups_payload_in_one_place`).

Downgrading reads each stored payload back into `rollout` and `completion_texts` (the schema
before this one holds nothing else), a page at a time; a payload that is missing or damaged
stops it with the group's name, before anything is dropped.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from refill.models import rollout_codec

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("alembic.runtime.migration")

_PAGE = 100
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
_CHECK = (
    "(payload_ref IS NULL) = (rollout IS NOT NULL) AND (payload_ref IS NULL) = (completion_texts IS NOT NULL)"
    " AND (payload_ref IS NULL) = (payload_bytes IS NULL) AND (payload_ref IS NULL) = (payload_checksum IS NULL)"
)

_groups = sa.table(
    "groups",
    sa.column("attempt_id", sa.BigInteger()),
    sa.column("run_id", sa.Integer()),
    sa.column("rollout", sa.LargeBinary()),
    sa.column("completion_texts", _JSON),
    sa.column("payload_ref", sa.String()),
    sa.column("payload_bytes", sa.BigInteger()),
    sa.column("payload_checksum", sa.String()),
)
_runs = sa.table("runs", sa.column("id", sa.Integer()), sa.column("run_dir", sa.Text()))


def upgrade() -> None:
    with op.batch_alter_table("groups") as batch:
        batch.add_column(sa.Column("payload_ref", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("payload_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("payload_checksum", sa.String(length=71), nullable=True))
        batch.alter_column("rollout", existing_type=sa.LargeBinary(), nullable=True)
        batch.alter_column("completion_texts", existing_type=_JSON, nullable=True)
        batch.create_check_constraint(op.f("ck_groups_payload_in_one_place"), sa.text(_CHECK))


def downgrade() -> None:
    _inline_stored_payloads()
    with op.batch_alter_table("groups") as batch:
        batch.drop_constraint(op.f("ck_groups_payload_in_one_place"), type_="check")
        batch.alter_column("rollout", existing_type=sa.LargeBinary(), nullable=False)
        batch.alter_column("completion_texts", existing_type=_JSON, nullable=False)
        batch.drop_column("payload_checksum")
        batch.drop_column("payload_bytes")
        batch.drop_column("payload_ref")


def _inline_stored_payloads() -> None:
    """Read every stored payload into its group's `rollout` and `completion_texts`."""
    bind = op.get_bind()
    stored = _groups.c.payload_ref.is_not(None)
    total = bind.execute(sa.select(sa.func.count()).select_from(_groups).where(stored)).scalar_one()
    if not total:
        return
    statement = (
        sa.update(_groups)
        .where(_groups.c.attempt_id == sa.bindparam("key"))
        .values(
            rollout=sa.bindparam("new_rollout"),
            completion_texts=sa.bindparam("new_texts"),
            payload_ref=None,
            payload_bytes=None,
            payload_checksum=None,
        )
    )
    done = 0
    while True:
        # Each page leaves `stored`: the next page is the next one still stored.
        rows = bind.execute(
            sa.select(_groups, _runs.c.run_dir)
            .join(_runs, _runs.c.id == _groups.c.run_id)
            .where(stored)
            .order_by(_groups.c.attempt_id)
            .limit(_PAGE)
        ).all()
        if not rows:
            break
        bind.execute(statement, [_inlined(row) for row in rows])
        done += len(rows)
        log.info("groups inlined: %d of %d", done, total)


def _inlined(row: sa.Row) -> dict[str, object]:
    path = os.path.join(row.run_dir, "payloads", row.payload_ref)
    try:
        with open(path, "rb") as fh:
            payload = fh.read()
        if len(payload) != row.payload_bytes or rollout_codec.checksum(payload) != row.payload_checksum:
            raise rollout_codec.RolloutFormatError("its size or checksum is not what the worker wrote")
        prompt, completions = rollout_codec.unpack_payload(payload)
        rollout = rollout_codec.encode(prompt, completions)[0]
    except (OSError, rollout_codec.RolloutFormatError) as error:
        raise RuntimeError(
            f"group {row.attempt_id}'s payload {path} cannot be read back into the ledger ({error}); "
            "restore the file or delete that row of `groups`, and downgrade again (nothing was dropped)"
        ) from error
    return {"key": row.attempt_id, "new_rollout": rollout, "new_texts": rollout_codec.texts(completions)}
