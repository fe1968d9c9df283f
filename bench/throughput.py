"""`python -m bench throughput`: results consumed per second by the real pipeline, beside a
bare Celery no-op round trip on the same broker with the same worker processes.

What runs (all on this machine's Redis and PostgreSQL, one fresh database and one fresh Redis
key prefix per phase, phases one after the other so they never compete for the CPU):

refill (the real pipeline)
    `--generate-workers` `refill worker generate` processes, `--consume-workers` `refill
    worker consume` processes and one `refill worker train` (real `celery worker` processes,
    started by tests/support/fleet.py), a controller in this process (admission, relay,
    reaper), the `sim` back-end with zero latency (`grpo.num_generations_per_prompt` = `--n`,
    `--tokens` tokens per completion, zero-variance fraction `--p`), the `null` trainer with no
    delay, dynamic sampling and adaptive over-dispatch on, groups stored as claim checks or
    sent inline (`--payload-store`, `infra.payloads.store`). The run trains `--groups` groups
    (`--prompts-per-step` per step). *Results consumed* = results the consumer recorded in the
    ledger (attempts finished by a result: committed, filtered or failed, plus refused
    results); the window runs from the controller's start to the ledger time of the last
    recorded result. Printed with each round: the CPU ms per result of each group of processes
    (`consume` is the results consumer's), and what Redis holds per result waiting on the
    results queue (sampled every 50 ms by a process of its own, `bench.payloads.QueueSampler`).

bare (Celery with no work)
    The same number of processes with the same pool and concurrency as the pipeline's two
    hops, on the same Redis with the same Celery settings (`refill.tasks.app.celery_settings`:
    JSON, acks late, prefetch 1, refill's Redis transport), log level and start-up path
    (`app.worker_main` with the role's `worker_argv`, queues swapped):
    `--generate-workers` processes serve `bench.noop_generate`, which sends one
    `bench.noop_result` message; `--consume-workers` processes serve `bench.noop_result`, which
    INCRs a Redis counter and, at the last one, stores the time. The client publishes M
    `bench.noop_generate` messages (M = the number of results the pipeline consumed, rounded)
    through one producer, then polls the counter. *Results consumed per second* = M / (time of
    the M-th INCR − time before the first publish). That is one result's round trip (the
    generate message out, the result message back) with every cost of refill removed.
    `bare 1-hop` (printed for context, not the target) sends the M messages straight to the
    consume-side processes: what one Celery worker does with one no-op message per result.
    `bare, carrying the group` (context too) is the round trip with work in it: each generate
    task has the `sim` back-end make the group (`--n` completions of `--tokens` tokens, as the
    pipeline's workers do) and sends it inline, as JSON, in its result message; the consume side
    receives (decodes) it and counts. That is Celery moving the group with no ledger, no payload
    store and no trainer: the design refill's claim checks replace.

Every figure is the median of `--repeat` rounds (phases interleaved); each round is printed.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.machine import load_average, process_cpu

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BARE_GENERATE, BARE_RESULTS = "bench-generate", "bench-results"
NOOP_GENERATE, NOOP_RESULT = "bench.noop_generate", "bench.noop_result"


# --------------------------------------------------------------------------- bare Celery


def bare_app(broker_url: str, prefix: str):  # type: ignore[no-untyped-def]
    """A Celery app with refill's settings whose only tasks are the two no-ops."""
    import redis
    from celery import Celery
    from kombu import Exchange, Queue

    from refill.tasks.app import celery_settings

    app = Celery("bench-bare", set_as_current=False)
    settings = celery_settings(broker_url, prefix)
    exchange = Exchange("bench", type="direct")
    settings.update(
        task_default_queue=BARE_RESULTS,
        task_default_exchange="bench",
        task_queues=[Queue(q, exchange, routing_key=q) for q in (BARE_GENERATE, BARE_RESULTS)],
        task_routes={
            NOOP_GENERATE: {"queue": BARE_GENERATE, "routing_key": BARE_GENERATE},
            NOOP_RESULT: {"queue": BARE_RESULTS, "routing_key": BARE_RESULTS},
        },
    )
    app.conf.update(settings)
    client = redis.Redis.from_url(broker_url)

    @app.task(name=NOOP_GENERATE, bind=True, shared=False)
    def noop_generate(self, body: dict[str, Any]) -> str:  # type: ignore[no-untyped-def]
        if body.get("tokens"):
            # The "carrying" phase: the group the sim back-end makes for this prompt, sent
            # inline as the result (what Celery alone does with a group: no ledger, no store).
            body = {**body, "result": inline_group(body["i"], body["n"], body["tokens"])}
        self.app.send_task(NOOP_RESULT, args=[body], queue=BARE_RESULTS, routing_key=BARE_RESULTS, serializer="json")
        return "sent"

    @app.task(name=NOOP_RESULT, shared=False)
    def noop_result(body: dict[str, Any]) -> str:
        done = client.incr(body["counter"])
        if done == body["of"]:
            client.set(body["counter"] + ":done", repr(time.time()))
        return "counted"

    return app


_engines: dict[int, Any] = {}


def inline_group(i: int, n: int, tokens: int) -> dict[str, Any]:
    """The JSON body of a result of `n` completions of `tokens` tokens, made by the `sim`
    back-end as the pipeline's workers make theirs, with its rollout inline."""
    from refill.models.payload import GenerateMessage, ResultMessage
    from refill.tasks.backends.sim import Latency, SimEngine

    engine = _engines.get(tokens)
    if engine is None:
        engine = _engines[tokens] = SimEngine(
            seed=11, zero_variance_fraction=0.33, latency=Latency("constant", 0.0, 0.0),
            tokens_per_completion=tokens, virtual=True,
        )
    request = GenerateMessage(
        run_id=1, attempt_id=i + 1, prompt=f"What is {i} + {i}?", row={"i": i}, n=n, temperature=1.0,
        top_p=1.0, max_new_tokens=max(16, tokens), seed=i, min_weight_version=0,
    )
    (output,) = engine.generate([request])
    return ResultMessage(
        run_id=1, attempt_id=i + 1, worker="bare", weight_version=0, prompt_token_ids=output.prompt_token_ids,
        completions=output.completions, rewards=[float(k % 2) for k in range(n)], generation_seconds=0.0,
    ).to_json()


def bare_worker_main(role: str, concurrency: int | None, loglevel: str) -> None:
    """Entry point of a bare worker process (`python -m bench.throughput --bare-worker ROLE`)."""
    from refill.tasks.workers import worker_argv

    app = bare_app(os.environ["REFILL_BROKER_URL"], os.environ["REFILL_BROKER_PREFIX"])
    argv = worker_argv(role, concurrency=concurrency, hostname=os.environ.get("BENCH_HOSTNAME"), loglevel=loglevel)
    queue = {"generate": BARE_GENERATE, "consume": BARE_RESULTS}[role]
    argv[argv.index("--queues") + 1] = queue
    # The same process settings as `refill worker`'s: the comparison is of the work, not of them.
    from refill.tasks.runtime import tune_collector

    tune_collector()
    app.worker_main(argv)


class BareFleet:
    def __init__(self, redis_url: str, workdir: Path, args: argparse.Namespace) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.args = args
        self.prefix = f"refill-bench-bare-{uuid.uuid4().hex[:8]}:"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.app = bare_app(redis_url, self.prefix)

    def start(self) -> None:
        specs = [("generate", i, self.args.generate_concurrency) for i in range(self.args.generate_workers)]
        specs += [("consume", i, self.args.consume_concurrency) for i in range(self.args.consume_workers)]
        env = dict(os.environ)
        env.update(
            REFILL_BROKER_URL=self.redis_url,
            REFILL_BROKER_PREFIX=self.prefix,
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        )
        for role, i, concurrency in specs:
            name = f"bare-{role}-{i}"
            argv = [sys.executable, "-m", "bench.throughput", "--bare-worker", role, "--loglevel", self.args.loglevel]
            if concurrency:
                argv += ["--bare-concurrency", str(concurrency)]
            log = self.workdir / f"{name}.log"
            self.logs[name] = log
            self.processes[name] = subprocess.Popen(
                argv, env={**env, "BENCH_HOSTNAME": f"{name}@bench"}, cwd=REPO,
                stdout=log.open("ab"), stderr=subprocess.STDOUT,
            )
        for name in self.processes:
            wait_ready(self.processes[name], self.logs[name])

    def meter(self) -> CpuMeter:
        return CpuMeter(
            {
                "generate": [p.pid for n, p in self.processes.items() if "generate" in n],
                "consume": [p.pid for n, p in self.processes.items() if "consume" in n],
                "client": [os.getpid()],
                "redis": pids_named("redis-server"),
                "postgres": pids_named("postgres"),
            }
        )

    def round(self, count: int, *, two_hops: bool = True, carry: int = 0) -> tuple[float, dict[str, float]]:
        """Send `count` no-op messages; results per second until the last one was counted,
        and the CPU ms per result of each group of processes. With `carry` tokens, each
        generate task makes a sim group of `--n` completions of that many tokens and sends it
        inline in its result message."""
        import redis

        client = redis.Redis.from_url(self.redis_url)
        counter = f"{self.prefix}count-{uuid.uuid4().hex[:8]}"
        task, queue = (NOOP_GENERATE, BARE_GENERATE) if two_hops else (NOOP_RESULT, BARE_RESULTS)
        with self.meter() as meter:
            started = time.time()
            with self.app.producer_or_acquire() as producer:
                for i in range(count):
                    self.app.send_task(
                        task, args=[{"counter": counter, "of": count, "i": i, "n": self.args.n, "tokens": carry}], queue=queue,
                        routing_key=queue, producer=producer, serializer="json",
                    )
            deadline = time.monotonic() + 600
            while (done := client.get(counter + ":done")) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bare round: {client.get(counter)} of {count} after 600 s")
                time.sleep(0.005)
        client.close()
        return count / (float(done) - started), {k: v * 1000 / count for k, v in meter.used.items()}

    def stop(self) -> None:
        stop_processes(self.processes)
        purge(self.redis_url, self.prefix)


# --------------------------------------------------------------------------- the pipeline


def pipeline_config(args: argparse.Namespace, groups: int) -> dict[str, Any]:
    steps = max(1, math.ceil(groups / args.prompts_per_step))
    prompts = int(steps * args.prompts_per_step / (1 - args.p) * 2.5) + 4 * args.prompts_per_step
    return {
        "run": {"seed": 11},
        "data": {"builtin": "arith", "builtin_size": prompts},
        "generation": {
            "backend": "sim",
            "groups_in_flight": args.generate_concurrency or 8,
            "max_new_tokens": max(16, args.tokens),  # the sim back-end stops a completion there
            "lease_seconds": 120,
            "heartbeat_seconds": 10,
            "queue_timeout_seconds": 600,
            "sim": {
                "zero_variance_fraction": args.p,
                "tokens_per_completion": args.tokens,
                "latency": {"distribution": "constant", "mean_seconds": 0.0},
            },
        },
        "reward": {"function": "refill.rewards.sim:solved"},
        "grpo": {
            "num_prompts_per_step": args.prompts_per_step,
            "num_generations_per_prompt": args.n,
            "max_num_steps": steps,
            "max_num_epochs": None,
            "use_dynamic_sampling": True,
        },
        "async_rl": {"max_lookahead_versions": 1},
        "infra": {
            "trainer": "null",
            "null_trainer_delay_seconds": 0.0,
            "payloads": {"store": args.payload_store},
        },
    }


@dataclass
class PipelineRound:
    results: int
    seconds: float
    trained_groups: int
    reaped: int
    violations: list[str] = field(default_factory=list)
    #: median and 90th percentile (ms) of each hop of an attempt's life
    hops: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: CPU ms per result consumed, by group of processes (the whole run, end to end)
    cpu: dict[str, float] = field(default_factory=dict)
    #: what Redis held per result waiting on the results queue
    redis: str = ""

    @property
    def rate(self) -> float:
        return self.results / self.seconds


class PipelineFleet:
    def __init__(self, database_url: str, redis_url: str, workdir: Path, args: argparse.Namespace) -> None:
        os.environ["REFILL_TEST_REDIS_URL"] = redis_url
        from tests.support.fleet import Fleet

        self.args = args
        self.fleet = Fleet(database_url, workdir, prefix=f"refill-bench-{uuid.uuid4().hex[:8]}:")
        self.database_url = database_url

    def start(self) -> None:
        for i in range(self.args.generate_workers):
            self.fleet.start("generate", name=f"generate-{i}", concurrency=self.args.generate_concurrency)
        for i in range(self.args.consume_workers):
            self.fleet.start("consume", name=f"consume-{i}", concurrency=self.args.consume_concurrency)
        self.fleet.start("train", name="train")

    def round(self, groups: int) -> PipelineRound:
        from sqlalchemy import func, select

        from refill.admin.invariants import run_checks
        from refill.config import config_from_dict
        from refill.models.db import Ledger
        from refill.models.tables import Attempt, FailureKind, RejectedResult
        from refill.tasks.controller import Controller
        from refill.tasks.setup import create_run_from_config

        ledger = Ledger(self.database_url)
        raw = pipeline_config(self.args, groups)
        raw["run"]["output_dir"] = str(self.fleet.workdir / "runs")
        run_id = create_run_from_config(ledger, config_from_dict(raw, name=f"bench-{groups}"), migrate=False)
        controller = Controller(ledger, self.fleet.app, run_id)
        meter = CpuMeter(
            {
                "generate": [p.pid for n, p in self.fleet.workers.items() if n.startswith("generate")],
                "consume": [p.pid for n, p in self.fleet.workers.items() if n.startswith("consume")],
                "train": [p.pid for n, p in self.fleet.workers.items() if n.startswith("train")],
                "controller": [os.getpid()],
                "redis": pids_named("redis-server"),
                "postgres": pids_named("postgres"),
            }
        )
        from bench.payloads import QueueSampler
        from refill.tasks.queues import RESULTS

        meter.__enter__()
        started = time.time()
        with QueueSampler(os.environ["REFILL_TEST_REDIS_URL"], self.fleet.prefix + RESULTS) as sampler:
            controller.start()
            status = controller.run(max_seconds=900)
        meter.__exit__()
        if status != "completed":
            raise RuntimeError(f"run {run_id} ended {status}\n{self.fleet.tail_logs()}")

        def measure(session):  # type: ignore[no-untyped-def]
            # Every result the consumer applied sets generation_seconds (refused ones are in
            # rejected_results); nothing else writes it.
            recorded, last = session.execute(
                select(func.count(), func.max(Attempt.finished_at)).where(
                    Attempt.run_id == run_id, Attempt.generation_seconds.is_not(None)
                )
            ).one()
            refused, last_refused = session.execute(
                select(func.count(), func.max(RejectedResult.received_at)).where(RejectedResult.run_id == run_id)
            ).one()
            reaped = session.scalar(
                select(func.count()).where(
                    Attempt.run_id == run_id, Attempt.failure_kind == FailureKind.INFRA.value, Attempt.error.like("lease expired%")
                )
            )
            hops = session.execute(
                select(Attempt.created_at, Attempt.dispatched_at, Attempt.started_at, Attempt.finished_at).where(
                    Attempt.run_id == run_id, Attempt.generation_seconds.is_not(None)
                )
            ).all()
            report = run_checks(session, run_id)
            end = max(t for t in (last, last_refused) if t is not None)
            return recorded + refused, end.timestamp(), reaped, [str(v) for v in report.violations], hops

        results, end, reaped, violations, hops = ledger.transaction(measure)
        ledger.dispose()
        cpu = {k: v * 1000 / results for k, v in meter.used.items()}
        return PipelineRound(
            results, end - started, groups, int(reaped or 0), violations, latency_breakdown(hops), cpu, sampler.line()
        )

    def stop(self) -> None:
        stop_processes(self.fleet.workers)
        purge(os.environ["REFILL_TEST_REDIS_URL"], self.fleet.prefix)


def latency_breakdown(rows: list[tuple[Any, Any, Any, Any]]) -> dict[str, tuple[float, float]]:
    """Median and p90 in ms of: created -> relayed (outbox), relayed -> leased (broker, Celery,
    lease handshake), leased -> recorded (engine, scoring, result message, consumer)."""
    spans: dict[str, list[float]] = {"outbox": [], "to-lease": [], "to-record": []}
    for created, dispatched, started, finished in rows:
        if dispatched is not None:
            spans["outbox"].append((dispatched - created).total_seconds() * 1000)
            if started is not None:
                spans["to-lease"].append((started - dispatched).total_seconds() * 1000)
        if started is not None and finished is not None:
            spans["to-record"].append((finished - started).total_seconds() * 1000)
    out = {}
    for name, values in spans.items():
        if values:
            values.sort()
            out[name] = (values[len(values) // 2], values[int(len(values) * 0.9)])
    return out


# --------------------------------------------------------------------------- processes


def wait_ready(process: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"worker exited early:\n{log.read_text(errors='replace')[-3000:]}")
        if log.exists() and " ready." in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise TimeoutError(f"worker not ready within {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")


def stop_processes(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes.values():
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    processes.clear()


def purge(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def pids_named(word: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if word in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class CpuMeter:
    """CPU seconds used by named groups of processes during a measured span."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.started: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        return {name: sum(process_cpu(pid, children=True) for pid in pids) for name, pids in self.groups.items()}

    def __enter__(self) -> CpuMeter:
        self.started = self.read()
        self.used: dict[str, float] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        ended = self.read()
        self.used = {name: ended[name] - self.started[name] for name in ended}


def cpu_line(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.2f}" for name, ms in cpu.items()) + f" (sum {sum(cpu.values()):.2f})"


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2000, help="groups the pipeline's run trains")
    parser.add_argument("--prompts-per-step", type=int, default=250, help="N, groups per step")
    parser.add_argument("--n", type=int, default=16, help="completions per group")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per completion (the sim back-end's default 8)")
    parser.add_argument(
        "--payload-store", choices=["files", "inline"], default="files",
        help="infra.payloads.store: claim checks (files) or groups in the result message (inline)",
    )
    parser.add_argument("--p", type=float, default=0.33, help="zero-variance fraction of the sim back-end")
    parser.add_argument("--generate-workers", type=int, default=2)
    parser.add_argument("--consume-workers", type=int, default=1)
    parser.add_argument("--generate-concurrency", type=int, default=None, help="threads per generate worker (role default 8)")
    parser.add_argument("--consume-concurrency", type=int, default=None, help="threads per consume worker (role default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per phase (median printed)")
    parser.add_argument("--loglevel", default="INFO", help="worker log level, both fleets")
    parser.add_argument("--redis-url", default=os.environ.get("REFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--keep", action="store_true", help="keep the worker logs (printed path)")
    parser.add_argument("--bare-worker", choices=["generate", "consume"], help=argparse.SUPPRESS)
    parser.add_argument("--bare-concurrency", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.bare_worker:
        bare_worker_main(args.bare_worker, args.bare_concurrency, args.loglevel)
        return 0
    from refill.models.migrate import upgrade
    from tests.support.databases import temporary_pg_database

    workdir = Path(tempfile.mkdtemp(prefix="refill-bench-throughput-"))
    expected = round(args.groups / (1 - args.p))
    print(
        f"throughput: {args.groups} groups, N={args.prompts_per_step}, n={args.n} x {args.tokens} tokens, p={args.p}, "
        f"payloads {args.payload_store}, "
        f"{args.generate_workers} generate + {args.consume_workers} consume workers, "
        f"{os.cpu_count()} CPUs, load average {load_average()}",
        flush=True,
    )
    pipeline: list[PipelineRound] = []
    bare: list[float] = []
    bare_one_hop: list[float] = []
    bare_carrying: list[float] = []
    with temporary_pg_database("refill_bench") as url:
        upgrade(url)
        refill = PipelineFleet(url, args.redis_url, workdir / "refill", args)
        baseline = BareFleet(args.redis_url, workdir / "bare", args)
        (workdir / "refill").mkdir()
        (workdir / "bare").mkdir()
        try:
            refill.start()
            baseline.start()
            refill.round(args.prompts_per_step)  # warm-up: engines, connections, caches
            baseline.round(500)
            baseline.round(500, two_hops=False)
            baseline.round(100, carry=args.tokens)
            for i in range(args.repeat):
                rate, bare_cpu = baseline.round(expected)
                bare.append(rate)
                rate, one_hop_cpu = baseline.round(expected, two_hops=False)
                bare_one_hop.append(rate)
                rate, carrying_cpu = baseline.round(expected, carry=args.tokens)
                bare_carrying.append(rate)
                measured = refill.round(args.groups)
                pipeline.append(measured)
                print(
                    f"  round {i + 1}: refill {measured.rate:8.0f} results/s ({measured.results} in "
                    f"{measured.seconds:.2f} s, reaped {measured.reaped}, invariant violations "
                    f"{len(measured.violations)})   bare round trip {bare[-1]:8.0f}/s   bare 1-hop "
                    f"{bare_one_hop[-1]:8.0f}/s   bare carrying the group {bare_carrying[-1]:8.0f}/s   "
                    f"load {load_average()}",
                    flush=True,
                )
                print("    CPU ms per result: refill " + cpu_line(measured.cpu) + " | bare round trip "
                      + cpu_line(bare_cpu) + " | bare 1-hop " + cpu_line(one_hop_cpu)
                      + " | bare carrying " + cpu_line(carrying_cpu))
                print(f"    redis: {measured.redis}")
                print("    refill attempt hops, median/p90 ms: " + ", ".join(
                    f"{name} {mid:.0f}/{p90:.0f}" for name, (mid, p90) in measured.hops.items()))
                for violation in measured.violations[:5]:
                    print(f"    violation: {violation}")
        finally:
            refill.stop()
            baseline.stop()
    ours = statistics.median(r.rate for r in pipeline)
    theirs = statistics.median(bare)
    one_hop = statistics.median(bare_one_hop)
    print()
    print(f"{'':28}{'results/s':>12}{'refill / this':>16}")
    print(f"{'refill pipeline':28}{ours:12.0f}{'':>16}")
    print(f"{'bare Celery round trip':28}{theirs:12.0f}{ours / theirs:16.2f}   (target >= 1.00)")
    print(f"{'bare Celery 1-hop':28}{one_hop:12.0f}{ours / one_hop:16.2f}   (context)")
    carrying = statistics.median(bare_carrying)
    print(f"{'bare, carrying the group':28}{carrying:12.0f}{ours / carrying:16.2f}   (context: the group inline, no ledger)")
    print(f"load average after: {load_average()}")
    if args.keep:
        print(f"logs: {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
