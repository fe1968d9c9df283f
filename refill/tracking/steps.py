"""The controller's side of the trackers: which trained steps to log, and the ledger's record of
the last step each tracker was given.

Order of a sync: read the trained steps past the lowest mark, give each tracker the steps past
its own mark, flush it, then record the new marks in one ledger write guarded by the
controller's ownership of the run. A tracker is never ahead of what it was given, and the
ledger is never ahead of a tracker: a crash between the two leaves steps the tracker holds
and the ledger does not, which the next controller's writer recognises when it opens
(refill.tracking.writers). A tracker that fails is closed and reopened later from its own
mark while the others go on.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from sqlalchemy import select, update

from refill.admin.progress_queries import metrics_dict
from refill.config import from_snapshot
from refill.models.db import Ledger
from refill.models.tables import Run, Step, StepMetrics, StepStatus
from refill.tracking.params import redacted
from refill.tracking.writers import RunIdentity, TrackerUnavailable, Writer, enabled_writers

log = logging.getLogger(__name__)

#: Steps read (and logged) per sync at most: a controller that takes over a long run whose
#: trackers were off catches up over a few housekeeping passes.
STEPS_PER_SYNC = 200
#: Seconds before a tracker that failed is opened again.
RETRY_SECONDS = 60.0


def run_key(run: Run) -> str:
    """The run's name in the trackers: its id and creation time (two ledgers both have a run 1)."""
    return f"refill-{run.id}-{run.created_at:%Y%m%d%H%M%S}"


def step_values(row: StepMetrics) -> dict[str, float]:
    """Every metric of a step (the step_metrics columns and the trainer's extras) that has a
    number; a missing one (a reward before training, a KL the loss does not compute) is left
    out rather than logged as 0."""
    out: dict[str, float] = {}
    for key, value in metrics_dict(row).items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class StepTracking:
    """Logs a run's trained steps to the trackers its config enables (None: it enables none)."""

    def __init__(self, ledger: Ledger, run: RunIdentity, controller_id: str, marks: dict[str, int]) -> None:
        self.ledger = ledger
        self.run = run
        self.controller_id = controller_id
        self.marks = dict(marks)
        self.pending = enabled_writers(run)
        self.open: dict[str, Writer] = {}
        self._retry_at: dict[str, float] = {}
        self.lost = False

    @classmethod
    def for_run(cls, ledger: Ledger, run_id: int, controller_id: str) -> StepTracking | None:
        def read(session: Any) -> tuple[RunIdentity, dict[str, int]] | None:
            run = session.get(Run, run_id)
            config = from_snapshot(run.config, source=f"run {run_id}'s stored config")
            if not any(getattr(config.logging, name).enabled for name in ("tensorboard", "wandb", "mlflow")):
                return None
            identity = RunIdentity(
                run_id=run.id,
                name=run.name,
                key=run_key(run),
                run_dir=run.run_dir,
                config=config,
                params=redacted(run.config),
            )
            return identity, {str(k): int(v) for k, v in (run.tracked_steps or {}).items()}

        found = ledger.transaction(read, what="read the run's trackers")
        if found is None:
            return None
        return cls(ledger, found[0], controller_id, found[1])

    def sync(self) -> int:
        """Log the steps trained since the last sync; returns how many tracker-steps were logged."""
        if self.lost:
            return 0
        self._open_due()
        if not self.open:
            return 0
        since = min(self.marks.get(name, -1) for name in self.open)
        rows = self.ledger.transaction(lambda s: self._trained_after(s, since), what="read trained steps")
        logged = 0
        advanced: dict[str, int] = {}
        for name, writer in list(self.open.items()):
            mark = self.marks.get(name, -1)
            todo = [(step, values) for step, values in rows if step > mark]
            if not todo:
                continue
            try:
                for step, values in todo:
                    writer.log_step(step, values)
                writer.flush()
            except Exception as error:  # noqa: BLE001 - one tracker's failure must not stop the run
                self._failed(name, writer, f"logging step {todo[0][0]}..{todo[-1][0]} failed: {error}")
                continue
            advanced[name] = todo[-1][0]
            logged += len(todo)
        if advanced:
            self._record({**self.marks, **advanced})
        return logged

    def finish(self, run_status: str) -> None:
        """The run ended (`run_status`): log what every tracker still lacks, then close them.

        A tracker that failed during the run is opened once more at once, not after its retry
        wait: nothing syncs after this, so its last steps would otherwise never reach it. One
        that still fails is named with the steps it lacks (the ledger keeps its mark)."""
        self._retry_at.clear()
        while self.sync():
            pass  # each sync logs at most STEPS_PER_SYNC steps
        if not self.lost:
            for writer in self.pending:
                log.error(
                    "run %s ended %s; experiment tracker %s could not be reached and lacks the steps after %s",
                    self.run.run_id, run_status, writer.name, self.marks.get(writer.name, "none"),
                )
        self.close(run_status)

    def close(self, run_status: str | None = None) -> None:
        """Close the open trackers; `run_status` is the status the run ended with, None when
        only this controller stops (its slice is over, or it lost the run)."""
        for name, writer in list(self.open.items()):
            try:
                writer.close(run_status)
            except Exception as error:  # noqa: BLE001 - closing is best effort, the ledger has the marks
                log.warning("run %s: closing %s failed: %s", self.run.run_id, name, error)
        self.pending.extend(self.open.values())
        self.open.clear()

    # --------------------------------------------------------------------------------------

    def _open_due(self) -> None:
        now = time.monotonic()
        for writer in list(self.pending):
            if self._retry_at.get(writer.name, 0.0) > now:
                continue
            self.pending.remove(writer)
            mark = self.marks.get(writer.name)
            try:
                held = writer.open(mark)
            except TrackerUnavailable as error:
                self._failed(writer.name, writer, str(error))
                continue
            except Exception as error:  # noqa: BLE001 - a tracker's own failure, retried later
                self._failed(writer.name, writer, f"opening failed: {error!r}")
                continue
            if held is not None and (mark is None or held > mark):
                log.warning(
                    "run %s: %s already holds steps up to %d (the ledger said %s): going on after it",
                    self.run.run_id, writer.name, held, mark,
                )
                self.marks[writer.name] = held
            self.open[writer.name] = writer

    def _failed(self, name: str, writer: Writer, message: str) -> None:
        log.error(
            "run %s: experiment tracker %s: %s; trying again in %.0fs (steps wait, none is skipped)",
            self.run.run_id, name, message, RETRY_SECONDS,
        )
        self.open.pop(name, None)
        try:
            writer.close(None)
        except Exception as error:  # noqa: BLE001 - already failing; say so and drop it
            log.warning("run %s: closing %s after its failure failed too: %s", self.run.run_id, name, error)
        self._retry_at[name] = time.monotonic() + RETRY_SECONDS
        if writer not in self.pending:
            self.pending.append(writer)

    def _trained_after(self, session: Any, since: int) -> list[tuple[int, dict[str, float]]]:
        rows = session.execute(
            select(Step.step, StepMetrics)
            .outerjoin(StepMetrics, (StepMetrics.run_id == Step.run_id) & (StepMetrics.step == Step.step))
            .where(Step.run_id == self.run.run_id, Step.step > since, Step.status == StepStatus.TRAINED.value)
            .order_by(Step.step)
            .limit(STEPS_PER_SYNC)
        ).all()
        out: list[tuple[int, dict[str, float]]] = []
        for step, metrics in rows:
            # Steps are trained in order; a gap would be a step still training, logged later.
            if step != since + 1 + len(out):
                break
            out.append((int(step), step_values(metrics) if metrics is not None else {}))
        return out

    def _record(self, marks: dict[str, int]) -> None:
        def write(session: Any) -> int:
            return session.execute(
                update(Run)
                .where(Run.id == self.run.run_id, Run.controller_id == self.controller_id[:200])
                .values(tracked_steps=marks)
                .execution_options(synchronize_session=False)
            ).rowcount

        if self.ledger.transaction(write, what="record the trackers' steps"):
            self.marks = marks
            return
        # Another controller took the run over: it logs from the ledger's marks, so this one
        # stops (what it just logged is recognised by the next writer that opens).
        log.warning("run %s: another controller drives it now; this one stops logging to trackers", self.run.run_id)
        self.lost = True
        self.close(None)
