"""The controller: the loop that keeps a run moving and ends it.

Most of a run's progress happens without it: the consumer relays the replacements it
decides, the trainer admits the steps its new weights unlock. The controller is the safety
net and the clock: it admits steps, relays whatever is still due (attempts and train_step rows
whose immediate relay failed, retries whose back-off has passed), reaps expired leases, notices
the end of the run, applies a requested stop, and reports progress.

It runs in the foreground of `refill run start|resume`, or detached on a `control` worker as
a chain of time slices (`refill.drive_run`): each slice hands over to the next through the
ledger, so a repeated message finds its slice already taken and stops, and a control worker
that dies mid-slice leaves the run to the next `refill run resume` or the redelivered slice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError as BrokerUnreachable
from sqlalchemy.exc import DBAPIError, OperationalError

from refill.admin.progress_queries import RunProgress, run_progress
from refill.config import InfraConfig, from_snapshot
from refill.models.admission import admit_steps
from refill.models.db import Ledger
from refill.models.leases import expire_leases
from refill.models.payload_store import PayloadKeeper
from refill.models.runs import (
    RunStateError,
    check_run,
    controller_heartbeat,
    start_run,
    stop_run,
)
from refill.models.tables import RunStatus
from refill.tasks.outage import OutageClock, is_outage
from refill.tasks.queues import CONTROL, TASK_DRIVE_RUN
from refill.tasks.relay import relay
from refill.tracking import StepTracking

log = logging.getLogger(__name__)

SLICE_SECONDS = 60.0
#: warn when a run's chance of failing on its dynamic-sampling budget reaches this
BUDGET_RISK_WARNING = 0.01


def new_controller_id(prefix: str = "controller") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Controller:
    def __init__(
        self,
        ledger: Ledger,
        app: Celery,
        run_id: int,
        controller_id: str | None = None,
    ) -> None:
        self.ledger = ledger
        self.app = app
        self.run_id = run_id
        self.controller_id = controller_id or new_controller_id()
        # The schema's defaults until `start` reads the run's own config.
        self._set_intervals(InfraConfig())
        self._last_housekeeping = 0.0
        self._broker_down_since: float | None = None
        self._risk_warned_step: int | None = None
        self._broker_warned = 0.0
        # Sweeps the run's stored payloads and applies their retention (None: results inline).
        self._payloads: PayloadKeeper | None = None
        # The experiment trackers the run's config enables (None: none). The controller logs
        # to them because one controller at a time drives a run (refill.tracking).
        self.tracking: StepTracking | None = None
        self._ledger = OutageClock()

    def start(
        self,
        *,
        previous_controller: str | None = None,
        takeover_after_seconds: float = 30.0,
        created_only: bool = False,
    ) -> None:
        """Take control of the run (resuming it if it was stopped or its controller died,
        unless `created_only`: see `start_run`)."""
        run = self.ledger.transaction(
            lambda s: start_run(
                s,
                self.run_id,
                self.controller_id,
                takeover_after_seconds=takeover_after_seconds,
                previous_controller=previous_controller,
                created_only=created_only,
            ),
            what="start run",
        )
        config = from_snapshot(run.config, source=f"run {self.run_id}'s stored config")
        self._set_intervals(config.infra)
        self._payloads = PayloadKeeper.for_run(self.ledger, run, config)
        self.tracking = StepTracking.for_run(self.ledger, self.run_id, self.controller_id)

    def _set_intervals(self, infra: InfraConfig) -> None:
        self.relay_interval = infra.relay_interval_seconds
        self.housekeeping_interval = infra.reaper_interval_seconds

    def tick(self) -> str:
        """One pass of the loop; returns the run's status."""
        now = time.monotonic()
        if now - self._last_housekeeping >= self.housekeeping_interval:
            self._last_housekeeping = now
            status = self._housekeeping()
            if self._payloads is not None:
                self._payloads.after_housekeeping(status)
            self._track(status)
            if status != RunStatus.RUNNING.value:
                return status
        try:
            relay(self.ledger, self.app, claimer=self.controller_id, run_id=self.run_id)
        except BrokerUnreachable as error:
            # Redis is down or restarting: what was due stays due (the relay's transaction
            # rolled back) and goes out once it is back. The controller must outlive the outage.
            if self._broker_down_since is None:
                self._broker_down_since = now
            if now - self._broker_warned >= 10.0:
                self._broker_warned = now
                log.warning("run %s: cannot reach the broker (%s); its messages wait in the ledger", self.run_id, error)
        else:
            if self._broker_down_since is not None:
                log.warning(
                    "run %s: the broker is back after %.0fs", self.run_id, now - self._broker_down_since
                )
                self._broker_down_since = None
        return RunStatus.RUNNING.value

    def _housekeeping(self) -> str:
        run = self.ledger.transaction(
            lambda s: controller_heartbeat(s, self.run_id, self.controller_id), what="controller heartbeat"
        )
        if run.status != RunStatus.RUNNING.value:
            return run.status
        if run.stop_requested:
            cancelled = self.ledger.transaction(lambda s: stop_run(s, self.run_id), what="stop run")
            log.info("run %s stopped; %d attempts in flight cancelled", self.run_id, cancelled)
            return RunStatus.STOPPED.value
        self.ledger.transaction(lambda s: admit_steps(s, self.run_id), what="admit steps")
        # After an outage the leases nobody could renew get a whole lease before they are judged.
        reachable_for = self._ledger.reachable_for()
        reaped = self.ledger.transaction(
            lambda s: expire_leases(s, self.run_id, reachable_for=reachable_for), what="reap leases"
        )
        if reaped.attempts or reaped.train_steps:
            log.warning(
                "run %s: %d generation leases and %d training leases expired",
                self.run_id,
                reaped.attempts,
                reaped.train_steps,
            )
        self._warn_budget_risk()
        return self.ledger.transaction(lambda s: check_run(s, self.run_id), what="check run")

    def _track(self, status: str) -> None:
        if self.tracking is None:
            return
        if status == RunStatus.RUNNING.value:
            self.tracking.sync()
            return
        # Also once the run has ended: its last step is trained in the trainer's transaction
        # that completes the run.
        self.tracking.finish(status)
        self.tracking = None

    def stop_tracking(self) -> None:
        """Close the trackers while the run goes on (a detached controller's slice is over)."""
        if self.tracking is not None:
            self.tracking.close(None)
            self.tracking = None

    def _warn_budget_risk(self) -> None:
        """Say so while the run is healthy if its dynamic-sampling budget is likely to run out
        (the reference only found out when a slot exhausted it)."""
        from refill.admin.budget_queries import budget_risk

        risk = self.ledger.transaction(lambda s: budget_risk(s, self.run_id), what="read budget risk")
        if risk is None or risk.probability < BUDGET_RISK_WARNING or risk.step == self._risk_warned_step:
            return
        self._risk_warned_step = risk.step
        log.warning(
            "run %s: at the measured zero-variance fraction p=%.3f, some slot exhausts "
            "grpo.dynamic_sampling_max_replacements_per_slot=%d before the run ends with "
            "probability %.1f%% (expected exhausted slots %.3g); raise it to %d to bring that under 1%%",
            self.run_id,
            risk.p,
            risk.budget,
            100 * risk.probability,
            risk.expected_exhausted,
            risk.safe_budget,
        )

    def progress(self) -> RunProgress:
        return self.ledger.transaction(lambda s: run_progress(s, self.run_id), what="read progress")

    def run(
        self,
        *,
        on_progress: Callable[[RunProgress], Any] | None = None,
        progress_every: float = 0.5,
        max_seconds: float | None = None,
    ) -> str:
        """Loop until the run is no longer running (or `max_seconds` passed); returns its status."""
        started = time.monotonic()
        last_progress = 0.0
        status = RunStatus.RUNNING.value
        while True:
            try:
                status = self.tick()
                now = time.monotonic()
                if on_progress is not None and (status != RunStatus.RUNNING.value or now - last_progress >= progress_every):
                    last_progress = now
                    on_progress(self.progress())
            except (OperationalError, DBAPIError) as error:
                # The database is down or restarting: the run waits in the ledger, and the
                # controller must outlive the outage as it outlives the broker's.
                if not is_outage(error):
                    raise
                self._ledger.down(error, f"run {self.run_id}")
                status, now = RunStatus.RUNNING.value, time.monotonic()
            else:
                self._ledger.up(f"run {self.run_id}")
            if status != RunStatus.RUNNING.value:
                return status
            if max_seconds is not None and now - started >= max_seconds:
                return status
            time.sleep(self.relay_interval)


def drive_slice(runtime: Any, body: dict[str, Any]) -> str:
    """One slice of a detached controller (the `refill.drive_run` task)."""
    run_id = int(body["run_id"])
    base = str(body["controller"])
    number = int(body.get("slice", 0))
    me = f"{base}#{number}"
    previous = f"{base}#{number - 1}" if number > 0 else None
    controller = Controller(runtime.ledger, runtime.app, run_id, me)
    try:
        # The first slice of `refill run start --detach` starts a new run; it never resumes one
        # that was stopped while this message waited for a control worker.
        controller.start(previous_controller=previous, created_only=bool(body.get("start_only")) and number == 0)
    except RunStateError as error:
        log.info("slice %s of run %s does not drive it: %s", me, run_id, error)
        return "not-mine"
    try:
        status = controller.run(max_seconds=float(body.get("slice_seconds", SLICE_SECONDS)))
    finally:
        controller.stop_tracking()
    if status == RunStatus.RUNNING.value:
        send_drive(runtime.app, run_id, base, number + 1, body.get("slice_seconds", SLICE_SECONDS))
        return "continued"
    return status


def send_drive(
    app: Celery,
    run_id: int,
    controller: str,
    number: int = 0,
    slice_seconds: float = SLICE_SECONDS,
    *,
    start_only: bool = False,
) -> None:
    """Hand the run to the control workers: slice `number` of controller `controller`.
    `start_only`: the run is new (`refill run start --detach`); its first slice does not
    resume it if it is stopped by then."""
    body = {"run_id": run_id, "controller": controller, "slice": number, "slice_seconds": slice_seconds}
    if start_only:
        body["start_only"] = True
    app.send_task(
        TASK_DRIVE_RUN,
        args=[body],
        queue=CONTROL,
        routing_key=CONTROL,
        serializer="json",
    )

