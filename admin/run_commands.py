"""`refill run start|resume|stop` and `refill demo`: create a run and drive it.

With no database or broker URL (in the config or the environment) a run is embedded: every
role runs in this process, on a SQLite ledger and an in-process broker. Otherwise the run is
recorded in the fleet's ledger and this process is its controller (or, with `--detach`, a
`refill worker control` process is).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from refill.admin.console import (
    EXIT_BAD_INPUT,
    EXIT_INVALID,
    err_console,
    fail,
    note,
    out_console,
    print_problems,
    redact_url,
    show,
    warn,
)
from refill.admin.inspect_common import DatabaseUrl, RunId

if TYPE_CHECKING:
    from refill.config import RunConfig

run_app = typer.Typer(help="Start, resume and stop runs.", no_args_is_help=True)

Detach = Annotated[
    bool, typer.Option("--detach", help="Hand the run to the fleet's control workers and return.")
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No live display; a line per finished step.")]


def _load(path: Path) -> Any:
    from refill.config import ConfigError, ConfigFileError, load_config

    try:
        config = load_config(path, check_runtime=True)
    except ConfigFileError as error:
        fail(error.message, EXIT_BAD_INPUT)
    except ConfigError as error:
        print_problems(path, error.problems)
        raise typer.Exit(EXIT_INVALID) from None
    for message in config.warnings():
        warn(message)
    return config


@run_app.command("start")
def start(config_path: Annotated[Path, typer.Argument(metavar="CONFIG")], detach: Detach = False, quiet: Quiet = False) -> None:
    """Create a run from CONFIG and drive it to the end."""
    config = _load(config_path)
    drive_new_run(config, detach=detach, quiet=quiet)


@run_app.command("resume")
def resume(
    run_id: RunId,
    database_url: DatabaseUrl = None,
    detach: Detach = False,
    quiet: Quiet = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Take over even if its controller was seen in the last 30 s (only when you know it is dead)."),
    ] = False,
) -> None:
    """Continue a run whose controller stopped (crashed, interrupted, or `refill run stop`)."""
    from refill.admin.ledger_access import open_ledger
    from refill.config import from_snapshot
    from refill.models.runs import RunStateError, refuse_if_ended
    from refill.models.tables import Run

    ledger = open_ledger(database_url)
    with ledger.session() as session:
        run = session.get(Run, run_id)
        if run is None:
            fail(f"there is no run {run_id} in {redact_url(ledger.url)}", EXIT_BAD_INPUT)
        config = from_snapshot(run.config, source=f"run {run_id}'s stored config")
        try:
            # Before any worker starts: an embedded resume would start a whole fleet first.
            refuse_if_ended(run_id, run.status, run.end_reason, run.error)
        except RunStateError as error:
            fail(str(error), EXIT_BAD_INPUT)
    broker = os.environ.get("REFILL_BROKER_URL") or config.infra.broker_url
    if broker and "***" in broker:
        fail("the run's broker URL has a password: set REFILL_BROKER_URL to resume it", EXIT_BAD_INPUT)
    _drive(ledger, run_id, broker_url=broker, config=config, detach=detach, quiet=quiet, takeover_after=0.0 if force else 30.0)


@run_app.command("stop")
def stop(run_id: RunId, database_url: DatabaseUrl = None) -> None:
    """Ask a run's controller to stop it (in-flight attempts are cancelled; resumable)."""
    from datetime import timedelta

    from refill.admin.ledger_access import open_ledger
    from refill.models.clock import ledger_now
    from refill.models.runs import request_stop, stop_run
    from refill.models.tables import Run, RunStatus

    ledger = open_ledger(database_url)

    def ask(session) -> tuple[str, bool]:  # type: ignore[no-untyped-def]
        run = session.get(Run, run_id)
        if run is None:
            return "missing", False
        request_stop(session, run_id)
        # controller_seen_at is written on the database's clock: compare on the same clock.
        seen = run.controller_seen_at
        alive = seen is not None and seen > ledger_now(session) - timedelta(seconds=30)
        return run.status, alive

    status, alive = ledger.transaction(ask)
    if status == "missing":
        fail(f"there is no run {run_id}", EXIT_BAD_INPUT)
    if status == RunStatus.CREATED.value:
        ledger.transaction(lambda s: stop_run(s, run_id))
        note(
            f"run {run_id} had not started; it is stopped (a --detach start still queued leaves it; "
            f"`refill run resume {run_id}` starts it)"
        )
        return
    if status != RunStatus.RUNNING.value:
        note(f"run {run_id} is {status}; nothing to stop")
        return
    if alive:
        note(f"run {run_id}: stop requested; its controller stops it within a second")
        return
    cancelled = ledger.transaction(lambda s: stop_run(s, run_id))
    note(f"run {run_id} stopped (no live controller); {cancelled} attempts in flight cancelled")


def demo(quiet: Quiet = False) -> None:
    """Train the tiny model on arithmetic with GRPO + dynamic sampling, all in this process."""
    from refill.assets import ASSETS

    path = Path("configs/arith-tiny.yaml")
    if not path.exists():
        path = ASSETS / "arith-tiny.yaml"
    for name in ("REFILL_DATABASE_URL", "REFILL_BROKER_URL"):
        if os.environ.get(name):
            warn(f"{name} is set: the demo runs on that fleet, not embedded")
    drive_new_run(_load(path), detach=False, quiet=quiet)


# --------------------------------------------------------------------------------------


def drive_new_run(config: Any, *, detach: bool, quiet: bool) -> None:
    from refill.admin.ledger_access import ledger_at, schema_revision
    from refill.config import is_embedded, resolved_urls

    db_url, broker_url = resolved_urls(config)
    embedded = is_embedded(config)
    if embedded:
        Path(config.run.output_dir).mkdir(parents=True, exist_ok=True)
        note(f"embedded run: ledger {redact_url(db_url)}, in-process broker")
    elif broker_url.startswith("memory://"):
        # A ledger URL alone: this process runs every role, on that ledger.
        note(f"in-process workers on ledger {redact_url(db_url)} (no REFILL_BROKER_URL: no fleet)")
    else:
        note(f"fleet run: ledger {redact_url(db_url)}, broker {redact_url(broker_url)}")
    ledger = ledger_at(db_url)
    if not embedded:
        from refill.models.migrate import head_revision

        if schema_revision(ledger) != head_revision():
            fail(f"the ledger at {redact_url(db_url)} is not at the current schema: run `refill db upgrade`", EXIT_BAD_INPUT)
    _drive(ledger, None, broker_url=None if embedded else broker_url, config=config, detach=detach, quiet=quiet)


def _drive(
    ledger: Any,
    run_id: int | None,
    *,
    broker_url: str | None,
    config: RunConfig,
    detach: bool,
    quiet: bool,
    takeover_after: float = 30.0,
) -> None:
    """Drive a run (creating it first when run_id is None) with the right fleet around it."""
    from refill.tasks.app import make_app
    from refill.tasks.controller import Controller, new_controller_id, send_drive
    from refill.tasks.setup import create_run_from_config

    embedded = not broker_url or broker_url.startswith("memory://")
    if embedded:
        _one_torch_thread_per_role()
    with ExitStack() as stack:
        if embedded:
            if detach:
                fail("--detach needs a fleet (REFILL_BROKER_URL); an embedded run lives in this process", EXIT_BAD_INPUT)
            from refill.tasks.embedded import embedded_fleet

            runtime = stack.enter_context(embedded_fleet(ledger.url, config))
            ledger, app = runtime.ledger, runtime.app
        else:
            app = make_app(broker_url)
            _check_broker(app, broker_url)
        created = run_id is None
        if created:
            with err_console.status("preparing the run (data set, weight version 0)..."):
                run_id = create_run_from_config(ledger, config)
            note(f"run {run_id} created")
        if detach:
            controller_id = new_controller_id("control")
            send_drive(app, run_id, controller_id, start_only=created)
            out_console.print(f"run {run_id} handed to the control workers (`refill tail {run_id}` to follow)")
            return
        controller = Controller(ledger, app, run_id)
        from refill.models.runs import RunStateError

        try:
            controller.start(takeover_after_seconds=takeover_after)
        except RunStateError as error:  # the run's state refuses it: the wrong run, or another drives it
            fail(str(error), EXIT_BAD_INPUT)
        status = _follow(controller, quiet=quiet)
    _summary(ledger, run_id, status)


def _check_broker(app: Any, broker_url: str) -> None:
    """Fail fast, before anything is written, when the broker cannot be reached (a wrong host
    or password), rather than create the run and wait on it forever."""
    from urllib.parse import urlsplit

    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.5)
    except Exception as error:  # noqa: BLE001 - reported, with any secret removed
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        password = urlsplit(broker_url).password
        if password:
            message = message.replace(password, "***")
        fail(f"cannot reach the broker at {redact_url(broker_url)}: {message}", EXIT_BAD_INPUT)


def _one_torch_thread_per_role() -> None:
    """In the embedded default the engine and the trainer share this process's cores: one
    intra-op thread each keeps them from oversubscribing a small CPU (on 2 cores, two threads
    each made the demo several times slower). REFILL_TORCH_THREADS overrides."""
    threads = os.environ.get("REFILL_TORCH_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    import sys

    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _follow(controller: Any, *, quiet: bool) -> str:
    from refill.admin.progress import RunDisplay, StepLines

    steps = StepLines()

    def line(snapshot) -> None:  # type: ignore[no-untyped-def]
        for text in steps.lines(snapshot):
            out_console.print(text, markup=False)

    try:
        if quiet or not err_console.is_terminal:
            return controller.run(on_progress=line)
        with RunDisplay(err_console) as display:
            return controller.run(on_progress=display.update)
    except KeyboardInterrupt:
        warn(
            f"interrupted: the controller stopped, run {controller.run_id} is still running in the "
            f"ledger. `refill run resume {controller.run_id}` continues it; `refill run stop "
            f"{controller.run_id}` stops it."
        )
        raise typer.Exit(130) from None


def _summary(ledger: Any, run_id: int, status: str) -> None:
    from refill.admin.progress import metrics_table, write_metrics
    from refill.admin.progress_queries import step_metrics
    from refill.models.tables import Run

    with ledger.session() as session:
        run = session.get(Run, run_id)
        rows = step_metrics(session, run_id)
        run_dir, error, end_reason = run.run_dir, run.error, run.end_reason
    path = write_metrics(rows, run_dir)
    trained = [r for r in rows if r.get("reward") is not None]
    if trained:
        show(metrics_table(trained[-10:], title=f"run {run_id}: last steps"))
        head = [r["reward"] for r in trained[:5]]
        tail = [r["reward"] for r in trained[-5:]]
        out_console.print(
            f"mean reward: first {len(head)} steps {sum(head) / len(head):.3f}, "
            f"last {len(tail)} steps {sum(tail) / len(tail):.3f}"
        )
    out_console.print(f"run {run_id} {status} ({end_reason or '-'}); metrics: {path}")
    if status == "failed":
        err_console.print(error or "", markup=False)
        raise typer.Exit(EXIT_INVALID)
