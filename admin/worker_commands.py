"""`refill worker ROLE`: a `celery worker` with the queues, pool and concurrency of a role."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from refill.admin.console import EXIT_BAD_INPUT, fail, note, redact_url
from refill.tasks.workers import ROLES


def worker(
    role: Annotated[str, typer.Argument(help="generate | consume | train | control")],
    concurrency: Annotated[int | None, typer.Option(help="Threads (default depends on the role).")] = None,
    hostname: Annotated[str | None, typer.Option(help="Celery node name (default ROLE@host).")] = None,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Start a worker of one role on the fleet's broker (REFILL_BROKER_URL) and ledger
    (REFILL_DATABASE_URL)."""
    if role not in ROLES:
        fail(f"unknown role {role!r}; choose one of: {', '.join(ROLES)}", EXIT_BAD_INPUT)
    broker = os.environ.get("REFILL_BROKER_URL")
    database = os.environ.get("REFILL_DATABASE_URL")
    if not broker or broker.startswith("memory://"):
        fail(
            "a fleet worker needs a shared broker: set REFILL_BROKER_URL (e.g. redis://host:6379/0); "
            "for everything in one process use `refill run start` with no URLs (embedded)",
            EXIT_BAD_INPUT,
        )
    if not database:
        fail("a fleet worker needs the ledger: set REFILL_DATABASE_URL (postgresql+psycopg://...)", EXIT_BAD_INPUT)
    from refill.tasks.app import app
    from refill.tasks.workers import worker_argv

    note(f"{role} worker: {ROLES[role].doc}")
    note(f"broker {redact_url(broker)}, ledger {redact_url(database)}")
    app.worker_main(worker_argv(role, concurrency=concurrency, hostname=hostname, loglevel=loglevel))
