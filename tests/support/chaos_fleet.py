"""The fault suite's fleet: the acceptance harness's `Fleet`, plus what it takes to break it on
purpose (kill, freeze or skew a role, flush or restart Redis, restart PostgreSQL, cut a role's
ledger connections, run the CLI as a subprocess) and to judge a run afterwards (`fault_facts`).

The suite's Redis and PostgreSQL are its own (`FAULT_REDIS`, `FAULT_POSTGRES`: throwaway
servers that tests/faults/conftest.py starts): flushing and restarting them disturbs nothing
else, not even the rest of the session."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import and_, create_engine, func, select, text
from sqlalchemy.orm import Session

from refill.admin.progress_queries import run_progress
from refill.models.db import Ledger
from refill.models.tables import (
    Attempt,
    Group,
    RejectedResult,
    Run,
    Slot,
    SlotStatus,
    Step,
    StepStatus,
    WeightVersion,
)
from tests.support.fleet import REPO, Fleet
from tests.support.invariants import ledger_violations
from tests.support.services import HOST, RedisExecutor, ThrowawayPostgres, free_port, redis_executor

#: Seconds Redis keeps a delivered, unacknowledged message invisible before it delivers it
#: again. Production keeps it at hours (refill.tasks.app.DEFAULT_VISIBILITY_TIMEOUT) so that a
#: task is never delivered twice merely for running long. The fault fleet keeps it small so that
#: the messages a killed consumer held come back within the test; the price is that any task
#: running longer than this is delivered a second time too. Every receiver is idempotent (lease
#: handshake, attempt-keyed results, step claims), so that only costs a skipped repeat — which
#: the suite thereby exercises as well. Every task of the suite's runs finishes well within it.
VISIBILITY_TIMEOUT_SECONDS = 6


class FaultRedis:
    """The fault suite's own Redis on 127.0.0.1:`port`, keeping nothing on disk."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://{HOST}:{port}/0"
        self.executor: RedisExecutor | None = None

    @contextmanager
    def running(self, workdir: Path) -> Iterator[str]:
        """Start it (its socket, log and pid file in `workdir`); stop it at the end."""
        self.executor = redis_executor(self.port, workdir)
        self.executor.start()
        try:
            yield self.url
        finally:
            self.executor.stop()
            self.executor = None

    def restart(self, down_seconds: float) -> float:
        """SHUTDOWN NOSAVE, stay down `down_seconds`, start again empty on the same port;
        returns how long it was unreachable."""
        if self.executor is None:
            raise RuntimeError("the fault suite's Redis is not running (tests/faults/conftest.py starts it)")
        client = redis_client()
        started = time.monotonic()
        try:
            client.shutdown(nosave=True)
        finally:
            client.close()
        wait_for(lambda: not self.executor.running(), 30, "Redis shutdown")
        self.executor.stop()  # the process is gone: this only settles the executor's books
        time.sleep(down_seconds)
        self.executor.start()
        wait_for(_pings, 30, "Redis start")
        return time.monotonic() - started


def _pings() -> bool:
    client = redis_client()
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


#: Its port is fixed when this module loads, long before the server starts: the suite's modules
#: read REDIS_URL as pytest collects them.
FAULT_REDIS = FaultRedis(free_port())
REDIS_URL = FAULT_REDIS.url


class FaultPostgres:
    """The fault suite's own PostgreSQL on 127.0.0.1:`port` (a throwaway cluster), which a
    scenario may stop and start under the fleet."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: ThrowawayPostgres | None = None

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@{HOST}:{self.port}/postgres"

    @contextmanager
    def running(self, workdir: Path) -> Iterator[str]:
        """Start it (its data, socket and log in `workdir`); stop and remove it at the end."""
        self.server = ThrowawayPostgres(workdir, port=self.port)
        try:
            self.server.start()
            self.server.wait_accepting()
        except Exception as error:
            raise RuntimeError(f"the fault suite's PostgreSQL did not start: {error}\n{self.server.log_tail()}") from error
        try:
            yield self.admin_url
        finally:
            self.server.stop()
            self.server = None

    def database(self, name: str) -> str:
        """Create database `name` on it; returns its URL."""
        engine = create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        return f"postgresql+psycopg://postgres@{HOST}:{self.port}/{name}"

    def restart(self, down_seconds: float) -> float:
        """Stop it (every connection dropped), stay down `down_seconds`, start it again;
        returns how long it refused connections."""
        if self.server is None:
            raise RuntimeError("the fault suite's PostgreSQL is not running (tests/faults/conftest.py starts it)")
        return self.server.restart(down_seconds)


#: Like FAULT_REDIS, its port is fixed when this module loads.
FAULT_POSTGRES = FaultPostgres(free_port())


class ChaosFleet(Fleet):
    """A `Fleet` on the fault suite's Redis whose workers can be started with extra
    environment and restarted by role."""

    def __init__(self, database_url: str, workdir: Path, *, env: dict[str, str] | None = None) -> None:
        super().__init__(database_url, workdir, redis_url=REDIS_URL)
        self.env.update(env or {})
        self.roles: dict[str, str] = {}  # worker name -> role
        self.special: set[str] = set()  # workers started with extra environment (chaos knobs)
        self._serial = 0

    def start(  # type: ignore[override]
        self,
        role: str,
        *,
        name: str | None = None,
        concurrency: int | None = None,
        timeout: float = 60,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> subprocess.Popen[bytes]:
        """`refill worker ROLE` as in `Fleet.start`, with extra environment; `wait=False`
        returns at once (then `wait_ready(name, timeout)`)."""
        name = name or role
        log = self.workdir / f"worker-{name}.log"
        argv = [sys.executable, "-m", "refill.admin.cli", "worker", role, "--hostname", f"{name}@test", "--loglevel", "INFO"]
        if concurrency:
            argv += ["--concurrency", str(concurrency)]
        with log.open("ab") as handle:  # the child keeps its own descriptor
            process = subprocess.Popen(
                argv,
                env={**self.env, **(env or {}), "REFILL_WORKER_NAME": name},
                stdout=handle,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        self.workers[name], self.logs[name], self.roles[name] = process, log, role
        if env:
            self.special.add(name)
        if wait:
            self.wait_ready(name, timeout)
        return process

    def fresh_name(self, role: str) -> str:
        self._serial += 1
        return f"{role}-{self._serial}"

    def alive(self, name: str) -> bool:
        process = self.workers.get(name)
        return process is not None and process.poll() is None

    def names(self, role: str) -> list[str]:
        """The live plain workers of `role`."""
        return [n for n, r in self.roles.items() if r == role and n not in self.special and self.alive(n)]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        super().kill(name, sig)
        self.roles.pop(name, None)
        self.special.discard(name)

    def stop(self, name: str, grace: float = 20) -> None:
        """A graceful stop (SIGTERM: Celery's warm shutdown finishes its tasks and hands back
        the messages it had not started); SIGKILL if that takes longer than `grace`."""
        process = self.workers.pop(name)
        self.roles.pop(name, None)
        self.special.discard(name)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def ensure(self, wanted: dict[str, int]) -> None:
        """Exactly `wanted[role]` plain workers per role and nothing else: stop extras and
        workers started with chaos knobs, start what is missing."""
        for name in [n for n in list(self.workers) if not self.alive(n)]:
            self.workers.pop(name)
            self.roles.pop(name, None)
            self.special.discard(name)
        for name in list(self.special):
            self.stop(name)
        starting = []
        for role, count in wanted.items():
            names = self.names(role)
            for name in names[count:]:
                self.stop(name)
            for _ in range(count - len(names)):
                name = self.fresh_name(role)
                self.start(role, name=name, wait=False)
                starting.append(name)
        for name in [n for n, r in list(self.roles.items()) if r not in wanted]:
            self.stop(name)
        for name in starting:  # started together, so the fleet is back in one start-up time
            self.wait_ready(name, 90)

    def shutdown(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self.workers.clear()
        self.roles.clear()
        self.special.clear()

    # --- the CLI ------------------------------------------------------------------------

    def cli_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in self.env.items() if not k.startswith("REFILL_CHAOS_")}
        env.update(COLUMNS="200", **(extra or {}))
        return env

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`refill ARGS` with the fleet's environment; waits for it."""
        return subprocess.run(
            [sys.executable, "-m", "refill.admin.cli", *args],
            env=self.cli_env(env),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def spawn_cli(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`refill ARGS` in the background, its output in the log `name` (`fleet.log(name)`)."""
        log = self.workdir / f"cli-{name}.log"
        with log.open("ab") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "refill.admin.cli", *args],
                env=self.cli_env(env),
                cwd=self.workdir,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        self.logs[name] = log
        return process


# --- driving a run while something breaks -------------------------------------------------


@dataclass
class FaultRun:
    status: str
    seconds: float
    injected: Any = None  # what the fault function returned
    injected_at: float | None = None  # seconds after the start


def drive_with_fault(
    fleet: Fleet,
    ledger: Ledger,
    run_id: int,
    *,
    when: Callable[[Session], bool],
    fault: Callable[[], Any],
    timeout: float = 150,
) -> FaultRun:
    """Drive the run with a controller in this process; inject `fault()` from another thread as
    soon as `when(session)` holds. Fails if the run ended before the fault was injected."""
    started = time.monotonic()
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def inject() -> None:
        try:
            while not done.is_set():
                with ledger.session() as session:
                    ready = when(session)
                if ready:
                    outcome["at"] = time.monotonic() - started
                    outcome["result"] = fault()
                    return
                time.sleep(0.05)
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = error

    injector = threading.Thread(target=inject, name="fault-injector", daemon=True)
    injector.start()
    try:
        status = fleet.drive(ledger, run_id, timeout=timeout)
    finally:
        done.set()
        injector.join(120)
    if "error" in outcome:
        raise outcome["error"]
    assert "at" in outcome, f"run {run_id} ended ({status}) before the fault was injected"
    return FaultRun(status, time.monotonic() - started, outcome.get("result"), outcome["at"])


def weight_version_at_least(run_id: int, version: int) -> Callable[[Session], bool]:
    def check(session: Session) -> bool:
        return (session.scalar(select(Run.weight_version).where(Run.id == run_id)) or 0) >= version

    return check


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout}s")


def progress(ledger: Ledger, run_id: int) -> Any:
    return ledger.transaction(lambda s: run_progress(s, run_id))


# --- breaking the services ----------------------------------------------------------------


def redis_client() -> redis.Redis:
    """A client of the fault suite's Redis."""
    return redis.Redis.from_url(REDIS_URL)


def restart_redis(down_seconds: float = 2.0) -> float:
    """Restart the fault suite's Redis (`FaultRedis.restart`); returns how long it was
    unreachable."""
    return FAULT_REDIS.restart(down_seconds)


def restart_postgres(down_seconds: float = 5.0) -> float:
    """Restart the fault suite's PostgreSQL (`FaultPostgres.restart`); returns how long it was
    unreachable."""
    return FAULT_POSTGRES.restart(down_seconds)


def terminate_backends(application_name: str) -> int:
    """`pg_terminate_backend` on every connection named `application_name` (on the suite's
    PostgreSQL); returns how many."""
    engine = create_engine(FAULT_POSTGRES.admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            return len(
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE application_name = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": application_name},
                ).all()
            )
    finally:
        engine.dispose()


# --- what a run must show afterwards -------------------------------------------------------


@dataclass
class FaultFacts:
    run_id: int
    status: str
    error: str | None
    end_reason: str | None
    steps: int  # trained
    groups_trained: int
    #: committed groups lost: a trained step short of its target, or a group the ledger says
    #: was trained in a step whose slots do not hold it
    groups_lost: int
    #: groups trained twice: a group in two slots, more groups marked trained in a step than
    #: its target, or a step that published more than one weight version
    trained_twice: int
    weight_versions: list[int]
    train_claims: dict[int, int]
    rejected: dict[str, int]
    failed: dict[str, int]
    #: infra failures the reaper made: leases of running attempts that expired (a worker
    #: stopped heartbeating) and queued attempts whose message never reached a worker
    reaped_running: int
    reaped_queued: int
    #: `refill check RUN`: its exit status and what it printed
    check_exit: int = 0
    check_output: str = ""
    #: the test suite's own invariants (tests/support/invariants.py)
    violations: list[str] = field(default_factory=list)

    def line(self, scenario: str, seconds: float, **extra: Any) -> str:
        """One line for the suite's report (the README's fault table is filled from these)."""
        more = " ".join(f"{k}={v}" for k, v in extra.items())
        return (
            f"FAULT {scenario}: run {self.run_id} {self.status} steps={self.steps} "
            f"groups={self.groups_trained} lost={self.groups_lost} trained_twice={self.trained_twice} "
            f"rejected={self.rejected} failed={self.failed} reaped_running={self.reaped_running} "
            f"reaped_queued={self.reaped_queued} refill_check={'ok' if self.check_exit == 0 else 'FAILED'} "
            f"seconds={seconds:.1f} {more}"
        ).rstrip()


def fault_facts(session: Session, run_id: int) -> FaultFacts:
    run = session.get(Run, run_id)
    assert run is not None
    trained_steps = session.execute(
        select(Step.step, Step.num_slots - Step.shrunk, Step.train_claims).where(
            Step.run_id == run_id, Step.status == StepStatus.TRAINED.value
        )
    ).all()
    held = dict(
        session.execute(
            select(Slot.step, func.count())
            .join(Group, Group.attempt_id == Slot.group_attempt_id)
            .where(Slot.run_id == run_id, Slot.status == SlotStatus.COMMITTED.value)
            .group_by(Slot.step)
        ).all()
    )
    marked = dict(
        session.execute(
            select(Group.trained_step, func.count())
            .where(Group.run_id == run_id, Group.trained_step.is_not(None))
            .group_by(Group.trained_step)
        ).all()
    )
    # A group marked trained in step s that no slot of step s holds.
    astray = session.scalar(
        select(func.count())
        .select_from(Group)
        .outerjoin(
            Slot,
            and_(Slot.run_id == Group.run_id, Slot.group_attempt_id == Group.attempt_id, Slot.step == Group.trained_step),
        )
        .where(Group.run_id == run_id, Group.trained_step.is_not(None), Slot.idx.is_(None))
    )
    lost = int(astray or 0) + sum(max(0, target - held.get(step, 0)) for step, target, _ in trained_steps)
    in_two_slots = session.scalar(
        select(func.count()).select_from(
            select(Slot.group_attempt_id)
            .where(Slot.run_id == run_id, Slot.group_attempt_id.is_not(None))
            .group_by(Slot.group_attempt_id)
            .having(func.count() > 1)
            .subquery()
        )
    )
    versions = list(
        session.scalars(select(WeightVersion.version).where(WeightVersion.run_id == run_id).order_by(WeightVersion.version))
    )
    per_step_versions = session.execute(
        select(WeightVersion.trained_step, func.count())
        .where(WeightVersion.run_id == run_id, WeightVersion.trained_step.is_not(None))
        .group_by(WeightVersion.trained_step)
    ).all()
    twice = (
        int(in_two_slots or 0)
        + sum(max(0, marked.get(step, 0) - target) for step, target, _ in trained_steps)
        + sum(n - 1 for _, n in per_step_versions if n > 1)
    )
    rejected = dict(
        session.execute(
            select(RejectedResult.reason, func.count())
            .where(RejectedResult.run_id == run_id)
            .group_by(RejectedResult.reason)
        ).all()
    )
    failed = dict(
        session.execute(
            select(Attempt.failure_kind, func.count())
            .where(Attempt.run_id == run_id, Attempt.state == "failed")
            .group_by(Attempt.failure_kind)
        ).all()
    )
    errors = list(
        session.scalars(
            select(Attempt.error).where(Attempt.run_id == run_id, Attempt.failure_kind == "infra")
        )
    )
    return FaultFacts(
        run_id=run_id,
        status=run.status,
        error=run.error,
        end_reason=run.end_reason,
        steps=len(trained_steps),
        groups_trained=sum(marked.values()),
        groups_lost=lost,
        trained_twice=twice,
        weight_versions=versions,
        train_claims={step: claims for step, _, claims in trained_steps},
        rejected={str(k): int(v) for k, v in rejected.items()},
        failed={str(k): int(v) for k, v in failed.items()},
        reaped_running=sum("stopped heartbeating" in (e or "") for e in errors),
        reaped_queued=sum("waited on the generate queue" in (e or "") for e in errors),
        **dict(zip(("check_exit", "check_output"), refill_check(session, run_id), strict=True)),
        violations=ledger_violations(session, run_id),
    )


def refill_check(session: Session, run_id: int) -> tuple[int, str]:
    """`refill check RUN` on the session's ledger: (exit status, output)."""
    from typer.testing import CliRunner

    from refill.admin.cli import app

    url = session.get_bind().url.render_as_string(hide_password=False)
    result = CliRunner().invoke(app, ["check", str(run_id), "--database-url", url])
    return result.exit_code, result.output


def assert_nothing_lost(facts: FaultFacts, *, steps: int) -> None:
    """The promise of SPEC §8 for a run that went through a fault: it completed, the ledger's
    invariants hold, no committed group was lost and none was trained twice."""
    assert facts.status == "completed", facts.error
    assert facts.check_exit == 0, facts.check_output
    assert facts.steps == steps
    assert facts.weight_versions == list(range(steps + 1))
    assert facts.groups_lost == 0
    assert facts.trained_twice == 0
    assert facts.violations == [], "\n".join(facts.violations)


__all__ = [
    "FAULT_POSTGRES",
    "FAULT_REDIS",
    "REDIS_URL",
    "REPO",
    "ChaosFleet",
    "FaultFacts",
    "FaultRun",
    "VISIBILITY_TIMEOUT_SECONDS",
    "assert_nothing_lost",
    "drive_with_fault",
    "fault_facts",
    "progress",
    "restart_postgres",
    "restart_redis",
    "terminate_backends",
    "wait_for",
    "weight_version_at_least",
]


#: What every fault scenario's run starts from (on top of tests.support.fleet.SIM_CONFIG):
#: short enough to keep the suite quick, with leases short enough that a dead worker's
#: attempts come back within seconds.
FAULT_RUN: dict[str, Any] = {
    "grpo": {"max_num_steps": 8},
    # A message a worker popped from Redis and died before recording as unacknowledged is
    # gone from Redis for good (kombu's BRPOP is not atomic with its unacked bookkeeping);
    # only the ledger's queue timeout brings its attempt back, so keep it short here.
    "generation": {"lease_seconds": 5, "heartbeat_seconds": 1, "queue_timeout_seconds": 8},
}
