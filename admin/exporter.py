"""`refill exporter`: the ledger's state and the broker's queue depths as Prometheus metrics.

A custom collector queries on each scrape (nothing is cached between scrapes, so a scrape is
never stale and an idle exporter costs nothing). Each scrape is a handful of statements,
whatever the size of the ledger: the runs' own counters (`runs.scored_groups`,
`spare_prompts_available`, `weight_version`, ...), counts over partial indexes that hold only
the live rows (`ix_slots_open`, `ix_attempts_live_step`), the newest step_metrics row by its
primary key, and the rejected results through their (run_id, ...) index; no statement reads a
run's history. The runs exported are those running and those that ended in the last
`--recent-minutes` (so a dashboard shows how a run ended), each with a `run` label.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, func, or_, select, text
from sqlalchemy.orm import Session

from refill.admin.console import redact_url
from refill.models.clock import ledger_now
from refill.models.db import Ledger
from refill.models.tables import Attempt, RejectedResult, Run, RunStatus, Slot, StepMetrics
from refill.tasks.queues import QUEUES

log = logging.getLogger(__name__)

#: A scrape must not hang on a broker that does not answer.
BROKER_TIMEOUT_SECONDS = 5.0

# The predicates of the partial indexes, spelled as literals: PostgreSQL uses a partial index
# only when it can prove the query's condition implies the index's.
OPEN_SLOT = text("slots.status = 'open'")
LIVE_ATTEMPT = text("attempts.state IN ('pending', 'queued', 'running')")


# --- the statements (tests/acceptance/test_exporter.py checks their plans) ---------------------


def runs_query(since: datetime) -> Select[Any]:
    """The runs running and those that ended at `since` or after (the ledger's clock)."""
    return select(
        Run.id, Run.name, Run.status, Run.spare_prompts_available, Run.scored_groups,
        Run.zero_variance_groups, Run.weight_version,
    ).where(or_(Run.status == RunStatus.RUNNING.value, Run.finished_at >= since)).order_by(Run.id)


def open_slots_query(run_ids: list[int]) -> Select[Any]:
    return select(Slot.run_id, func.count()).where(Slot.run_id.in_(run_ids), OPEN_SLOT).group_by(Slot.run_id)


def live_attempts_query(run_ids: list[int]) -> Select[Any]:
    return (
        select(Attempt.run_id, func.count()).where(Attempt.run_id.in_(run_ids), LIVE_ATTEMPT).group_by(Attempt.run_id)
    )


def rejected_query(run_ids: list[int]) -> Select[Any]:
    return (
        select(RejectedResult.run_id, RejectedResult.reason, func.count())
        .where(RejectedResult.run_id.in_(run_ids))
        .group_by(RejectedResult.run_id, RejectedResult.reason)
    )


def latest_risk_query(run_id: int) -> Select[Any]:
    return (
        select(StepMetrics.budget_exhaustion_risk)
        .where(StepMetrics.run_id == run_id)
        .order_by(StepMetrics.step.desc())
        .limit(1)
    )


@dataclass
class RunState:
    run_id: int
    name: str
    status: str
    spare_pool: int
    scored: int
    zero_variance: int
    weight_version: int
    open_slots: int = 0
    live_attempts: int = 0
    risk: float | None = None


def read_ledger(ledger: Ledger, recent_minutes: float) -> tuple[list[RunState], dict[tuple[int, str], int]]:
    """The exported runs and their rejected results by (run, reason), in one read transaction,
    run once more if its connection dropped under it (a database restart mid-read)."""
    return ledger.transaction(lambda session: _read_ledger(session, recent_minutes), attempts=2, what="exporter read")


def _read_ledger(session: Session, recent_minutes: float) -> tuple[list[RunState], dict[tuple[int, str], int]]:
    # On the ledger's clock, which wrote `finished_at`: an exporter on a host whose clock is
    # off would otherwise drop a run that just ended, or keep one that ended hours ago.
    since = ledger_now(session) - timedelta(minutes=recent_minutes)
    runs = {
        row.id: RunState(
            row.id, row.name, row.status, int(row.spare_prompts_available or 0), int(row.scored_groups or 0),
            int(row.zero_variance_groups or 0), int(row.weight_version or 0),
        )
        for row in session.execute(runs_query(since))
    }
    ids = list(runs)
    rejected: dict[tuple[int, str], int] = {}
    if ids:
        for run_id, count in session.execute(open_slots_query(ids)):
            runs[run_id].open_slots = int(count)
        for run_id, count in session.execute(live_attempts_query(ids)):
            runs[run_id].live_attempts = int(count)
        for run_id, reason, count in session.execute(rejected_query(ids)):
            rejected[(int(run_id), str(reason))] = int(count)
        for run_id, state in runs.items():
            risk = session.scalar(latest_risk_query(run_id))
            state.risk = float(risk) if risk is not None else None
    return list(runs.values()), rejected


class BrokerQueues:
    """The depth of each refill queue on the fleet's broker."""

    def __init__(self, broker_url: str, key_prefix: str | None = None) -> None:
        from refill.tasks.app import make_app

        self.app = make_app(broker_url, name="refill-exporter", key_prefix=key_prefix)
        options = dict(self.app.conf.broker_transport_options)
        options.update(socket_timeout=BROKER_TIMEOUT_SECONDS, socket_connect_timeout=BROKER_TIMEOUT_SECONDS)
        self.app.conf.broker_transport_options = options

    def lengths(self) -> dict[str, int]:
        with self.app.connection_for_read() as connection:
            connection.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT_SECONDS)
            channel = connection.default_channel
            # A declare is how kombu reports a queue's depth; on Redis it creates nothing.
            return {
                name: int(channel.queue_declare(queue=name, durable=True, auto_delete=False).message_count)
                for name in QUEUES
            }


class LedgerCollector:
    """prometheus_client's custom-collector interface: `collect` runs on every scrape."""

    def __init__(self, ledger: Ledger, broker: BrokerQueues | None, recent_minutes: float) -> None:
        self.ledger = ledger
        self.broker = broker
        self.recent_minutes = recent_minutes

    def describe(self) -> Iterable[Any]:
        # Nothing to describe up front: registering must not query the ledger.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        started = time.monotonic()
        ledger_up = GaugeMetricFamily("refill_ledger_up", "1 if the last scrape could read the ledger")
        try:
            runs, rejected = read_ledger(self.ledger, self.recent_minutes)
        except Exception as error:  # noqa: BLE001 - a scrape reports the outage instead of failing
            log.warning("cannot read the ledger at %s: %s", redact_url(self.ledger.url), error)
            ledger_up.add_metric([], 0)
            runs, rejected = [], {}
        else:
            ledger_up.add_metric([], 1)
        yield ledger_up

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("run",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        info = gauge("refill_run_info", "1 per exported run, with its name and status", ("run", "name", "status"))
        open_slots = gauge("refill_open_slots", "Slots of admitted steps still waiting for a group")
        live = gauge("refill_live_attempts", "Attempts pending, queued or generating")
        spare = gauge("refill_spare_pool_size", "Untaken prompts in the spare pool")
        zero = gauge("refill_zero_variance_fraction", "Zero-variance groups over scored groups, whole run (p)")
        risk = gauge("refill_budget_exhaustion_risk", "Chance some slot exhausts its dynamic-sampling budget, as of the newest released step")
        version = gauge("refill_weight_version", "Newest published weight version")
        trained = CounterMetricFamily("refill_steps_trained", "Training steps trained", labels=["run"])
        recorded = CounterMetricFamily("refill_results_recorded", "Generation results scored and recorded (committed or filtered)", labels=["run"])
        rejects = CounterMetricFamily("refill_rejected_results", "Results that had no effect, by reason", labels=["run", "reason"])
        for run in runs:
            label = [str(run.run_id)]
            info.add_metric([str(run.run_id), run.name, run.status], 1)
            open_slots.add_metric(label, run.open_slots)
            live.add_metric(label, run.live_attempts)
            spare.add_metric(label, run.spare_pool)
            if run.scored:
                zero.add_metric(label, run.zero_variance / run.scored)
            if run.risk is not None:
                risk.add_metric(label, run.risk)
            version.add_metric(label, run.weight_version)
            # Version v is published when step v-1 is trained, and steps train in order.
            trained.add_metric(label, run.weight_version)
            recorded.add_metric(label, run.scored)
        for (run_id, reason), count in sorted(rejected.items()):
            rejects.add_metric([str(run_id), reason], count)
        yield from (info, open_slots, live, spare, zero, risk, version, trained, recorded, rejects)

        if self.broker is not None:
            broker_up = GaugeMetricFamily("refill_broker_up", "1 if the last scrape could read the broker's queues")
            queues = GaugeMetricFamily("refill_queue_length", "Messages waiting on a refill queue", labels=["queue"])
            try:
                lengths = self.broker.lengths()
            except Exception as error:  # noqa: BLE001 - a scrape reports the outage instead of failing
                log.warning("cannot read the broker's queues: %s", redact_url(str(error)))
                broker_up.add_metric([], 0)
            else:
                broker_up.add_metric([], 1)
                for name, length in lengths.items():
                    queues.add_metric([name], length)
            yield broker_up
            yield queues
        seconds = GaugeMetricFamily("refill_exporter_scrape_seconds", "How long this scrape took to read the ledger and the broker")
        seconds.add_metric([], time.monotonic() - started)
        yield seconds


def registry_for(collector: LedgerCollector) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
