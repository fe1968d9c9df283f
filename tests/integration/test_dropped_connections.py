"""A pooled connection the database dropped costs a transaction nothing: the pool's ping
finds it out on checkout, and a connection that drops under a transaction makes
`Ledger.transaction` (and the exporter's read) run again on a fresh one."""

from __future__ import annotations

from sqlalchemy import text

from refill.admin.exporter import read_ledger
from refill.models.db import Ledger, make_engine


def _drop_connections(url: str, application_name: str) -> int:
    killer = make_engine(url)
    with killer.begin() as connection:
        killed = connection.execute(
            text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = :name"),
            {"name": application_name},
        ).scalar_one()
    killer.dispose()
    return int(killed)


def test_a_transaction_on_a_dropped_connection_runs_again_on_a_fresh_one(pg_url) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(pg_url, application_name="refill-test-dropped")
    try:
        pid = ledger.transaction(lambda s: s.scalar(text("SELECT pg_backend_pid()")))
        assert _drop_connections(pg_url, "refill-test-dropped") == 1
        # The pooled connection is dead; the transaction still runs, on a fresh one.
        again = ledger.transaction(lambda s: s.scalar(text("SELECT pg_backend_pid()")))
        assert again != pid
        # The exporter's read (one retry) as well.
        ledger.transaction(lambda s: s.scalar(text("SELECT 1")))
        assert _drop_connections(pg_url, "refill-test-dropped") == 1
        runs, rejected = read_ledger(ledger, recent_minutes=60)
        assert isinstance(runs, list) and isinstance(rejected, dict)
    finally:
        ledger.dispose()
