"""groups.rollout: a committed group's token ids and log-probs packed, not JSONB numbers.

`groups.prompt_token_ids` and `groups.completions` (JSONB: token ids, log-probs, text and
finish reason of each completion) become `groups.rollout` (bytea, layout in
`refill.models.rollout_codec`, stored uncompressed on PostgreSQL) and
`groups.completion_texts` (JSON: each completion's text and finish reason). Every stored
group is converted, both ways, in pages of `_PAGE` rows; nothing is dropped before its data
has a new home.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from refill.models import rollout_codec
from refill.models.payload import Completion

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("alembic.runtime.migration")

_PAGE = 100  # a group of 16 x 512 tokens is about half a megabyte of Python lists
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")

_groups = sa.table(
    "groups",
    sa.column("attempt_id", sa.BigInteger()),
    sa.column("prompt_token_ids", _JSON),
    sa.column("completions", _JSON),
    sa.column("rollout", sa.LargeBinary()),
    sa.column("completion_texts", _JSON),
)


def upgrade() -> None:
    op.add_column("groups", sa.Column("rollout", sa.LargeBinary(), nullable=True))
    op.add_column("groups", sa.Column("completion_texts", _JSON, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        # Token ids and log-probs barely compress: pglz would spend CPU on every insert.
        op.execute("ALTER TABLE groups ALTER COLUMN rollout SET STORAGE EXTERNAL")
    _convert(_groups.c.rollout.is_(None), ("rollout", "completion_texts"), _packed)
    with op.batch_alter_table("groups") as batch:
        batch.alter_column("rollout", existing_type=sa.LargeBinary(), nullable=False)
        batch.alter_column("completion_texts", existing_type=_JSON, nullable=False)
        batch.drop_column("completions")
        batch.drop_column("prompt_token_ids")


def downgrade() -> None:
    op.add_column("groups", sa.Column("prompt_token_ids", _JSON, nullable=True))
    op.add_column("groups", sa.Column("completions", _JSON, nullable=True))
    _convert(_groups.c.prompt_token_ids.is_(None), ("prompt_token_ids", "completions"), _unpacked)
    with op.batch_alter_table("groups") as batch:
        batch.alter_column("prompt_token_ids", existing_type=_JSON, nullable=False)
        batch.alter_column("completions", existing_type=_JSON, nullable=False)
        batch.drop_column("completion_texts")
        batch.drop_column("rollout")


def _packed(row: Any) -> tuple[bytes, list[dict[str, Any]]]:
    try:
        return rollout_codec.encode(
            row.prompt_token_ids,
            [
                Completion(c["token_ids"], c["logprobs"], c.get("text", ""), c.get("finish_reason", "stop"))
                for c in row.completions
            ],
        )
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise RuntimeError(
            f"group {row.attempt_id} cannot be packed ({error}); fix or delete that row of `groups` "
            "and run the upgrade again (nothing was changed)"
        ) from error


def _unpacked(row: Any) -> tuple[list[int], list[dict[str, Any]]]:
    prompt, completions = rollout_codec.decode(row.rollout, row.completion_texts)
    return prompt, [
        {"token_ids": c.token_ids, "logprobs": c.logprobs, "text": c.text, "finish_reason": c.finish_reason}
        for c in completions
    ]


def _convert(
    unconverted: sa.ColumnElement[bool], targets: tuple[str, str], convert: Callable[[Any], tuple[Any, Any]]
) -> None:
    """Write `targets` from `convert(row)` for every group still matching `unconverted`, a
    page at a time in attempt order (a page per statement, not the table in memory)."""
    bind = op.get_bind()
    total = bind.execute(sa.select(sa.func.count()).select_from(_groups).where(unconverted)).scalar_one()
    if not total:
        return
    statement = (
        sa.update(_groups)
        .where(_groups.c.attempt_id == sa.bindparam("key"))
        .values(**{name: sa.bindparam(f"new_{name}") for name in targets})
    )
    done, after = 0, None
    while True:
        query = sa.select(_groups).where(unconverted).order_by(_groups.c.attempt_id).limit(_PAGE)
        if after is not None:
            query = query.where(_groups.c.attempt_id > after)
        rows = bind.execute(query).all()
        if not rows:
            break
        bind.execute(statement, [{"key": row.attempt_id, **dict(zip((f"new_{name}" for name in targets), convert(row), strict=True))} for row in rows])
        after = rows[-1].attempt_id
        done += len(rows)
        log.info("groups converted: %d of %d", done, total)

