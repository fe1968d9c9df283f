"""`refill exporter`: serve the ledger's state and the broker's queue depths to Prometheus
(the collector and its statements are in refill.admin.exporter, imported when the command runs)."""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer

from refill.admin.console import EXIT_BAD_INPUT, fail, note, redact_url

DEFAULT_PORT = 9808
#: Runs that ended this long ago are still exported (their final values).
DEFAULT_RECENT_MINUTES = 60.0


def exporter(
    port: Annotated[int, typer.Option(help="Port to serve /metrics on.", min=1, max=65535)] = DEFAULT_PORT,
    address: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    database_url: Annotated[
        str | None, typer.Option("--database-url", help="Ledger URL (default: REFILL_DATABASE_URL).")
    ] = None,
    recent_minutes: Annotated[
        float, typer.Option(help="Also export runs that ended this many minutes ago.", min=0)
    ] = DEFAULT_RECENT_MINUTES,
) -> None:
    """Serve the ledger's state and the broker's queue depths as Prometheus metrics on /metrics
    (per run: open slots, live attempts, spare pool, zero-variance fraction, budget risk, steps
    trained, results recorded and rejected, weight version; per queue: its length). The broker
    is REFILL_BROKER_URL (and REFILL_BROKER_PREFIX); without one, no queue metrics."""
    try:
        from prometheus_client import start_http_server
    except ImportError:
        fail("the exporter needs prometheus-client: pip install 'refill[prometheus]'", EXIT_BAD_INPUT)
    from refill.admin.exporter import BrokerQueues, LedgerCollector, registry_for
    from refill.admin.ledger_access import open_ledger

    ledger = open_ledger(database_url)
    broker_url = os.environ.get("REFILL_BROKER_URL")
    broker = None
    if broker_url and not broker_url.startswith("memory://"):
        broker = BrokerQueues(broker_url)
    else:
        note("no REFILL_BROKER_URL: exporting the ledger only (no refill_queue_length)")
    registry = registry_for(LedgerCollector(ledger, broker, recent_minutes))
    try:
        start_http_server(port, addr=address, registry=registry)
    except OSError as error:
        fail(f"cannot listen on {address}:{port}: {error}", EXIT_BAD_INPUT)
    broker_note = f", broker {redact_url(broker_url)}" if broker is not None else ""
    note(f"serving http://{address}:{port}/metrics from ledger {redact_url(ledger.url)}{broker_note}")
    while True:
        time.sleep(3600)
