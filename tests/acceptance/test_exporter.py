"""`refill exporter` (issue 19): Prometheus metrics of the ledger and the broker, scraped from a
real exporter process while a real fleet runs, and the statements behind them cheap on a large
ledger (each one has an index path on PostgreSQL)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from refill.admin import exporter
from refill.models.clock import utcnow
from refill.models.db import Ledger
from refill.models.tables import RejectedResult, Run
from refill.tasks.queues import QUEUES

PER_RUN = (
    "refill_open_slots",
    "refill_live_attempts",
    "refill_spare_pool_size",
    "refill_zero_variance_fraction",
    "refill_budget_exhaustion_risk",
    "refill_steps_trained_total",
    "refill_results_recorded_total",
    "refill_weight_version",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def samples(body: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def value(scraped: dict[str, Any], name: str, **labels: str) -> float | None:
    for got, number in scraped.get(name, []):
        if all(got.get(k) == v for k, v in labels.items()):
            return number
    return None


def scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples(response.read().decode())


def start_exporter(fleet: Any, port: int) -> subprocess.Popen[bytes]:
    log = (fleet.workdir / f"exporter-{port}.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "refill.admin.cli", "exporter", "--port", str(port), "--address", "127.0.0.1"],
        env=fleet.env, stdout=log, stderr=subprocess.STDOUT, cwd=fleet.workdir,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (fleet.workdir / f"exporter-{port}.log").read_text()
        try:
            scrape(port)
            return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise TimeoutError("the exporter did not serve within 60 s")


def test_the_exporter_serves_a_running_fleets_metrics(running_fleet, fleet_ledger) -> None:
    run_id = running_fleet.create_run(fleet_ledger, {"grpo": {"max_num_steps": 10}})
    port = free_port()
    process = start_exporter(running_fleet, port)
    during: list[dict[str, Any]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            during.append(scrape(port))
            time.sleep(0.25)

    poller = threading.Thread(target=poll, daemon=True)
    try:
        poller.start()
        assert running_fleet.drive(fleet_ledger, run_id) == "completed"
        stop.set()
        poller.join(30)
        # A rejected result, as the consumer records a duplicate.
        fleet_ledger.transaction(lambda s: s.add(RejectedResult(
            run_id=run_id, attempt_id=1, reason="duplicate", worker="test", detail="again",
            received_at=utcnow(),
        )))
        after = scrape(port)
    finally:
        stop.set()
        process.terminate()
        process.wait(20)
    label = str(run_id)

    # While the run ran: every per-run metric, with the run's label, and the queues' depths.
    running = [s for s in during if value(s, "refill_run_info", run=label, status="running") == 1]
    assert running, "no scrape saw the run running"
    for name in PER_RUN:
        assert any(value(s, name, run=label) is not None for s in running), name
    assert any((value(s, "refill_open_slots", run=label) or 0) > 0 for s in running)
    assert any((value(s, "refill_live_attempts", run=label) or 0) > 0 for s in running)
    for s in running:
        assert value(s, "refill_ledger_up") == 1 and value(s, "refill_broker_up") == 1
        assert {labels["queue"] for labels, _ in s["refill_queue_length"]} == set(QUEUES)
    trained = [value(s, "refill_steps_trained_total", run=label) for s in running]
    assert trained == sorted(trained), "a counter went down"

    # At the end, the numbers are the ledger's.
    with fleet_ledger.session() as session:
        run = session.get(Run, run_id)
        scored, zero, spare = run.scored_groups, run.zero_variance_groups, run.spare_prompts_available
    assert value(after, "refill_run_info", run=label, status="completed") == 1
    assert value(after, "refill_steps_trained_total", run=label) == 10
    assert value(after, "refill_weight_version", run=label) == 10
    assert value(after, "refill_results_recorded_total", run=label) == scored
    assert value(after, "refill_zero_variance_fraction", run=label) == pytest.approx(zero / scored)
    assert value(after, "refill_spare_pool_size", run=label) == spare
    assert value(after, "refill_open_slots", run=label) == 0
    assert value(after, "refill_live_attempts", run=label) == 0
    assert value(after, "refill_rejected_results_total", run=label, reason="duplicate") == 1


def test_a_scrape_reports_an_unreachable_broker_and_ledger_instead_of_failing(tmp_path) -> None:
    from refill.models.tables import Base

    ledger = Ledger(f"sqlite:///{tmp_path}/ledger.db")
    Base.metadata.create_all(ledger.engine)
    broker = exporter.BrokerQueues("redis://127.0.0.1:1/0")
    registry = exporter.registry_for(exporter.LedgerCollector(ledger, broker, recent_minutes=60))
    from prometheus_client import generate_latest

    scraped = samples(generate_latest(registry).decode())
    assert value(scraped, "refill_ledger_up") == 1
    assert value(scraped, "refill_broker_up") == 0
    assert "refill_queue_length" not in scraped
    ledger.dispose()
    down = Ledger(f"sqlite:///{tmp_path}/missing/dir/ledger.db")
    scraped = samples(generate_latest(exporter.registry_for(exporter.LedgerCollector(down, None, 60))).decode())
    assert value(scraped, "refill_ledger_up") == 0


def test_every_statement_of_a_scrape_has_an_index_path(fleet_ledger) -> None:
    """With sequential scans priced out, PostgreSQL still scans a table in full only where no
    index can serve the statement: none of a scrape's statements reads a run's history."""
    ids = [1, 2]
    statements = {
        "open slots": exporter.open_slots_query(ids),
        "live attempts": exporter.live_attempts_query(ids),
        "rejected results": exporter.rejected_query(ids),
        "budget risk": exporter.latest_risk_query(1),
    }
    engine = fleet_ledger.engine
    with engine.connect() as connection:
        connection.execute(text("SET enable_seqscan = off"))
        for what, statement in statements.items():
            sql = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))
            plan = "\n".join(row[0] for row in connection.execute(text(f"EXPLAIN {sql}")))
            assert "Seq Scan" not in plan, f"{what}:\n{plan}"
