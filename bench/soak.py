"""`python -m bench soak --minutes M --seed S`: a chaos soak.

A `sim` fleet (several `refill worker` processes per role, on a PostgreSQL and a Redis of the
soak's own) runs simulated runs back to back, each driven by a `refill run start` process,
while a fault is injected every few seconds, overlapping the ones still in progress. The
faults are drawn, in a shuffled round so that every kind comes up, from the fault suite's
kinds (tests/faults) and issue 20's:

  kill-generate, kill-consumer, kill-trainer   SIGKILL one worker of the role, start another
  kill-controller                              SIGKILL `refill run start`, `refill run resume --force`
  flushall, restart-redis                      lose every message; Redis down 2 s, back empty
  pg-terminate-consumer                        pg_terminate_backend on a consumer's connections for 3 s
  duplicate-results, bogus-results             a worker that sends every result twice for 10 s;
                                               malformed results and results for no attempt
  restart-postgres                             the ledger's PostgreSQL down 5 s, every connection dropped
  zombie                                       SIGSTOP a generation worker past its lease, then SIGCONT
  skewed-clock                                 a generation worker whose clock is 5 minutes off, for 15 s

Every fault is printed with its time. At the end, per run: completed or not, `refill check`,
committed groups lost, groups trained twice, and the attempts wasted (infra failures: leases
reaped, messages lost, engines that failed; and results refused as late). The target: every
run completes, 0 lost, 0 trained twice, `refill check` clean. The fault suite runs a 2-minute
soak (tests/faults/test_soak.py); bench/README.md reports a 30-minute one.

It never touches another PostgreSQL or Redis: both servers are throwaway ones it starts
(tests/support/chaos_fleet.py), so it needs the server binaries, not running servers.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sqlalchemy import func, select

from refill.models.tables import RejectedResult, Run
from refill.tasks.chaos import CLOCK_OFFSET_SECONDS, DUPLICATE_RESULTS
from refill.tasks.outage import PatientLedger
from refill.tasks.queues import RESULTS, TASK_RECORD_RESULT
from tests.support.chaos_fleet import (
    FAULT_POSTGRES,
    FAULT_REDIS,
    FAULT_RUN,
    VISIBILITY_TIMEOUT_SECONDS,
    ChaosFleet,
    FaultFacts,
    fault_facts,
    redis_client,
    restart_postgres,
    restart_redis,
    terminate_backends,
)
from tests.support.fleet import merged, purge_prefix

KINDS = (
    "kill-generate", "kill-consumer", "kill-trainer", "kill-controller", "flushall", "restart-redis",
    "pg-terminate-consumer", "duplicate-results", "bogus-results", "restart-postgres", "zombie", "skewed-clock",
)
#: Faults that take one server down: never two of a kind at once (each waits for the last).
EXCLUSIVE = {"restart-redis": "redis", "flushall": "redis", "restart-postgres": "postgres"}
#: The soak's fleet: several processes per role.
SHAPE = {"generate": 3, "consume": 2, "train": 2}
LEASE_SECONDS = 5
#: What each run is: small steps, leases short enough that a dead worker's attempts come back
#: within seconds, budgets generous enough that a prompt unlucky with several faults in a row
#: is retried rather than dropped.
SOAK_RUN: dict[str, Any] = merged(FAULT_RUN, {
    "data": {"builtin": "arith", "builtin_size": 2000},
    "grpo": {"max_num_steps": 6, "num_prompts_per_step": 16},
    "generation": {
        "lease_seconds": LEASE_SECONDS,
        "sim": {"latency": {"distribution": "lognormal", "mean_seconds": 0.1, "sigma": 0.5}},
    },
    "rollout_failure": {"max_attempts_per_prompt": 8, "max_replacement_attempts": 4, "retry_backoff_seconds": 0.1},
    "infra": {"null_trainer_delay_seconds": 0.05, "trainer_lease_seconds": 5},
})
CREATED = re.compile(r"run (\d+) created")


@dataclass
class RunRecord:
    number: int
    config: Path
    run_id: int | None = None
    controllers: int = 0  # `refill run start` / `resume` processes it took
    facts: FaultFacts | None = None
    late: int = 0
    #: why its facts could not be read, if they could not
    unjudged: str | None = None

    def line(self) -> str:
        if self.unjudged is not None:
            return f"run {self.run_id}: could not be judged: {self.unjudged}"
        if self.facts is None:
            return f"run #{self.number}: never created ({self.controllers} tries)"
        f = self.facts
        wasted = f.failed.get("infra", 0) + self.late
        return (
            f"run {f.run_id}: {f.status}{'' if f.status == 'completed' else ' (NOT completed: ' + str(f.error) + ')'}; "
            f"refill check {'ok' if f.check_exit == 0 else 'FAILED'}; steps {f.steps}; groups lost {f.groups_lost}; "
            f"trained twice {f.trained_twice}; attempts wasted {wasted} (reaped running {f.reaped_running}, "
            f"reaped queued {f.reaped_queued}, other infra {f.failed.get('infra', 0) - f.reaped_running - f.reaped_queued}, "
            f"late results {self.late}); controllers {self.controllers}"
        )

    @property
    def clean(self) -> bool:
        f = self.facts
        return f is not None and f.status == "completed" and f.check_exit == 0 and f.groups_lost == 0 and f.trained_twice == 0


@dataclass
class SoakReport:
    faults: list[tuple[float, str, str]] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return bool(self.runs) and all(r.clean for r in self.runs)


class Soak:
    """Runs back to back on `fleet` for `minutes` of faults, then until the last one ends."""

    def __init__(self, fleet: ChaosFleet, database_url: str, *, minutes: float, seed: int, out: TextIO = sys.stdout) -> None:
        self.fleet = fleet
        self.ledger = PatientLedger(database_url)
        self.seconds = minutes * 60
        self.rng = random.Random(seed)
        self.out = out
        self.report = SoakReport()
        self.started = time.monotonic()
        self._lock = threading.RLock()  # the fleet's books, the controller, the claimed workers
        self._claimed: set[str] = set()
        self._busy: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._controller: subprocess.Popen[bytes] | None = None
        self._run: RunRecord | None = None

    # --- the runs --------------------------------------------------------------------------

    def run(self, drain_seconds: float = 240) -> SoakReport:
        self._say("soak", f"{self.seconds / 60:g} minutes of faults on {SHAPE}; lease {LEASE_SECONDS} s")
        injector = threading.Thread(target=self._inject, name="soak-injector", daemon=True)
        injector.start()
        number = 0
        while self._elapsed() < self.seconds:
            number += 1
            config = self.fleet.write_config(
                merged(SOAK_RUN, {"run": {"seed": self.rng.randrange(1 << 30)}}), name=f"soak-{number}"
            )
            self._drive(RunRecord(number, config), deadline=self.started + self.seconds + drain_seconds)
        injector.join()
        for thread in self._threads:
            thread.join(120)
        self._say("soak", "faults over; the fleet back to its shape")
        self._ensure_shape()
        for record in self.report.runs:
            if record.run_id is None:
                continue
            try:
                with self.ledger.session() as session:
                    record.facts = fault_facts(session, record.run_id)
                    record.late = int(session.scalar(
                        select(func.count()).where(RejectedResult.run_id == record.run_id, RejectedResult.reason == "late")
                    ) or 0)
            except Exception as error:  # noqa: BLE001 - one run that cannot be judged must not hide the others
                record.unjudged = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return self.report

    def _drive(self, record: RunRecord, deadline: float) -> None:
        self.report.runs.append(record)
        self._run = record
        while time.monotonic() < deadline:
            if record.run_id is None:
                record.run_id = self._created(record)
            with self._lock:
                exited = self._controller is not None and self._controller.poll() is not None
            # Its controller ended the run, or died of something other than a kill-controller
            # fault (which starts the next one itself): a start refused during an outage.
            if exited and record.run_id is not None and self._status(record.run_id) != "running":
                with self._lock:
                    self._controller = None
                return
            with self._lock:
                if self._controller is None or self._controller.poll() is not None:
                    self._controller = self._spawn_controller(record)
            time.sleep(0.5)
        with self._lock:
            if self._controller is not None and self._controller.poll() is None:
                self._controller.kill()
            self._controller = None

    def _spawn_controller(self, record: RunRecord) -> subprocess.Popen[bytes]:
        record.controllers += 1
        name = f"controller-{record.number}-{record.controllers}"
        if record.run_id is None:
            return self.fleet.spawn_cli(name, "run", "start", str(record.config), "--quiet")
        return self.fleet.spawn_cli(name, "run", "resume", str(record.run_id), "--force", "--quiet")

    def _created(self, record: RunRecord) -> int | None:
        for index in range(1, record.controllers + 1):
            found = CREATED.search(self.fleet.log(f"controller-{record.number}-{index}"))
            if found:
                return int(found.group(1))
        return None

    def _status(self, run_id: int) -> str:
        # Tries enough to outlast a restart of PostgreSQL (5 s down, up to 9 s with the stop and
        # the start on a loaded machine): the default eight, about 5-10 s of back-off, came
        # within one try of giving up and ending the soak in seeds 9 and 10.
        return self.ledger.transaction(
            lambda s: s.scalar(select(Run.status).where(Run.id == run_id)), attempts=20, what="soak status"
        )

    # --- the faults ------------------------------------------------------------------------

    def _inject(self) -> None:
        deck: list[str] = []
        while True:
            time.sleep(self.rng.uniform(2.0, 6.0))
            if self._elapsed() >= self.seconds:
                return
            if not deck:
                deck = list(KINDS)
                self.rng.shuffle(deck)
            kind = deck.pop()
            resource = EXCLUSIVE.get(kind, kind)
            with self._lock:
                if resource in self._busy:
                    deck.insert(0, kind)  # later in this round
                    continue
                self._busy.add(resource)
            thread = threading.Thread(target=self._fault, args=(kind, resource), name=f"fault-{kind}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _fault(self, kind: str, resource: str) -> None:
        at = self._elapsed()
        self._say(kind, "injecting", at)
        try:
            detail = getattr(self, "_" + kind.replace("-", "_"))()
        except Exception as error:  # noqa: BLE001 - an injection that could not be made is reported, not fatal
            detail = f"could not inject: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        finally:
            with self._lock:
                self._busy.discard(resource)
        self.report.faults.append((at, kind, detail))
        self._say(kind, f"{detail} (injected at {at:.1f}s)")

    def _victim(self, role: str) -> str | None:
        with self._lock:
            names = [n for n in self.fleet.names(role) if n not in self._claimed]
            if not names:
                return None
            name = self.rng.choice(names)
            self._claimed.add(name)
            return name

    def _replace(self, role: str, victim: str) -> str:
        with self._lock:
            self.fleet.kill(victim)
            self._claimed.discard(victim)
            fresh = self.fleet.fresh_name(role)
            self.fleet.start(role, name=fresh, wait=False)
        self.fleet.wait_ready(fresh, 90)
        return f"SIGKILL {victim}; {fresh} started"

    def _kill(self, role: str) -> str:
        victim = self._victim(role)
        return "no worker to kill" if victim is None else self._replace(role, victim)

    def _kill_generate(self) -> str:
        return self._kill("generate")

    def _kill_consumer(self) -> str:
        return self._kill("consume")

    def _kill_trainer(self) -> str:
        return self._kill("train")

    def _kill_controller(self) -> str:
        with self._lock:
            record, controller = self._run, self._controller
            if record is None or record.run_id is None or controller is None or controller.poll() is not None:
                return "no controller running"
            controller.kill()
            controller.wait(30)
            self._controller = self._spawn_controller(record)
            return f"SIGKILL the controller of run {record.run_id}; `refill run resume --force` started"

    def _flushall(self) -> str:
        client = redis_client()
        try:
            lost = sum(client.llen(key) for key in client.scan_iter(match=f"{self.fleet.prefix}*") if client.type(key) == b"list")
            client.flushall()
        finally:
            client.close()
        return f"FLUSHALL ({lost} messages queued)"

    def _restart_redis(self) -> str:
        return f"Redis down {restart_redis(2.0):.1f} s, back empty"

    def _restart_postgres(self) -> str:
        return f"PostgreSQL down {restart_postgres(5.0):.1f} s, every connection dropped"

    def _pg_terminate_consumer(self) -> str:
        victim = self._victim("consume")
        if victim is None:
            return "no consumer"
        killed, until = 0, time.monotonic() + 3
        try:
            while time.monotonic() < until:
                killed += terminate_backends(f"refill:{victim}")
                time.sleep(0.2)
        finally:
            with self._lock:
                self._claimed.discard(victim)
        return f"{killed} connections of {victim} terminated"

    def _special(self, role: str, env: dict[str, str], seconds: float, what: str) -> str:
        with self._lock:
            name = self.fleet.fresh_name(f"{role}-{what}")
            self.fleet.start(role, name=name, env=env, wait=False)
        self.fleet.wait_ready(name, 90)
        time.sleep(seconds)
        self._retire(name)
        return f"{name} worked {seconds:.0f} s"

    def _duplicate_results(self) -> str:
        return self._special("generate", {DUPLICATE_RESULTS: "1"}, 10, "twice")

    def _skewed_clock(self) -> str:
        skew = self.rng.choice((-300, 300))
        return self._special("generate", {CLOCK_OFFSET_SECONDS: str(skew)}, 15, "behind" if skew < 0 else "ahead")

    def _bogus_results(self) -> str:
        record = self._run
        run_id = record.run_id if record is not None and record.run_id is not None else 1
        bodies = [
            {"run_id": run_id, "attempt_id": 10**12, "worker": "soak", "weight_version": 0, "error_kind": "infra", "error": "x"},
            {"run_id": run_id, "attempt": "not a result"},
        ]
        for body in bodies:
            self.fleet.app.send_task(TASK_RECORD_RESULT, args=[body], queue=RESULTS, routing_key=RESULTS, serializer="json")
        return f"{len(bodies)} results for no attempt / malformed sent for run {run_id}"

    def _zombie(self) -> str:
        victim = self._victim("generate")
        if victim is None:
            return "no worker to freeze"
        process = self.fleet.workers[victim]
        seconds = LEASE_SECONDS + 3
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            process.send_signal(signal.SIGCONT)
            with self._lock:
                self._claimed.discard(victim)
        return f"{victim} frozen {seconds} s (lease {LEASE_SECONDS} s), then woken"

    # --- the fleet -------------------------------------------------------------------------

    def _retire(self, name: str) -> None:
        """A graceful stop, without holding the lock while the worker finishes its tasks."""
        with self._lock:
            process = self.fleet.workers.pop(name)
            self.fleet.roles.pop(name, None)
            self.fleet.special.discard(name)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def _ensure_shape(self) -> None:
        with self._lock:
            self.fleet.ensure(SHAPE)

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _say(self, kind: str, text: str, at: float | None = None) -> None:
        at = self._elapsed() if at is None else at
        print(f"{at:7.1f}s  {kind:<22} {text}", file=self.out, flush=True)


def print_report(report: SoakReport, out: TextIO = sys.stdout) -> None:
    kinds = {kind: sum(k == kind for _, k, _ in report.faults) for kind in KINDS}
    print(f"\n{len(report.faults)} faults: " + ", ".join(f"{k} {n}" for k, n in kinds.items()), file=out)
    for record in report.runs:
        print(record.line(), file=out)
    print("clean: every run completed, refill check ok, 0 lost, 0 trained twice" if report.clean else "NOT CLEAN", file=out)


def soak_on(fleet: ChaosFleet, database_url: str, *, minutes: float, seed: int, out: TextIO = sys.stdout) -> SoakReport:
    """A soak on a fleet whose servers are FAULT_POSTGRES and FAULT_REDIS (the fault suite's)."""
    fleet.ensure(SHAPE)
    report = Soak(fleet, database_url, minutes=minutes, seed=seed, out=out).run()
    print_report(report, out)
    return report


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="minutes of faults (the last run then finishes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults' order and timing, and of the runs")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from refill.models.migrate import upgrade

    workdir = Path(tempfile.mkdtemp(prefix="refill-soak-"))
    # As root the PostgreSQL runs as another user, who must be able to pass through.
    workdir.chmod(0o711)
    try:
        (workdir / "postgres").mkdir()
        (workdir / "redis").mkdir()
        (workdir / "fleet").mkdir()
        with FAULT_POSTGRES.running(workdir / "postgres"), FAULT_REDIS.running(workdir / "redis"):
            url = FAULT_POSTGRES.database("refill_soak")
            upgrade(url)
            fleet = ChaosFleet(url, workdir / "fleet", env={"REFILL_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT_SECONDS)})
            try:
                report = soak_on(fleet, url, minutes=args.minutes, seed=args.seed)
            finally:
                fleet.shutdown()
                purge_prefix(fleet.prefix, fleet.redis_url)
    finally:
        shutil.rmtree(workdir)
    return 0 if report.clean else 1


__all__ = ["KINDS", "SHAPE", "Soak", "SoakReport", "main", "print_report", "soak_on"]
