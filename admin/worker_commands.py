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
    events: Annotated[
        bool,
        typer.Option(
            "--events",
            help="Send Celery task events, so Flower shows this worker's tasks (one broker "
            "publish per task state change). REFILL_WORKER_EVENTS=1 does the same.",
        ),
    ] = False,
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
    try:
        # Importing the app builds it, which reads REFILL_WORKER_EVENTS (and refuses a bad value).
        from refill.tasks.app import EVENTS_ENV, app, event_settings, events_from_env

        from_env = events_from_env()
    except ValueError as error:
        fail(str(error), EXIT_BAD_INPUT)
    from refill.tasks.workers import worker_argv

    argv = worker_argv(role, concurrency=concurrency, hostname=hostname, loglevel=loglevel)
    if events or from_env:
        # Task-sent events come from what this worker sends (a consumer relays replacements).
        app.conf.update(event_settings(True))
        argv.append("--task-events")
        note(f"task events on ({'--events' if events else EVENTS_ENV + '=1'}): Flower shows this worker's tasks")
    note(f"{role} worker: {ROLES[role].doc}")
    note(f"broker {redact_url(broker)}, ledger {redact_url(database)}")
    app.worker_main(argv)
