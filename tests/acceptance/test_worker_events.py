"""Celery task events (issue 19): what Flower shows. A real `refill worker control` sends task
events with `--events` or REFILL_WORKER_EVENTS=1, and none without; read with Celery's own
event receiver on the test session's Redis."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from typer.testing import CliRunner

from refill.admin.cli import app as cli_app
from refill.models.migrate import upgrade
from refill.tasks.queues import CONTROL, TASK_DRIVE_RUN
from tests.support.databases import temporary_pg_database
from tests.support.fleet import Fleet, purge_prefix


@pytest.fixture(scope="module")
def events_fleet(tmp_path_factory) -> Iterator[Fleet]:
    with temporary_pg_database("refill_events") as url:
        upgrade(url)
        fleet = Fleet(url, tmp_path_factory.mktemp("events"))
        try:
            yield fleet
        finally:
            purge_prefix(fleet.prefix, fleet.redis_url)


@contextmanager
def control_worker(fleet: Fleet, name: str, *, flag: bool = False, env: dict[str, str] | None = None) -> Iterator[None]:
    argv = [sys.executable, "-m", "refill.admin.cli", "worker", "control", "--hostname", f"{name}@test"]
    if flag:
        argv.append("--events")
    log = fleet.workdir / f"worker-{name}.log"
    process = subprocess.Popen(
        argv, env={**fleet.env, **(env or {})}, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=fleet.workdir
    )
    fleet.workers[name], fleet.logs[name] = process, log
    try:
        fleet.wait_ready(name, 60)
        yield
    finally:
        fleet.kill(name, sig=15)


@contextmanager
def event_tap(fleet: Fleet) -> Iterator[list[dict[str, Any]]]:
    """Every event on the fleet's broker while inside, from once a worker's heartbeat (always
    sent) shows the receiver is subscribed."""
    app = fleet.app
    events: list[dict[str, Any]] = []
    seen_worker = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        if event.get("type", "").startswith("worker-"):
            seen_worker.set()

    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": on_event})
        # wakeup: workers answer with a heartbeat at once instead of within 2 s.
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=True), daemon=True)
        thread.start()
        try:
            assert seen_worker.wait(30), "no worker event: the receiver is not subscribed"
            yield events
        finally:
            receiver.should_stop = True
            thread.join(10)


def run_one_task(fleet: Fleet, worker: str) -> str:
    """A drive message for a run that does not exist: the control worker takes it and ends it."""
    task_id = str(uuid.uuid4())
    fleet.app.send_task(
        TASK_DRIVE_RUN,
        args=[{"run_id": 987654, "controller": "events-test"}],
        queue=CONTROL, routing_key=CONTROL, serializer="json", task_id=task_id,
    )
    deadline = time.monotonic() + 30
    while f"[{task_id}]" not in fleet.log(worker) or not any(
        f"[{task_id}] {word}" in fleet.log(worker) for word in ("succeeded", "raised")
    ):
        assert time.monotonic() < deadline, fleet.log(worker)[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # events are published before the log line; let the receiver drain them
    return task_id


def task_events(events: list[dict[str, Any]], task_id: str) -> set[str]:
    return {e["type"] for e in events if e.get("uuid") == task_id}


def test_no_task_events_by_default(events_fleet) -> None:
    with control_worker(events_fleet, "quiet"), event_tap(events_fleet) as events:
        task_id = run_one_task(events_fleet, "quiet")
        assert task_events(events, task_id) == set()
        assert any(e["type"] == "worker-heartbeat" for e in events)


@pytest.mark.parametrize("how", ["--events", "REFILL_WORKER_EVENTS=1"])
def test_events_make_the_workers_tasks_visible(events_fleet, how) -> None:
    name = "flag" if how == "--events" else "env"
    with control_worker(events_fleet, name, flag=how == "--events", env={"REFILL_WORKER_EVENTS": "1"} if how != "--events" else None):
        assert "task events on" in events_fleet.log(name)
        with event_tap(events_fleet) as events:
            task_id = run_one_task(events_fleet, name)
            seen = task_events(events, task_id)
    assert {"task-received", "task-started"} <= seen
    assert seen & {"task-succeeded", "task-failed"}, seen
    assert all(e["hostname"] == f"{name}@test" for e in events if e.get("uuid") == task_id)


def test_a_wrong_events_variable_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("REFILL_BROKER_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("REFILL_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1/none")
    monkeypatch.setenv("REFILL_WORKER_EVENTS", "maybe")
    result = CliRunner().invoke(cli_app, ["worker", "control"])
    assert result.exit_code == 2
    assert "REFILL_WORKER_EVENTS='maybe': set it to 1 (task events on) or 0 (off)" in result.output
