"""Throw-away ledgers for tests: a fresh PostgreSQL database per test session (so that
concurrent test sessions on one server never share state) and a fresh SQLite file per test.

The server is the test session's (tests/support/services.py): the one REFILL_TEST_PG_URL names,
which the session sets to its throwaway server when it was not set."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

#: Outside a test session (the benchmarks), with REFILL_TEST_PG_URL unset: the local server.
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def pg_admin_url() -> str:
    """An admin URL of the test PostgreSQL server (any database; we create our own next to
    it). Read at each call: the session sets the variable once its server is up."""
    return os.environ.get("REFILL_TEST_PG_URL") or DEFAULT_PG_URL


@contextmanager
def temporary_pg_database(prefix: str = "refill_test") -> Iterator[str]:
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin_url = pg_admin_url()
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as error:  # noqa: BLE001 - re-raised with the fix
        raise RuntimeError(
            f"cannot create a test database on {make_url(admin_url).render_as_string()}: "
            f"{error}. Unset REFILL_TEST_PG_URL for a throwaway server, or point it at a "
            "server where this user may create databases."
        ) from error
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


def truncate_all(url: str) -> None:
    from refill.models.tables import Base

    engine = create_engine(url)
    with engine.begin() as conn:
        names = ", ".join(t.name for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    engine.dispose()


def backend_seen(engine: Engine, condition: str, params: dict[str, Any] | None = None, *, within: float) -> bool:
    """Whether a PostgreSQL backend matching `condition` (SQL over `pg_stat_activity`'s columns)
    shows up within `within` seconds, watched from a connection of its own: a test's way to know
    that another thread's statement is running, or waiting, before it goes on. Each look is a
    transaction of its own (a transaction sees one snapshot of the server's activity)."""
    deadline = time.monotonic() + within
    with engine.connect() as watcher:
        while True:
            seen = watcher.execute(text(f"SELECT count(*) FROM pg_stat_activity WHERE {condition}"), params or {}).scalar_one()
            watcher.commit()
            if seen:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
