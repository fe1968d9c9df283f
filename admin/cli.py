"""The `refill` command line.

Structure: `app` is the root; each area of the product is a sub-app registered here with
`app.add_typer(<area>_app, name="<area>")` (e.g. `config`), or a top-level command with
`@app.command()`. Register only commands that work. Commands import heavy modules (SQLAlchemy
sessions, Celery, torch) inside their bodies, so that `refill --help` and `refill config check`
stay fast. Output and exit codes follow `refill.admin.console`: results on stdout, notes and
errors on stderr, exit 1 for "checked and wrong", exit 2 for bad input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from refill.admin.console import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_INVALID,
    fail,
    note,
    print_json,
    print_problems,
    print_yaml,
    redact_url,
    warn,
)

app = typer.Typer(
    name="refill",
    help="GRPO with DAPO-style dynamic sampling on a Celery fleet, with PostgreSQL as the run ledger.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    # Locals in a traceback would print database URLs with their passwords.
    pretty_exceptions_show_locals=False,
)

config_app = typer.Typer(help="Validate and show run configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")


def _register() -> None:
    # Each area lives in its own module; they import their heavy dependencies lazily.
    from refill.admin.db_commands import db_app
    from refill.admin.run_commands import demo, run_app
    from refill.admin.worker_commands import worker

    app.add_typer(run_app, name="run")
    app.add_typer(db_app, name="db")
    app.command("worker")(worker)
    app.command("demo")(demo)

    # Retention (issue 18): a finished run's bulky rows.
    from refill.admin.gc_command import gc

    app.command("gc")(gc)

    # Inspecting the ledger (issue 5).
    from refill.admin import (
        check_command,
        inspect_commands,
        metrics_commands,
        prompt_commands,
        tail_command,
    )

    run_app.command("show")(inspect_commands.run_show)
    app.command("runs")(inspect_commands.runs)
    app.command("steps")(inspect_commands.steps)
    app.command("slots")(inspect_commands.slots)
    app.command("slot")(inspect_commands.slot)
    app.command("budget")(inspect_commands.budget)
    app.command("workers")(inspect_commands.workers)
    app.command("tail")(tail_command.tail)
    app.command("metrics")(metrics_commands.metrics)
    app.command("plot")(metrics_commands.plot)
    app.command("check")(check_command.check)
    app.command("prompts")(prompt_commands.prompts)

    # Observability (issue 19): Prometheus metrics of the ledger and the broker.
    from refill.admin.exporter_command import exporter

    app.command("exporter")(exporter)


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="A run config (YAML).", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the resolved config as JSON.")] = False,
    no_runtime: Annotated[
        bool,
        typer.Option(
            "--no-runtime",
            help="Skip the checks that import the reward function, read the data set and load "
            "the model config (for a machine that does not hold them).",
        ),
    ] = False,
) -> None:
    """Validate FILE and print the resolved config (every default filled in).

    Exit 0 when it can run (warnings go to stderr), 1 listing every problem as
    `key.path: message. Fix: ...`, 2 when the file is missing or is not YAML.
    """
    from refill.config import (
        BROKER_URL_ENV,
        DATABASE_URL_ENV,
        ConfigError,
        ConfigFileError,
        load_config,
        resolved_urls,
    )

    try:
        config = load_config(file, check_runtime=not no_runtime)
    except ConfigFileError as exc:
        fail(exc.message, EXIT_BAD_INPUT)
    except ConfigError as exc:
        print_problems(file, exc.problems)
        raise typer.Exit(EXIT_INVALID) from None

    snapshot = config.snapshot()
    if as_json:
        print_json(snapshot)
    else:
        print_yaml(snapshot)
    for message in config.warnings():
        warn(message)
    db_url, broker_url = resolved_urls(config)
    for env_name, key, effective in ((DATABASE_URL_ENV, "infra.database_url", db_url),
                                     (BROKER_URL_ENV, "infra.broker_url", broker_url)):
        if os.environ.get(env_name):
            note(f"{key}: {env_name} overrides it: {redact_url(effective)}")
    skipped = " (run-time checks skipped)" if no_runtime else ""
    note(f"{file}: OK{skipped}; ledger {redact_url(db_url)}, broker {redact_url(broker_url)}, "
         f"config hash {config.config_hash()[:12]}")


_register()


def main() -> None:
    import sys

    try:
        app(prog_name="refill")
    except SystemExit as exit_:
        # Click answers a closed stdout (EPIPE) with exit 1, this CLI's "checked and wrong",
        # after wrapping stdout so that nothing more is written: that wrapper tells them apart
        # (by name: typer carries its own copy of click's).
        if exit_.code == EXIT_INVALID and type(sys.stdout).__name__ == "PacifyFlushWrapper":
            raise SystemExit(EXIT_BROKEN_PIPE) from None
        raise


if __name__ == "__main__":
    main()
