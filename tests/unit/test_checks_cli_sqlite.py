"""The inspection commands and `refill check` on the embedded ledger (SQLite, migrated by
Alembic like `refill db upgrade`), on a run driven by hand through the ledger API: the same
answers as on PostgreSQL (tests/acceptance/test_cli_inspect.py), and the views of migration
0002 in SQLite's dialect."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.models.db import Ledger
from refill.models.migrate import upgrade
from tests.support.driver import Driver

runner = CliRunner()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """Step 0 trained (slot 1 filtered once and replaced); step 1 open, partly committed."""
    url = f"sqlite:///{tmp_path_factory.mktemp('embedded')}/refill.db"
    upgrade(url)
    ledger = Ledger(url)
    d = Driver(ledger, check=False)
    d.admit()
    d.filter_slot(0, 1)
    d.fill_step(0)
    assert d.train(0)
    d.admit()
    d.commit_slot(1, 0)
    ledger.dispose()
    return url, d.run_id


def invoke(url: str, *args: str) -> object:
    return runner.invoke(app, [*args, "--database-url", url])


def as_json(url: str, *args: str) -> object:
    result = invoke(url, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_every_command_answers_on_sqlite(embedded: tuple[str, int], tmp_path: Path) -> None:
    url, run = embedded
    (row,) = as_json(url, "runs")
    assert (row["run_id"], row["status"], row["trained_steps"]) == (run, "running", 1)
    detail = as_json(url, "run", "show", str(run))
    assert detail["attempts"]["filtered"] == 1 and detail["steps"] == {"trained": 1, "open": 2}
    steps = as_json(url, "steps", str(run))
    assert [(s["step"], s["status"], s["committed"]) for s in steps] == [(0, "trained", 4), (1, "open", 1), (2, "open", 0)]
    open_slots = as_json(url, "slots", str(run), "--step", "1", "--status", "open")
    assert [s["slot"] for s in open_slots] == [1, 2, 3]
    assert all(s["live_attempts"] == 1 for s in open_slots)
    history = as_json(url, "slot", str(run), "0", "1")
    assert [a["reason"] for a in history["attempts"]] == ["first", "filter_replacement"]
    assert [a["outcome"] for a in history["attempts"]] == ["filtered", "committed, trained in slot (0, 1)"]
    budget = as_json(url, "budget", str(run))
    assert budget["zero_variance_groups"] == 1 and budget["filter_replacements"] == 1
    assert [(s["step"], s["slot"]) for s in budget["slots"]] == [(0, 1)]
    metrics = as_json(url, "metrics", str(run))
    assert [m["step"] for m in metrics] == [0] and metrics[0]["filtered_groups"] == 1
    # The driver's clock is in the past: look back far enough to see its worker's work.
    workers = as_json(url, "workers", "--run", str(run), "--since", "1e10")
    (w1,) = [w for w in workers["workers"] if w["worker"] == "w1"]
    assert w1["in_flight"] == 0 and w1["finished_recently"] == detail["attempts"]["committed"] + 1
    assert workers["waiting"] == {"pending": 3 + 4, "queued": 0}
    out = tmp_path / "p.png"
    assert invoke(url, "plot", str(run), "-o", str(out)).exit_code == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    once = invoke(url, "tail", str(run), "--once")
    assert once.exit_code == 0 and "step 1: 1/4 open" in once.stdout
    check = invoke(url, "check", str(run))
    assert check.exit_code == 0, check.stdout
    assert "all" in check.stdout and "checks hold" in check.stdout


def test_the_views_agree_on_sqlite(embedded: tuple[str, int]) -> None:
    url, run = embedded
    ledger = Ledger(url)
    try:
        with ledger.engine.connect() as connection:
            summary = connection.execute(
                text("SELECT step, committed, open_slots, filtered_attempts FROM step_summary WHERE run_id = :r ORDER BY step"),
                {"r": run},
            ).all()
            rate = connection.execute(
                text("SELECT step, finished, zero_variance, filtered, filter_rate FROM filter_rate WHERE run_id = :r AND step = 0"),
                {"r": run},
            ).one()
            history = connection.execute(
                text("SELECT relation, holds_group, state FROM slot_history WHERE run_id = :r AND step = 0 AND slot_idx = 1 ORDER BY attempt_id"),
                {"r": run},
            ).all()
            used = connection.execute(
                text("SELECT filter_budget_left, filter_budget_used FROM budget_use WHERE run_id = :r AND step = 0 AND slot_idx = 1"),
                {"r": run},
            ).one()
    finally:
        ledger.dispose()
    assert [tuple(r) for r in summary] == [(0, 4, 0, 1), (1, 1, 3, 0), (2, 0, 4, 0)]
    assert tuple(rate) == (0, 5, 1, 1, pytest.approx(0.2))
    assert [tuple(r) for r in history] == [("own", 0, "filtered"), ("own", 1, "committed")]
    assert tuple(used) == (2, pytest.approx(1 / 3))


def test_a_broken_embedded_ledger_fails_the_check(embedded: tuple[str, int], tmp_path: Path) -> None:
    url, run = embedded
    # A copy, so the module's ledger stays whole for the other tests.
    copy = tmp_path / "broken.db"
    with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as source, closing(sqlite3.connect(copy)) as target:
        source.backup(target)  # the WAL's pages included
    broken = f"sqlite:///{copy}"
    ledger = Ledger(broken)
    try:
        with ledger.session() as session:
            session.execute(text("UPDATE groups SET weight_version = -5 WHERE attempt_id = (SELECT group_attempt_id FROM slots WHERE run_id = :r AND step = 0 AND idx = 2)"), {"r": run})
    finally:
        ledger.dispose()
    result = invoke(broken, "check", str(run))
    assert result.exit_code == 1
    assert f"run {run}, step 0, slot 2, attempt" in result.stdout and "staleness 5" in result.stdout


@pytest.mark.parametrize(
    "args",
    [("runs",), ("runs", "--json"), ("steps", "{run}"), ("check", "{run}"), ("metrics", "{run}", "--csv")],
)
def test_output_to_a_reader_that_went_away_is_not_checked_and_wrong(embedded: tuple[str, int], args: tuple[str, ...]) -> None:
    """`refill check RUN | head -1` exited 1, this CLI's "checked and wrong", once `head` had
    gone (rich's and click's answer to EPIPE): a script with pipefail read a healthy ledger as
    a broken one. It exits 141 now, as a tool that SIGPIPE ended does; nothing on stderr."""
    import os
    import subprocess
    import sys

    from refill.admin.console import EXIT_BROKEN_PIPE

    url, run = embedded
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: EPIPE every time
    try:
        done = subprocess.run(
            [sys.executable, "-m", "refill.admin.cli", *(a.format(run=run) for a in args), "--database-url", url],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_BROKEN_PIPE, done.stderr
    assert b"Traceback" not in done.stderr and b"Exception ignored" not in done.stderr, done.stderr
