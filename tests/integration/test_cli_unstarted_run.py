"""The inspect commands on a run no controller has started (made by `refill run start --detach`
before any control worker came): what they printed was empty or Python's `None`."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from refill.models.db import Ledger
from tests.support.driver import Driver


@pytest.fixture(scope="module")
def unstarted(migrated_url: str) -> int:
    ledger = Ledger(migrated_url)
    try:
        return Driver(ledger, start=False, check=False).run_id
    finally:
        ledger.dispose()


def test_tail_of_a_run_that_has_not_started_says_so(migrated_url: str, unstarted: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """It printed nothing and waited forever (its first 'filling:' line compared equal to the
    empty string it started from)."""
    run_id = unstarted
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "refill.admin.cli", "tail", str(run_id), "--interval", "0.1", "--database-url", migrated_url],
            stdout=stdout,
            stderr=stderr,
        )
        try:
            deadline = time.monotonic() + 60
            while "filling: -" not in out.read_text():
                assert process.poll() is None, err.read_text()
                assert time.monotonic() < deadline, (out.read_text(), err.read_text())
                time.sleep(0.1)
        finally:
            process.terminate()
            process.wait(10)
    assert f"run {run_id} has not started: no controller has taken it yet" in err.read_text()


def test_metrics_and_budget_of_a_run_with_no_step(migrated_url: str, unstarted: int) -> None:
    """`metrics --csv` printed a blank line, not a header; `budget` printed `p = None` and
    `slots by count {}`, `run show` its zero-variance fraction and mean rewards as `None`."""
    from typer.testing import CliRunner

    from refill.admin.cli import app
    from refill.admin.progress_queries import METRIC_COLUMNS

    runner = CliRunner()
    csv = runner.invoke(app, ["metrics", str(unstarted), "--csv", "--database-url", migrated_url])
    assert csv.exit_code == 0, csv.output
    assert csv.stdout.splitlines() == [",".join(METRIC_COLUMNS)]
    assert "has released no step yet" in csv.stderr
    budget = runner.invoke(app, ["budget", str(unstarted), "--database-url", migrated_url])
    assert budget.exit_code == 0, budget.output
    assert "p = - (0 of 0 finished groups)" in budget.stdout
    assert "slots by count none" in budget.stdout and "None" not in budget.stdout
    show = runner.invoke(app, ["run", "show", str(unstarted), "--database-url", migrated_url])
    assert show.exit_code == 0, show.output
    assert "None" not in show.stdout, show.stdout
