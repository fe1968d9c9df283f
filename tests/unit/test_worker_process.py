"""What `refill worker ROLE` sets in its process before Celery's worker starts."""

from __future__ import annotations

import gc

from typer.testing import CliRunner

from refill.admin.cli import app as cli_app
from refill.tasks.runtime import GC_THRESHOLD


def test_a_fleet_worker_sets_its_garbage_collector_before_it_starts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The collector's thresholds are the worker's (`runtime.tune_collector`), and what the
    process loaded is frozen out of its passes, by the time the worker starts taking tasks."""
    from refill.tasks.app import app

    seen: dict[str, object] = {}

    def worker_main(argv: list[str]) -> None:  # instead of starting a worker
        seen.update(threshold=gc.get_threshold(), frozen=gc.get_freeze_count(), argv=argv)

    monkeypatch.setattr(app, "worker_main", worker_main)
    before = gc.get_threshold()
    assert before != GC_THRESHOLD
    try:
        result = CliRunner().invoke(
            cli_app,
            ["worker", "consume"],
            env={"REFILL_BROKER_URL": "redis://127.0.0.1:6379/15", "REFILL_DATABASE_URL": "postgresql+psycopg://u@127.0.0.1/none"},
        )
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert result.exit_code == 0, result.output
    assert seen["threshold"] == GC_THRESHOLD
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 1000
    assert "--queues" in seen["argv"]  # type: ignore[operator]


def test_a_worker_refuses_a_concurrency_below_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--concurrency 0` took the role's default without a word (`0 or default`), and a negative
    one went to Celery as it was: both are refused before anything starts."""
    from refill.tasks.app import app

    started: list[list[str]] = []
    monkeypatch.setattr(app, "worker_main", started.append)
    for bad in ("0", "-3"):
        result = CliRunner().invoke(
            cli_app, ["worker", "generate", "--concurrency", bad], env={"REFILL_BROKER_URL": "redis://127.0.0.1:6379/15"}
        )
        assert result.exit_code == 2, result.output
        assert "--concurrency" in result.output and "greater than or equal to" in " ".join(result.output.split())
    assert started == []


def test_a_bad_visibility_timeout_is_refused_naming_the_variable(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """It went to `int()` as it was: a worker started with `REFILL_VISIBILITY_TIMEOUT=6h` died
    with a traceback ending in "invalid literal for int()"."""
    from refill.tasks.app import (
        DEFAULT_VISIBILITY_TIMEOUT,
        celery_settings,
        visibility_timeout_seconds,
    )

    monkeypatch.delenv("REFILL_VISIBILITY_TIMEOUT", raising=False)
    assert visibility_timeout_seconds() == DEFAULT_VISIBILITY_TIMEOUT
    monkeypatch.setenv("REFILL_VISIBILITY_TIMEOUT", "90")
    assert celery_settings("redis://127.0.0.1:6379/15")["broker_transport_options"]["visibility_timeout"] == 90
    from refill.tasks.app import app

    def worker_main(argv: list[str]) -> None:
        raise AssertionError("the worker started")

    monkeypatch.setattr(app, "worker_main", worker_main)
    for bad in ("6h", "0", "-5"):
        monkeypatch.setenv("REFILL_VISIBILITY_TIMEOUT", bad)
        result = CliRunner().invoke(
            cli_app,
            ["worker", "consume"],
            env={"REFILL_BROKER_URL": "redis://127.0.0.1:6379/15", "REFILL_DATABASE_URL": "postgresql+psycopg://u@127.0.0.1/none"},
        )
        assert result.exit_code == 2, result.output
        assert f"REFILL_VISIBILITY_TIMEOUT={bad!r}: must be a positive integer" in result.output


def test_urls_and_a_log_level_celery_cannot_use_are_refused_before_the_worker_starts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`REFILL_DATABASE_URL=foo://...` started a worker that said it was ready and failed every
    task; `REFILL_BROKER_URL=bogus://...` and `--loglevel BOGUS` ended in Celery's tracebacks."""
    from refill.tasks.app import app

    def worker_main(argv: list[str]) -> None:
        raise AssertionError("the worker started")

    monkeypatch.setattr(app, "worker_main", worker_main)
    good = {"REFILL_BROKER_URL": "redis://127.0.0.1:6379/15", "REFILL_DATABASE_URL": "postgresql+psycopg://u@127.0.0.1/none"}
    for env, args, says in (
        ({"REFILL_DATABASE_URL": "foo://u:s3cret@h/x"}, [], "REFILL_DATABASE_URL: 'foo://u:***@h/x' is not a PostgreSQL or SQLite URL"),
        ({"REFILL_BROKER_URL": "bogus://h"}, [], "REFILL_BROKER_URL: 'bogus://h' is not a broker URL refill supports"),
        ({}, ["--loglevel", "BOGUS"], "--loglevel BOGUS: choose one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ):
        result = CliRunner().invoke(cli_app, ["worker", "consume", *args], env={**good, **env})
        assert result.exit_code == 2, result.output
        assert says in result.output
        assert "s3cret" not in result.output
