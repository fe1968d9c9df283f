"""A real fleet for acceptance and fault tests: `refill worker ROLE` subprocesses (real
`celery worker` processes) on the test session's Redis and a test PostgreSQL database.

Every test session gets its own Redis key prefix (REFILL_BROKER_PREFIX), so concurrent
sessions on one Redis never see each other's messages. The Redis is the test session's
(tests/support/services.py) unless a fleet is given its own (the fault suite's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from refill.admin.progress_queries import run_progress
from refill.config import config_from_dict
from refill.models.db import Ledger
from refill.tasks.app import make_app
from refill.tasks.controller import Controller
from refill.tasks.setup import create_run_from_config

#: Outside a test session (the benchmarks), with REFILL_TEST_REDIS_URL unset: the local server.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REPO = Path(__file__).resolve().parents[2]


def session_redis_url() -> str:
    """The test session's Redis. Read at each call: the session sets the variable once its
    server is up, after this module is imported."""
    return os.environ.get("REFILL_TEST_REDIS_URL") or DEFAULT_REDIS_URL


#: A small simulated run: the knobs the fleet tests vary start from here.
SIM_CONFIG: dict[str, Any] = {
    "run": {"seed": 3},
    "data": {"builtin": "arith", "builtin_size": 2000},
    "generation": {
        "backend": "sim",
        "lease_seconds": 20,
        "heartbeat_seconds": 2,
        "queue_timeout_seconds": 60,
        "sim": {
            "zero_variance_fraction": 0.4,
            "latency": {"distribution": "lognormal", "mean_seconds": 0.02, "sigma": 0.5},
        },
    },
    "reward": {"function": "refill.rewards.sim:solved"},
    "grpo": {
        "num_prompts_per_step": 16,
        "num_generations_per_prompt": 8,
        "max_num_steps": 20,
        "max_num_epochs": None,
        "use_dynamic_sampling": True,
    },
    "async_rl": {"max_lookahead_versions": 1},
    "rollout_failure": {"retry_backoff_seconds": 0.1},
    "infra": {"trainer": "null", "null_trainer_delay_seconds": 0.02},
}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


class Fleet:
    """Worker subprocesses of one test session, and the environment they share."""

    def __init__(
        self, database_url: str, workdir: Path, prefix: str | None = None, redis_url: str | None = None
    ) -> None:
        self.database_url = database_url
        self.redis_url = redis_url or session_redis_url()
        self.workdir = workdir
        self.prefix = prefix or f"refill-test-{uuid.uuid4().hex[:8]}:"
        self.env = dict(os.environ)
        self.env.update(
            REFILL_DATABASE_URL=database_url,
            REFILL_BROKER_URL=self.redis_url,
            REFILL_BROKER_PREFIX=self.prefix,
            PYTHONUNBUFFERED="1",
            # Custom samplers and reward functions must be importable on the fleet; the tests'
            # own live under tests/.
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            TOKENIZERS_PARALLELISM="false",
        )
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self._app = None

    # --- processes ---------------------------------------------------------------------

    def start(self, role: str, *, name: str | None = None, concurrency: int | None = None, timeout: float = 60) -> subprocess.Popen[bytes]:
        name = name or role
        log = self.workdir / f"worker-{name}.log"
        argv = [sys.executable, "-m", "refill.admin.cli", "worker", role, "--hostname", f"{name}@test", "--loglevel", "INFO"]
        if concurrency:
            argv += ["--concurrency", str(concurrency)]
        handle = log.open("ab")
        process = subprocess.Popen(
            argv, env={**self.env, "REFILL_WORKER_NAME": name}, stdout=handle, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        self.workers[name], self.logs[name] = process, log
        self.wait_ready(name, timeout)
        return process

    def wait_ready(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.workers[name].poll() is not None:
                raise RuntimeError(f"worker {name} exited early:\n{self.log(name)[-3000:]}")
            if " ready." in self.log(name):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker {name} not ready within {timeout}s:\n{self.log(name)[-3000:]}")

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if self.logs[name].exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.workers.pop(name)
        process.send_signal(sig)
        process.wait(30)

    # --- the controller side --------------------------------------------------------------

    @property
    def app(self):  # type: ignore[no-untyped-def]
        if self._app is None:
            self._app = make_app(self.redis_url, name="refill-test-controller", key_prefix=self.prefix)
        return self._app

    def config(self, overrides: dict[str, Any] | None = None, name: str = "fleet-test") -> Any:
        raw = merged(SIM_CONFIG, overrides or {})
        raw.setdefault("run", {})["output_dir"] = str(self.workdir / "runs")
        return config_from_dict(raw, name=name)

    def write_config(self, overrides: dict[str, Any] | None = None, name: str = "fleet-test") -> Path:
        raw = merged(SIM_CONFIG, overrides or {})
        raw.setdefault("run", {})["output_dir"] = str(self.workdir / "runs")
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def create_run(self, ledger: Ledger, overrides: dict[str, Any] | None = None) -> int:
        return create_run_from_config(ledger, self.config(overrides), migrate=False)

    def drive(self, ledger: Ledger, run_id: int, timeout: float = 180) -> str:
        """Run the controller in this process until the run ends."""
        controller = Controller(ledger, self.app, run_id)
        controller.start()
        status = controller.run(max_seconds=timeout)
        if status == "running":
            progress = ledger.transaction(lambda s: run_progress(s, run_id))
            raise TimeoutError(f"run {run_id} still running after {timeout}s: {progress}\n" + self.tail_logs())
        return status

    def tail_logs(self, chars: int = 2000) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)[-chars:]}" for name in self.logs)


@contextmanager
def fleet(database_url: str, workdir: Path, roles: tuple[str, ...] = ("generate", "consume", "train")) -> Iterator[Fleet]:
    f = Fleet(database_url, workdir)
    try:
        for role in roles:
            f.start(role)
        yield f
    finally:
        for process in list(f.workers.values()):
            process.send_signal(signal.SIGTERM)
        for process in list(f.workers.values()):
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        f.workers.clear()
        purge_prefix(f.prefix, f.redis_url)


def purge_prefix(prefix: str, url: str | None = None) -> None:
    """Delete this session's keys from Redis (`url`, or the session's)."""
    import redis

    client = redis.Redis.from_url(url or session_redis_url())
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
