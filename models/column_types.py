"""The ledger's column types and constraint names, shared by every table
(`refill.models.tables`, which re-exports them: migrations name `tables.UTCDateTime`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import JSON, BigInteger, DateTime, Integer, TypeDecorator
from sqlalchemy.dialects import postgresql

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps are stored in UTC and always read back timezone-aware.

    SQLite keeps no offset and returns naive values; normalising here means no caller ever
    compares a naive and an aware datetime."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("refill stores timezone-aware datetimes only (use datetime.now(UTC))")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


# JSONB on PostgreSQL (indexable, compact), plain JSON text elsewhere.
# Its values are spelled by `json_text` (the engine's serializer, `db.make_engine`, and the
# writes past SQLAlchemy, `driver`).
JSONType = JSON().with_variant(postgresql.JSONB(), "postgresql")
# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def json_text(value: Any) -> str:
    """`value` as the JSON text the ledger stores. orjson spells a step's rewards, messages and
    prompt rows (about 18,000 values in a 4096-group step) ten to twenty times quicker than the
    standard library; what orjson refuses (an integer past 64 bits, a float subclass such as
    NumPy's) is spelled by the standard library, as before. A non-finite float is spelled
    `null`, as JSON has no word for it: the standard library's `NaN` is refused by PostgreSQL,
    so a trainer's extra metric that came out NaN would have failed its step's finish there
    (rewards are checked finite before they are stored)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value)


def read_json(text: str | bytes) -> Any:
    """The value of JSON built from the ledger's own columns (a joint read's rows: ids,
    counters, timestamps, floats; a step's rewards, which the trainer's claim reads): orjson's
    reading, six to eight times the standard library's, and exact for every integer a BIGINT
    holds. Only for that: orjson reads an integer past 64 bits as a
    float, so the JSONB columns that hold what a user gave (a prompt's row, a config) are read by
    the standard library (psycopg's and SQLAlchemy's default). Text orjson refuses (the `NaN` an
    older SQLite ledger may hold) goes to the standard library too."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
