"""Experiment trackers: each trained step's metrics in TensorBoard, Weights & Biases or MLflow.

The run's controller logs them (`StepTracking`, called from its housekeeping): it is the one
process that drives a run at a time (the ledger hands the run over explicitly), it already
reads the ledger every second, and it outlives no run, so no second process has to be run or
kept in agreement. The last step each tracker was given is kept in the ledger
(`runs.tracked_steps`): a controller that takes over after a crash (`refill run resume`, a
detached controller's next slice) goes on from there.

Each tracker is optional, behind its own extra (`pip install 'refill[tensorboard]'`, `[wandb]`,
`[mlflow]`), and imported only when the run's config enables it. The modules: `steps` (what to
log and the ledger's marks), `writers` (one class per tracker), `params` (the config as
parameters, secrets hidden).
"""

from __future__ import annotations

from refill.tracking.steps import StepTracking
from refill.tracking.writers import TRACKERS, TrackerUnavailable

__all__ = ["TRACKERS", "StepTracking", "TrackerUnavailable"]
