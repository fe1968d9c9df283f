"""`refill tail RUN` on a run no controller has started: it printed nothing and waited forever
(the first 'filling:' line compared equal to its empty start). It says where the run stands at
once, and why nothing moves."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from refill.models.db import Ledger
from refill.models.migrate import upgrade
from tests.support.databases import temporary_pg_database
from tests.support.driver import Driver


@pytest.fixture(scope="module")
def migrated_url() -> Iterator[str]:
    with temporary_pg_database("refill_tail") as url:
        upgrade(url)
        yield url


def test_tail_of_a_run_that_has_not_started_says_so(migrated_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(migrated_url)
    try:
        run_id = Driver(ledger, start=False, check=False).run_id
    finally:
        ledger.dispose()
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
