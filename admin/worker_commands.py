"""`refill worker ROLE`: a `celery worker` with the queues, pool and concurrency of a role."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

from refill.admin.console import EXIT_BAD_INPUT, fail, note, redact_url
from refill.tasks.workers import ROLES

#: Celery's log levels (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def worker(
    role: Annotated[str, typer.Argument(help="generate | consume | train | control")],
    concurrency: Annotated[int | None, typer.Option(help="Threads (default depends on the role).", min=1)] = None,
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
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="train only: run N ranks of one trainer on this machine (one per GPU), the "
            "policy sharded over them with FSDP2. Across machines, run `refill worker train` "
            "under torchrun instead.",
        ),
    ] = None,
) -> None:
    """Start a worker of one role on the fleet's broker (REFILL_BROKER_URL) and ledger
    (REFILL_DATABASE_URL)."""
    if role not in ROLES:
        fail(f"unknown role {role!r}; choose one of: {', '.join(ROLES)}", EXIT_BAD_INPUT)
    if nproc is not None and role != "train":
        fail(f"--nproc is for the train role (ranks of one trainer), not {role!r}", EXIT_BAD_INPUT)
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
    # What is wrong with the URLs themselves fails now; a ledger or broker that is down is
    # waited for (a fleet starts in any order).
    from refill.config.urls import broker_url_problem, database_url_problem

    for name, problem in (("REFILL_BROKER_URL", broker_url_problem(broker)), ("REFILL_DATABASE_URL", database_url_problem(database))):
        if problem:
            fail(f"{name}: {problem}", EXIT_BAD_INPUT)
    if loglevel.upper() not in LOG_LEVELS:
        fail(f"--loglevel {loglevel}: choose one of {', '.join(LOG_LEVELS)}", EXIT_BAD_INPUT)
    try:
        # Importing the app builds it, which reads REFILL_WORKER_EVENTS (and refuses a bad value).
        from refill.tasks.app import (
            EVENTS_ENV,
            app,
            event_settings,
            events_from_env,
            visibility_timeout_seconds,
        )
        from refill.tasks.relay import queued_per_share

        from_env = events_from_env()
        # Read again here: the app may have been built before this command ran (in-process).
        visibility_timeout_seconds()
        queued_per_share()
    except ValueError as error:
        fail(str(error), EXIT_BAD_INPUT)
    if role == "train":
        _train_ranks(nproc, concurrency=concurrency, hostname=hostname, loglevel=loglevel, events=events)
    from refill.tasks.workers import worker_argv

    argv = worker_argv(role, concurrency=concurrency, hostname=hostname, loglevel=loglevel)
    if events or from_env:
        # Task-sent events come from what this worker sends (a consumer relays replacements).
        app.conf.update(event_settings(True))
        argv.append("--task-events")
        note(f"task events on ({'--events' if events else EVENTS_ENV + '=1'}): Flower shows this worker's tasks")
    note(f"{role} worker: {ROLES[role].doc}")
    note(f"broker {redact_url(broker)}, ledger {redact_url(database)}")
    from refill.tasks.runtime import tune_collector

    tune_collector()
    app.worker_main(argv)


def _train_ranks(nproc: int | None, *, concurrency: int | None, hostname: str | None, loglevel: str, events: bool) -> None:
    """Where this train worker stands among a trainer's ranks. Returns in the process that
    runs the Celery worker (a single trainer, or rank 0, joined to its ranks); the launcher
    of --nproc N and the ranks other than 0 end the command here."""
    from refill.trainer.launch import launch, rank_env

    try:
        ranks = rank_env()
    except ValueError as error:
        fail(str(error), EXIT_BAD_INPUT)
    if nproc is not None and nproc > 1:
        if ranks is not None:
            fail(
                f"this process is already rank {ranks.rank} of {ranks.world_size} (torchrun's "
                "environment): drop --nproc",
                EXIT_BAD_INPUT,
            )
        argv = [sys.executable, "-m", "refill.admin.cli", "worker", "train", "--loglevel", loglevel]
        argv += ["--concurrency", str(concurrency)] if concurrency else []
        argv += ["--hostname", hostname] if hostname else []
        argv += ["--events"] if events else []
        note(f"train worker: {nproc} ranks of one trainer, the policy sharded over them (FSDP2)")
        raise typer.Exit(launch(argv, nproc))
    if ranks is None:
        return
    from refill.trainer.distributed import join_world

    world = join_world(ranks)
    if not ranks.leader:
        from refill.trainer.ranks import follow

        logging.basicConfig(
            level=loglevel.upper(),
            format=f"[%(asctime)s: %(levelname)s/rank {ranks.rank}] %(name)s: %(message)s",
        )
        raise typer.Exit(follow(world))
    note(f"trainer rank 0 of {ranks.world_size}: this worker takes the steps, the other ranks follow")
