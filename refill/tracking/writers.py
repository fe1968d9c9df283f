"""One writer per experiment tracker. Each imports its library only when it is opened, so a run
that enables none (and every worker) never loads them.

A writer is opened with the last step the ledger says it was given and answers the last step
it already holds, which can be later when a controller died between logging a step and
recording that it did: MLflow and an online W&B run are asked, and TensorBoard marks the
restart so that its readers drop whatever a dead controller wrote past the ledger's mark
(a `SessionLog.START` event, the way TensorBoard's own writers purge orphaned steps).
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from refill.config import RunConfig
from refill.tracking.params import flat_params

#: Each tracker's config key, the module it needs and the extra that installs it.
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
#: A metric every step has (never None), whose history tells MLflow's last logged step.
ALWAYS_LOGGED = "trained_groups"
#: MLflow refuses longer parameter values.
MLFLOW_PARAM_CHARS = 6000


class TrackerUnavailable(RuntimeError):
    """A tracker the config enables cannot be used: its package is missing or it refused to
    open (no network, no credentials). The controller says so and tries again later."""


@dataclass(frozen=True)
class RunIdentity:
    run_id: int
    name: str
    #: Names the run in the trackers, unique across ledgers (two ledgers both have a run 1).
    key: str
    run_dir: str
    config: RunConfig
    #: The resolved config with its secrets hidden (refill.tracking.params).
    params: dict[str, Any]


def load_library(tracker: str) -> ModuleType:
    module, extra = TRACKERS[tracker]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise TrackerUnavailable(
            f"logging.{tracker}.enabled is true but {module} cannot be imported ({error}): "
            f"pip install 'refill[{extra}]'"
        ) from error


class Writer:
    name = ""

    def __init__(self, run: RunIdentity) -> None:
        self.run = run

    def open(self, last_step: int | None) -> int | None:
        raise NotImplementedError

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged durable before the ledger records it as logged."""

    def close(self, run_status: str | None) -> None:
        """`run_status` is the run's status when it ended, None when only this controller stops."""


class TensorBoardWriter(Writer):
    name = "tensorboard"

    def __init__(self, run: RunIdentity) -> None:
        super().__init__(run)
        self._writer: Any = None

    @property
    def logdir(self) -> Path:
        base = self.run.config.logging.tensorboard.dir
        if base is None:
            return Path(self.run.run_dir) / "tensorboard"
        return Path(base) / f"{self.run.name}-{self.run.run_id}"

    def open(self, last_step: int | None) -> int | None:
        load_library(self.name)
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(self.logdir), flush_secs=30)
        if last_step is None:
            self._writer.add_event(Event(wall_time=time.time(), step=0, summary=self._config_summary()))
        else:
            # Readers (TensorBoard, EventAccumulator) drop the steps from here on that an
            # earlier writer of this directory logged: those a dead controller wrote before
            # the ledger recorded them, which are logged again now.
            self._writer.add_event(
                Event(wall_time=time.time(), step=last_step + 1, session_log=SessionLog(status=SessionLog.START))
            )
        self._writer.flush()
        return last_step

    def _config_summary(self) -> Any:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING
        from tensorboard.plugins.text.metadata import create_summary_metadata

        rows = "\n".join(f"| {key} | `{value}` |" for key, value in flat_params(self.run.params).items())
        text = f"| parameter | value |\n| --- | --- |\n{rows}"
        tensor = TensorProto(dtype=DT_STRING, string_val=[text.encode()], tensor_shape=TensorShapeProto())
        metadata = create_summary_metadata(display_name="config", description="the run's resolved config")
        return Summary(value=[Summary.Value(tag="config", tensor=tensor, metadata=metadata)])

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=value) for key, value in metrics.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self, run_status: str | None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbWriter(Writer):
    name = "wandb"

    def __init__(self, run: RunIdentity) -> None:
        super().__init__(run)
        self._run: Any = None

    def open(self, last_step: int | None) -> int | None:
        wandb = load_library(self.name)
        settings = self.run.config.logging.wandb
        try:
            self._run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                mode=settings.mode,
                # The same id after a crash: W&B resumes the run instead of starting another.
                id=self.run.key,
                resume="allow",
                name=self.run.name,
                config=self.run.params,
                # WANDB_DIR wins, else the run directory (beside its checkpoints). Read here and
                # passed on: wandb reads the environment once per process.
                dir=os.environ.get("WANDB_DIR") or self.run.run_dir,
                # Tests (and the embedded runner) may drive several runs in one process.
                reinit="create_new",
            )
        except Exception as error:  # noqa: BLE001 - no network, no API key: retried later
            raise TrackerUnavailable(f"wandb.init failed: {error}") from error
        # A resumed online run knows its last step; W&B numbers the next one run.step.
        held = int(self._run.step) - 1 if int(self._run.step or 0) > 0 else None
        return max((s for s in (last_step, held) if s is not None), default=None)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self, run_status: str | None) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if run_status == "failed" else 0)
            self._run = None


class MlflowWriter(Writer):
    name = "mlflow"
    #: How a refill run's end reads in MLflow.
    END_STATUS = {"completed": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}

    def __init__(self, run: RunIdentity) -> None:
        super().__init__(run)
        self._client: Any = None
        self._run_id: str | None = None

    def open(self, last_step: int | None) -> int | None:
        load_library(self.name)
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        settings = self.run.config.logging.mlflow
        try:
            self._client = MlflowClient(tracking_uri=settings.tracking_uri)
            experiment_id = self._experiment_id(settings.experiment)
            found = self._client.search_runs(
                [experiment_id], filter_string=f"tags.`refill.run_key` = '{self.run.key}'", max_results=1
            )
            if found:
                self._run_id = found[0].info.run_id
            else:
                self._run_id = self._client.create_run(
                    experiment_id,
                    run_name=self.run.name,
                    tags={"refill.run_key": self.run.key, "refill.run_id": str(self.run.run_id)},
                ).info.run_id
                params = [
                    Param(key, str(value)[:MLFLOW_PARAM_CHARS])
                    for key, value in flat_params(self.run.params).items()
                ]
                for start in range(0, len(params), 100):  # MLflow takes 100 params per batch
                    self._client.log_batch(self._run_id, params=params[start : start + 100])
            history = self._client.get_metric_history(self._run_id, ALWAYS_LOGGED)
        except MlflowException as error:
            raise TrackerUnavailable(f"MLflow refused: {error}") from error
        held = max((m.step for m in history), default=None)
        return max((s for s in (last_step, held) if s is not None), default=None)

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(self._client.create_experiment(name))
        except MlflowException:
            # Another process created it meanwhile.
            experiment = self._client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        self._client.log_batch(self._run_id, metrics=batch)

    def close(self, run_status: str | None) -> None:
        if self._run_id is not None and run_status in self.END_STATUS:
            self._client.set_terminated(self._run_id, self.END_STATUS[run_status])
        self._run_id = None


WRITERS: dict[str, type[Writer]] = {
    "tensorboard": TensorBoardWriter,
    "wandb": WandbWriter,
    "mlflow": MlflowWriter,
}


def enabled_writers(run: RunIdentity) -> list[Writer]:
    logging = run.config.logging
    return [cls(run) for name, cls in WRITERS.items() if getattr(logging, name).enabled]
