"""Experiment trackers (issue 19): each trained step's metrics reach TensorBoard, W&B and MLflow
once, at its step number, from the run's controller, also when another controller takes the run
over after a crash; read back from what each tracker wrote, with no server and no network."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import update

from refill.config import config_from_dict
from refill.models.tables import Run, StepMetrics
from refill.tasks.controller import Controller
from refill.tasks.embedded import embedded_fleet
from refill.tasks.setup import create_run_from_config
from refill.tracking import TrackerUnavailable, steps, writers
from tests.support.fleet import SIM_CONFIG, merged
from tests.support.trackers import (
    mlflow_run,
    tensorboard_scalars,
    tensorboard_text,
    wandb_config,
    wandb_history,
    wandb_run_files,
)

REPO = Path(__file__).resolve().parents[2]
SECRET = "sk-not-a-real-key-1234"
#: Every run's step_metrics columns that have a value on every trained step of a sim run.
ALWAYS = ("reward", "first_attempt_reward", "zero_variance_fraction", "trained_groups", "generated_tokens")


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B offline, silent and under tmp (it must never try the network); MLflow's file store
    allowed (MLflow 3 refuses it unless asked)."""
    (tmp_path / "wandb-dir").mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def sim_config(tmp_path: Path, steps: int, trackers: dict[str, Any], **overrides: Any) -> Any:
    logging = {
        "tensorboard": {"enabled": "tensorboard" in trackers},
        "wandb": {"enabled": "wandb" in trackers, "mode": "offline", "project": "refill-test"},
        "mlflow": {
            "enabled": "mlflow" in trackers,
            "tracking_uri": f"file://{tmp_path}/mlruns",
            "experiment": "refill-test",
        },
    }
    raw = merged(
        SIM_CONFIG,
        merged(
            {
                "run": {"output_dir": str(tmp_path / "runs")},
                "grpo": {"max_num_steps": steps},
                "reward": {"kwargs": {"api_key": SECRET}},
                "logging": logging,
            },
            overrides,
        ),
    )
    return config_from_dict(raw, name="tracked")


def marks(ledger: Any, run_id: int) -> dict[str, int] | None:
    with ledger.session() as session:
        return session.get(Run, run_id).tracked_steps


def metric_rows(ledger: Any, run_id: int) -> dict[int, StepMetrics]:
    with ledger.session() as session:
        rows = session.query(StepMetrics).filter(StepMetrics.run_id == run_id).all()
        session.expunge_all()
    return {row.step: row for row in rows}


def tick_until(controller: Controller, done: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        assert controller.tick() == "running"
        time.sleep(controller.relay_interval)


def test_every_tracker_gets_every_trained_step_once_with_the_config(tmp_path, tracker_env) -> None:
    config = sim_config(tmp_path, 5, {"tensorboard", "wandb", "mlflow"})
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        run_id = create_run_from_config(runtime.ledger, config)
        controller = Controller(runtime.ledger, runtime.app, run_id)
        controller.start()
        assert controller.run(max_seconds=120) == "completed"
        assert marks(runtime.ledger, run_id) == {"tensorboard": 4, "wandb": 4, "mlflow": 4}
        stored = metric_rows(runtime.ledger, run_id)
    steps_ = list(range(5))

    # TensorBoard: every step once, at its step number, with the ledger's values.
    scalars = tensorboard_scalars(tmp_path / "runs" / f"tracked-{run_id}" / "tensorboard")
    for key in ALWAYS + ("loss", "train_seconds"):
        assert [s for s, _ in scalars[key]] == steps_, key
    assert [v for _, v in scalars["reward"]] == pytest.approx([stored[s].reward for s in steps_])
    # The trainer's extras (step_metrics.extra) are logged beside the columns.
    extras = set().union(*(set(stored[s].extra or {}) for s in steps_))
    assert extras and extras <= set(scalars)
    (config_text,) = tensorboard_text(tmp_path / "runs" / f"tracked-{run_id}" / "tensorboard", "config")
    assert "| grpo.num_prompts_per_step | `16` |" in config_text
    assert SECRET not in config_text and "| reward.kwargs.api_key | `***` |" in config_text

    # W&B: the offline run directory holds one history row per step and the config.
    files = wandb_run_files(tracker_env / "wandb-dir")
    assert len(files) == 1 and f"refill-{run_id}-" in files[0].name
    history = wandb_history(files)
    assert [row["_step"] for row in history] == steps_
    assert all(set(ALWAYS) <= set(row) for row in history)
    assert [row["reward"] for row in history] == pytest.approx([stored[s].reward for s in steps_])
    logged = wandb_config(files)
    assert logged["grpo"]["num_prompts_per_step"] == 16
    assert logged["reward"]["kwargs"] == {"api_key": "***"}
    assert SECRET not in str(logged)

    # MLflow: the file store holds one run with every step of every metric, and the params.
    client, run = mlflow_run(f"file://{tmp_path}/mlruns", "refill-test")
    assert run.info.status == "FINISHED" and run.data.tags["refill.run_id"] == str(run_id)
    for key in ALWAYS:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == steps_, key
    assert run.data.params["grpo.num_prompts_per_step"] == "16"
    assert run.data.params["reward.kwargs.api_key"] == "***"
    assert SECRET not in str(run.data.params)


def test_a_controller_taking_over_after_a_crash_logs_each_step_once(tmp_path, tracker_env) -> None:
    """The first controller dies after giving the trackers steps; for TensorBoard and MLflow it
    dies between logging its last step and recording it in the ledger. The controller that
    resumes the run (as `refill run resume` does) logs every other step, and none twice."""
    # Housekeeping (where the trackers sync) every 0.1 s against a step every 0.3 s or more: the
    # marks reach 2 long before the run can end, whatever the machine's load.
    config = sim_config(
        tmp_path,
        8,
        {"tensorboard", "wandb", "mlflow"},
        infra={"null_trainer_delay_seconds": 0.3, "reaper_interval_seconds": 0.1},
    )
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        ledger = runtime.ledger
        run_id = create_run_from_config(ledger, config)
        first = Controller(ledger, runtime.app, run_id)
        first.start()
        tick_until(first, lambda: min((marks(ledger, run_id) or {"-": -1}).values()) >= 2 and len(marks(ledger, run_id)) == 3)
        # The crash: the first controller stops (its trackers' files are flushed; closing them
        # only frees this test process's handles) ...
        assert first.tracking is not None
        first.tracking.close(None)
        held = marks(ledger, run_id)
        assert held is not None and held["tensorboard"] < 7
        # ... having given TensorBoard and MLflow a step the ledger does not record.
        rewound = {**held, "tensorboard": held["tensorboard"] - 1, "mlflow": held["mlflow"] - 1}
        ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == run_id).values(tracked_steps=rewound)))

        second = Controller(ledger, runtime.app, run_id)
        second.start(takeover_after_seconds=0)
        assert second.run(max_seconds=120) == "completed"
        assert marks(ledger, run_id) == {"tensorboard": 7, "wandb": 7, "mlflow": 7}
    everything = list(range(8))

    scalars = tensorboard_scalars(tmp_path / "runs" / f"tracked-{run_id}" / "tensorboard")
    for key in ALWAYS:
        assert [s for s, _ in scalars[key]] == everything, key
    assert len(list((tmp_path / "runs" / f"tracked-{run_id}" / "tensorboard").glob("events.*"))) == 2

    client, run = mlflow_run(f"file://{tmp_path}/mlruns", "refill-test")
    for key in ALWAYS:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == everything, key

    # W&B: one offline directory per controller, the same run id; together every step once.
    files = wandb_run_files(tracker_env / "wandb-dir")
    assert len(files) == 2 and len({f.name for f in files}) == 1
    assert Counter(row["_step"] for row in wandb_history(files)) == Counter(everything)


def test_a_tracker_that_cannot_open_waits_and_catches_up(tmp_path, tracker_env, monkeypatch, caplog) -> None:
    """A tracker that fails (its package missing, its server down) holds no other tracker up
    and skips no step: it is tried again and catches up from its own mark."""
    monkeypatch.setattr(steps, "RETRY_SECONDS", 0.0)
    down = {"mlflow": True}
    real_open = writers.MlflowWriter.open

    def flaky_open(self, last_step):  # type: ignore[no-untyped-def]
        if down["mlflow"]:
            raise TrackerUnavailable("the tracking server is down")
        return real_open(self, last_step)

    monkeypatch.setattr(writers.MlflowWriter, "open", flaky_open)
    # The trackers sync at housekeeping: every 0.1 s here, against a step every 0.3 s or more, so
    # TensorBoard is seen ahead while three steps are still to train (at the default 1 s the
    # run could end before the test looked).
    config = sim_config(
        tmp_path, 6, {"tensorboard", "mlflow"}, infra={"null_trainer_delay_seconds": 0.3, "reaper_interval_seconds": 0.1}
    )
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        ledger = runtime.ledger
        run_id = create_run_from_config(ledger, config)
        controller = Controller(ledger, runtime.app, run_id)
        controller.start()
        tick_until(controller, lambda: (marks(ledger, run_id) or {}).get("tensorboard", -1) >= 2)
        assert "mlflow" not in marks(ledger, run_id)
        assert "experiment tracker mlflow: the tracking server is down" in caplog.text
        down["mlflow"] = False
        assert controller.run(max_seconds=120) == "completed"
        assert marks(ledger, run_id) == {"tensorboard": 5, "mlflow": 5}
    client, run = mlflow_run(f"file://{tmp_path}/mlruns", "refill-test")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward")) == list(range(6))


def test_a_tracker_down_until_the_run_ends_gets_every_step_at_the_end(tmp_path, tracker_env, monkeypatch, caplog) -> None:
    """A tracker that failed and is back only when the run completes is opened once more at
    the end, not after its retry wait (nothing syncs after the run): it gets every step."""
    monkeypatch.setattr(steps, "RETRY_SECONDS", 3600.0)
    down = {"mlflow": True}
    real_open = writers.MlflowWriter.open

    def flaky_open(self, last_step):  # type: ignore[no-untyped-def]
        if down["mlflow"]:
            raise TrackerUnavailable("the tracking server is down")
        return real_open(self, last_step)

    monkeypatch.setattr(writers.MlflowWriter, "open", flaky_open)
    config = sim_config(
        tmp_path, 4, {"tensorboard", "mlflow"}, infra={"null_trainer_delay_seconds": 0.3, "reaper_interval_seconds": 0.1}
    )
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        ledger = runtime.ledger
        run_id = create_run_from_config(ledger, config)
        controller = Controller(ledger, runtime.app, run_id)
        controller.start()
        tick_until(controller, lambda: (marks(ledger, run_id) or {}).get("tensorboard", -1) >= 1)
        assert "mlflow" not in marks(ledger, run_id)
        # Back, with an hour of retry wait still to go: only the run's end can reach it.
        down["mlflow"] = False
        assert controller.run(max_seconds=120) == "completed"
        assert marks(ledger, run_id) == {"tensorboard": 3, "mlflow": 3}
    client, run = mlflow_run(f"file://{tmp_path}/mlruns", "refill-test")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward")) == list(range(4))


def test_a_tracker_still_down_when_the_run_ends_is_named_with_the_steps_it_lacks(tmp_path, tracker_env, monkeypatch, caplog) -> None:
    monkeypatch.setattr(steps, "RETRY_SECONDS", 3600.0)

    def down(self, last_step):  # type: ignore[no-untyped-def]
        raise TrackerUnavailable("the tracking server is down")

    monkeypatch.setattr(writers.MlflowWriter, "open", down)
    config = sim_config(tmp_path, 2, {"tensorboard", "mlflow"}, infra={"reaper_interval_seconds": 0.1})
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        ledger = runtime.ledger
        run_id = create_run_from_config(ledger, config)
        controller = Controller(ledger, runtime.app, run_id)
        controller.start()
        assert controller.run(max_seconds=120) == "completed"
        assert marks(ledger, run_id) == {"tensorboard": 1}
    assert "experiment tracker mlflow could not be reached and lacks the steps after none" in caplog.text


def test_a_missing_tracker_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(writers.TRACKERS, "wandb", ("refill_no_such_module", "wandb"))
    with pytest.raises(TrackerUnavailable, match=r"logging\.wandb\.enabled .* pip install 'refill\[wandb\]'"):
        writers.load_library("wandb")


def test_with_no_tracker_enabled_nothing_changes(tmp_path) -> None:
    config = sim_config(tmp_path, 2, set())
    with embedded_fleet(f"sqlite:///{tmp_path}/refill.db") as runtime:
        run_id = create_run_from_config(runtime.ledger, config)
        controller = Controller(runtime.ledger, runtime.app, run_id)
        controller.start()
        assert controller.tracking is None
        assert controller.run(max_seconds=120) == "completed"
        assert marks(runtime.ledger, run_id) is None
    assert not (tmp_path / "runs" / f"tracked-{run_id}" / "tensorboard").exists()
    # The controller (and so every control worker) never imports a tracker's library.
    probe = (
        "import sys, refill.tasks.controller, refill.tracking, refill.tasks.definitions;"
        "loaded = [m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=REPO)


def test_the_demo_config_with_tensorboard_logs_rewards_and_zero_variance_every_step(tmp_path) -> None:
    """configs/arith-tiny.yaml (shortened) through `refill run start`, TensorBoard on."""
    raw = yaml.safe_load((REPO / "configs" / "arith-tiny.yaml").read_text())
    raw["grpo"]["max_num_steps"] = 3
    raw["run"]["output_dir"] = str(tmp_path / "runs")
    raw["logging"] = {"tensorboard": {"enabled": True, "dir": str(tmp_path / "tb")}}
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFILL_")}
    done = subprocess.run(
        [sys.executable, "-m", "refill.admin.cli", "run", "start", str(path), "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # logging.tensorboard.dir set: one directory per run under it, named after the run.
    scalars = tensorboard_scalars(tmp_path / "tb" / "demo-1")
    for key in ("reward", "first_attempt_reward", "zero_variance_fraction", "loss"):
        assert [step for step, _ in scalars[key]] == [0, 1, 2], key
