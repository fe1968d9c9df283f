"""`refill gc RUN` (issue 18): a finished run's payloads, rejected results and relayed outbox
rows go; the SQL views and `refill check` read the same after it as before."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import select, text
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.admin.retention import NotFinished, collect, measure
from refill.models.db import Ledger
from refill.models.migrate import upgrade
from refill.models.tables import Group, Outbox, RejectedResult
from tests.support.databases import temporary_pg_database
from tests.support.driver import FLAT, Driver

runner = CliRunner()


@pytest.fixture(params=["postgresql", "sqlite"])
def migrated(request, tmp_path) -> Iterator[tuple[str, Ledger]]:
    """A ledger built by `refill db upgrade` (so it has the views), on both databases."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/refill.db"
        upgrade(url)
        ledger = Ledger(url)
        yield url, ledger
        ledger.dispose()
        return
    with temporary_pg_database("refill_gc") as url:
        upgrade(url)
        ledger = Ledger(url)
        yield url, ledger
        ledger.dispose()


def finished_run(ledger: Ledger) -> Driver:
    """Two steps trained, a filtered group replaced, a duplicate result refused, every
    message relayed: a completed run with something of each kind to collect."""
    # Checked here by `refill check` (the suite's own check runs after this ledger is gone).
    d = Driver(ledger, {"grpo": {"max_num_steps": 2}}, check=False)
    d.admit()
    d.relay()
    first = d.live_of(0, 1)
    d.filter_slot(0, 1)
    d.record(d.result(first.id, FLAT))  # the same result again: refused as a duplicate
    for step in (0, 1):
        d.relay()
        d.fill_step(step)
        d.relay()
        assert d.train(step)
    d.relay()
    assert d.run().status == "completed"
    return d


def views(ledger: Ledger) -> dict[str, list[tuple[str, ...]]]:
    with ledger.engine.connect() as connection:
        if ledger.dialect == "postgresql":
            names = connection.execute(
                text("SELECT table_name FROM information_schema.views WHERE table_schema = current_schema()")
            ).scalars()
        else:
            names = connection.execute(text("SELECT name FROM sqlite_master WHERE type = 'view'")).scalars()
        return {
            name: sorted(tuple(map(str, row)) for row in connection.execute(text(f"SELECT * FROM {name}")))
            for name in sorted(names)
        }


def cli(url: str, *args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, [*args, "--database-url", url])


def test_gc_removes_the_bulk_and_keeps_what_the_views_and_checks_read(migrated) -> None:
    url, ledger = migrated
    d = finished_run(ledger)
    before = views(ledger)
    assert {"step_summary", "slot_history", "budget_use", "filter_rate"} <= set(before)
    assert all(before[name] for name in ("step_summary", "slot_history", "budget_use"))

    dry = cli(url, "gc", str(d.run_id))
    assert dry.exit_code == 0, dry.output
    assert "would remove 8 payloads" in dry.stdout and "would remove 1 rejected results" in dry.stdout
    assert "--yes" in dry.output
    planned = {g.kind: g for g in ledger.transaction(lambda s: measure(s, d.run_id))}
    assert planned["payloads"].bytes > 0 and planned["relayed outbox rows"].rows == len(d.outbox())
    assert len(d.groups()) == 8 and d.rejected()  # a dry run removes nothing

    done = cli(url, "gc", str(d.run_id), "--yes", "--json")
    assert done.exit_code == 0, done.output
    removed = {g["kind"]: g["rows"] for g in json.loads(done.stdout)["removed"]}
    assert removed == {
        "payloads": 8, "stored payloads": 0, "rejected results": 1,
        "relayed outbox rows": planned["relayed outbox rows"].rows,
    }
    with ledger.session() as session:
        assert session.scalars(select(Group.rollout).where(Group.run_id == d.run_id)).all() == [b""] * 8
        assert session.scalars(select(RejectedResult).where(RejectedResult.run_id == d.run_id)).all() == []
        assert session.scalars(select(Outbox).where(Outbox.run_id == d.run_id)).all() == []
    assert [g.rows for g in ledger.transaction(lambda s: measure(s, d.run_id))] == [0, 0, 0, 0]
    assert collect(ledger, d.run_id)[0].rows == 0  # a second gc finds nothing

    assert views(ledger) == before
    check = cli(url, "check", str(d.run_id))
    assert check.exit_code == 0, check.stdout
    assert "checks hold" in check.stdout
    shown = cli(url, "run", "show", str(d.run_id))
    assert shown.exit_code == 0, shown.output


def test_gc_refuses_a_run_that_may_still_train(migrated) -> None:
    url, ledger = migrated
    running = Driver(ledger, check=False)
    running.admit()
    running.fill_step(0)
    assert [m.kind for m in running.relay() if m.kind == "train_step"] == ["train_step"]  # a relayed row to keep
    refused = cli(url, "gc", str(running.run_id))
    assert refused.exit_code == 2 and f"run {running.run_id} is running" in refused.output
    running.stop()
    with pytest.raises(NotFinished, match="can be resumed"):
        collect(ledger, running.run_id)
    assert len(running.outbox()) > 0  # nothing went
    unknown = cli(url, "gc", "999")
    assert unknown.exit_code == 2 and "there is no run 999" in unknown.output


def test_gc_removes_a_finished_runs_stored_payloads(migrated) -> None:
    """The claim check's files (`<run_dir>/payloads`) are the same data as `groups.rollout`:
    gc removes the store, and `refill check` still holds on the finished run."""
    from refill.models.payload_store import FileStore

    url, ledger = migrated
    d = finished_run(ledger)
    store = FileStore.of_run(d.run().run_dir)
    for attempt_id in [g.attempt_id for g in d.groups()][:2]:
        store.put(attempt_id, b"stored payload of attempt %d" % attempt_id)
    planned = {g.kind: g for g in ledger.transaction(lambda s: measure(s, d.run_id))}
    assert (planned["stored payloads"].rows, planned["stored payloads"].bytes > 0) == (2, True)
    dry = cli(url, "gc", str(d.run_id))
    assert "would remove 2 stored payloads" in dry.stdout and store.root.exists()

    removed = {g.kind: g.rows for g in collect(ledger, d.run_id)}
    assert removed["stored payloads"] == 2 and not store.root.exists()
    check = cli(url, "check", str(d.run_id))
    assert check.exit_code == 0, check.stdout
