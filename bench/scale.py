"""`python -m bench scale --attempts N`: does the ledger's cost per result stay flat as a run grows?

The production ledger on a fresh PostgreSQL database (migrated as `refill db upgrade` does, so
with every index and view), driven in virtual time by `bench/virtual_fleet.py` (as `bench fill`
drives it): admission, the relay, lease handshakes, `record_results` with borrowing, over-dispatch and the barrier, training
claims and weight versions, the reaper. Generation costs nothing (the `sim` engine reports the
latency it drew), so the wall time measured is the ledger's.

For each tenth of the run (by results recorded) it prints:

- **cpu ms/result**: CPU time of the ledger's work in the tenth (this process's, inside every
  ledger transaction, plus the PostgreSQL backends' serving it) / results recorded in it. CPU
  time, not wall time, is what grows when a query scans a run's history, and it does not
  change when other work shares the machine;
- **wall ms/result**: wall time of the ledger's transactions / results (the machine's load
  shows here);
- **ms/step**: the ledger's CPU time / steps trained in the tenth;
- **rows/result**: rows PostgreSQL inserted, updated and deleted in the tenth / results (its
  statistics, which lag by up to a second);
- **DB/attempt**: `pg_database_size` / attempts made so far;
- **peak RSS** of each process: this one (ru_maxrss: the fleet's roles and the ledger's Python
  side) and the PostgreSQL backend serving it (its private memory, RssAnon, the largest seen
  at a tenth's end; its shared buffers are the server's cache, not the backend's growth).

It ends with `per-result cost last/first tenth: R; peak RSS growth after the first tenth: G%`:
R on the CPU ms/result, G the larger growth of the two processes' peak from the end of the
first tenth to the end.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import resource
import signal
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import process_cpu  # noqa: E402
from bench.virtual_fleet import RefillPolicy, Scenario, VirtualFleet  # noqa: E402
from refill.models.admission import admit_steps  # noqa: E402
from refill.models.migrate import upgrade  # noqa: E402
from refill.tasks.backends.sim import Latency  # noqa: E402


@dataclass(frozen=True)
class ScaleScenario(Scenario):
    """A long run on a data set that cycles (`max_num_epochs: null`): the prompts table does
    not grow with the run, as a real data set's does not."""

    dataset_size: int = 20_000

    def num_prompts(self) -> int:
        return self.dataset_size


class _Forget(dict):  # type: ignore[type-arg]
    """The virtual fleet remembers each attempt's start for its trace; a million-attempt run
    reads no trace, and the memory measured must be the ledger's, not the benchmark's."""

    def __setitem__(self, key: Any, value: Any) -> None:
        return None


@dataclass
class Tenth:
    index: int
    results: int
    steps: int
    ledger_seconds: float
    cpu_seconds: float
    attempts: int
    db_bytes: int
    rss_kib: int
    pg_rss_kib: int | None
    wall_seconds: float
    #: rows inserted, updated and deleted in the tenth (PostgreSQL's statistics)
    rows: int
    #: wall seconds of each kind of ledger transaction in the tenth
    ops: dict[str, float]

    @property
    def ms_per_result(self) -> float:
        return 1000.0 * self.cpu_seconds / max(1, self.results)

    @property
    def wall_ms_per_result(self) -> float:
        return 1000.0 * self.ledger_seconds / max(1, self.results)

    @property
    def ms_per_step(self) -> float | None:
        return 1000.0 * self.cpu_seconds / self.steps if self.steps else None


class ScaleFleet(VirtualFleet):
    """The virtual fleet, measured every tenth of `target` results, stopped at `target`."""

    def __init__(self, scenario: Scenario, url: str, target: int, batch_window: float = 0.02) -> None:
        self.ledger_cpu = 0.0  # before the virtual fleet's first transaction (creating the run)
        super().__init__(scenario, RefillPolicy(), ledger_url=url, batch_window=batch_window)
        self.started_at = _Forget()
        self.target = target
        self.results = 0
        self.trained_steps = 0
        self.tenths: list[Tenth] = []
        self._backends: dict[int, float] = {}  # PostgreSQL backend pid -> CPU seconds at the last mark
        self._pg_peak_kib = 0
        self._marks = (0, 0, 0.0, 0.0, time.perf_counter())  # results, steps, ledger wall, cpu, wall
        self._ops: dict[str, float] = {}
        self._rows = 0

    def tx(self, what, fn):  # type: ignore[no-untyped-def]
        # Single-threaded: this thread's CPU time inside a transaction is the ledger's Python
        # side (the lease handshakes flushed first included).
        began = time.thread_time()
        try:
            return super().tx(what, fn)
        finally:
            self.ledger_cpu += time.thread_time() - began

    # --- what the production roles do beyond the virtual fleet --------------------------

    def consume(self) -> None:
        self.results += len(self.inbox)
        super().consume()
        while len(self.tenths) < 10 and self.results >= (len(self.tenths) + 1) * self.target / 10:
            self._measure()

    def trained(self, step: int) -> None:
        super().trained(step)
        self.trained_steps = self.version

    # --- the loop (VirtualFleet.run without the trace a long run cannot afford) ----------

    def run_to_target(self) -> None:
        # Creating the run (its data set) is not part of the first tenth.
        self._pg_cpu()
        self._marks = (0, 0, self._ledger_seconds(), self.ledger_cpu, time.perf_counter())
        self._rows = self._rows_written()
        self._ops = {what: seconds for what, (seconds, _) in self.profile.items()}
        self.tx("admit_steps", lambda s: admit_steps(s, self.run_id, self.at()))
        self.relay()
        self.schedule(self.reap_every, "reap")
        while self.events and len(self.tenths) < 10:
            when, _, kind, payload = heapq.heappop(self.events)
            self.now = when
            if not self.step_event(kind, payload):
                raise RuntimeError(
                    f"the run ended after {self.results} results, before {self.target}: "
                    "raise the scenario's steps"
                )
        if len(self.tenths) < 10:
            raise RuntimeError(f"the fleet ran out of work after {self.results} results")

    # --- measuring ----------------------------------------------------------------------

    def _ledger_seconds(self) -> float:
        return sum(seconds for seconds, _ in self.profile.values())

    def _pg_backends(self) -> list[int]:
        with self.ledger.engine.connect() as connection:
            return list(
                connection.execute(
                    # The fleet is one thread: its transactions and this query share one pooled
                    # connection, whose backend is the one measured.
                    # Client backends only: an autovacuum worker shows up here while it runs, and
                    # its CPU is the server's housekeeping, not the ledger's transactions.
                    text(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND backend_type = 'client backend'"
                    )
                ).scalars()
            )

    def _pg_cpu(self) -> float:
        """CPU seconds the ledger's PostgreSQL backends spent since the last call."""
        spent = 0.0
        for pid in self._pg_backends():
            now = process_cpu(pid)
            spent += now - self._backends.get(pid, 0.0)
            self._backends[pid] = now
        return spent

    def _rows_written(self) -> int:
        with self.ledger.engine.connect() as connection:
            return int(
                connection.execute(
                    text(
                        "SELECT tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
                        "WHERE datname = current_database()"
                    )
                ).scalar()
                or 0
            )

    def _measure(self) -> None:
        results, steps, seconds, cpu, wall = self._marks
        pg_cpu = self._pg_cpu()
        now_seconds, now_cpu, now_wall = self._ledger_seconds(), self.ledger_cpu, time.perf_counter()
        with self.ledger.engine.connect() as connection:
            db_bytes = int(connection.execute(text("SELECT pg_database_size(current_database())")).scalar() or 0)
        rows = self._rows_written()
        private = [kib for kib in map(_private_kib, self._pg_backends()) if kib is not None]
        self._pg_peak_kib = max([self._pg_peak_kib, *private])
        self.tenths.append(
            Tenth(
                index=len(self.tenths) + 1,
                results=self.results - results,
                steps=self.trained_steps - steps,
                ledger_seconds=now_seconds - seconds,
                cpu_seconds=now_cpu - cpu + pg_cpu,
                attempts=self.dispatched,
                db_bytes=db_bytes,
                rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                pg_rss_kib=self._pg_peak_kib or None,
                wall_seconds=now_wall - wall,
                rows=rows - self._rows,
                ops={what: spent - self._ops.get(what, 0.0) for what, (spent, _) in self.profile.items()},
            )
        )
        self._rows = rows
        self._ops = {what: seconds for what, (seconds, _) in self.profile.items()}
        self._marks = (self.results, self.trained_steps, now_seconds, now_cpu, now_wall)
        print_tenth(self.tenths[-1])


def _private_kib(pid: int) -> int | None:
    """RssAnon of a process (its private resident memory), or None when /proc does not show it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


# --- the database -------------------------------------------------------------------------


def own_server(workdir: Path) -> Any:
    """A PostgreSQL cluster of this run's own, with initdb's defaults (autovacuum on, fsync on):
    the server as deployed, not one tuned for tests. Needs the server binaries (as the tests)."""
    from tests.support.services import ThrowawayPostgres

    server = ThrowawayPostgres(workdir, options="")
    server.start()
    return server


def autovacuum_off(url: str) -> bool:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return str(connection.execute(text("SHOW autovacuum")).scalar()) == "off"
    finally:
        engine.dispose()


def temporary_database(server: str) -> tuple[str, Any]:
    name = f"refill_scale_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    return make_url(server).set(database=name).render_as_string(hide_password=False), (admin, name)


def drop_database(handle: Any) -> None:
    admin, name = handle
    with admin.connect() as connection:
        connection.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n AND pid <> pg_backend_pid()"),
            {"n": name},
        )
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


# --- printing -----------------------------------------------------------------------------


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.0f} MiB"


def print_tenth(t: Tenth) -> None:
    per_step = "-" if t.ms_per_step is None else f"{t.ms_per_step:.0f}"
    print(
        f"tenth {t.index:>2}: {t.results:>8} results {t.steps:>5} steps  cpu ms/result {t.ms_per_result:6.3f}  "
        f"wall ms/result {t.wall_ms_per_result:6.3f}  ms/step {per_step:>7}  rows/result {t.rows / max(1, t.results):5.1f}  DB {t.db_bytes / 2**20:8.1f} MiB = {t.db_bytes / max(1, t.attempts) / 1024:5.2f} KiB/attempt  "
        f"peak RSS bench {_mib(t.rss_kib)}, postgres {_mib(t.pg_rss_kib)}  ({t.wall_seconds:.0f} s)",
        flush=True,
    )


def print_ops(tenths: list[Tenth]) -> None:
    """Where the ledger's wall time went, per result, in the first and the last tenth."""
    first, last = tenths[0], tenths[-1]
    print("ledger wall ms per result, by transaction: first tenth -> last tenth")
    for what in sorted(set(first.ops) | set(last.ops), key=lambda w: -last.ops.get(w, 0.0)):
        a = 1000.0 * first.ops.get(what, 0.0) / max(1, first.results)
        b = 1000.0 * last.ops.get(what, 0.0) / max(1, last.results)
        if a or b:
            print(f"  {what:<16} {a:8.3f} -> {b:8.3f}")


def summary(tenths: list[Tenth]) -> str:
    first, last = tenths[0], tenths[-1]
    ratio = last.ms_per_result / first.ms_per_result
    growth = [100.0 * (last.rss_kib - first.rss_kib) / first.rss_kib]
    if first.pg_rss_kib and last.pg_rss_kib:
        growth.append(100.0 * (last.pg_rss_kib - first.pg_rss_kib) / first.pg_rss_kib)
    return f"per-result cost last/first tenth: {ratio:.2f}; peak RSS growth after the first tenth: {max(growth):.1f}%"


# --- weights: what publishing and loading a version costs ------------------------------------


def weights_main(repeat: int, bulk_mib: int) -> int:
    """`--weights`: publish and load the tiny model's weights as the trainer and the engines do
    (`trainer.weights.atomic_directory` + `save_model_dir`, fsynced; `load_weights_into`), and a
    `bulk_mib` safetensors file for this machine's throughput (written and fsynced, then read
    back cold: its pages evicted from the page cache first)."""
    import statistics
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    from refill.model_loading import load_model, load_weights_into, model_directory
    from refill.trainer.weights import atomic_directory, save_model_dir, weights_dir

    model = load_model(model_directory("builtin:tiny-arith"))
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    publish, load = [], []
    with tempfile.TemporaryDirectory(prefix="refill-weights-") as run_dir:
        for version in range(1, repeat + 1):
            began = time.perf_counter()
            with atomic_directory(weights_dir(run_dir, version)) as target:
                save_model_dir(model, None, target)
            publish.append(time.perf_counter() - began)
            began = time.perf_counter()
            load_weights_into(model, weights_dir(run_dir, version))
            load.append(time.perf_counter() - began)
        bulk = Path(run_dir) / "bulk.safetensors"
        tensor = torch.ones(bulk_mib * 2**20 // 4, dtype=torch.float32)
        began = time.perf_counter()
        save_file({"w": tensor}, str(bulk))
        with open(bulk, "rb+") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        write = time.perf_counter() - began
        # Summed, so that every page is read (safetensors may map the file lazily).
        began = time.perf_counter()
        float(load_file(str(bulk))["w"].sum())
        read_cold = time.perf_counter() - began
        began = time.perf_counter()
        float(load_file(str(bulk))["w"].sum())
        read_warm = time.perf_counter() - began
    mib = size / 2**20
    print(f"tiny model (builtin:tiny-arith): {mib:.2f} MiB of weights, {repeat} versions")
    print(f"  publish (write + fsync + rename): median {1000 * statistics.median(publish):.1f} ms")
    print(f"  load into a live model:           median {1000 * statistics.median(load):.1f} ms")
    print(f"bulk {bulk_mib} MiB safetensors on this machine's disk:")
    print(f"  write + fsync {bulk_mib / write:.0f} MiB/s; read cold {bulk_mib / read_cold:.0f} MiB/s; warm (page cache) {bulk_mib / read_warm:.0f} MiB/s")
    per_version = 15 * 1024  # MiB: a 7B model in bf16
    print(
        f"estimate, 7B in bf16 ({per_version / 1024:.0f} GiB) at these rates: publish {per_version / (bulk_mib / write):.0f} s, "
        f"one engine's cold load {per_version / (bulk_mib / read_cold):.0f} s"
    )
    return 0


# --- the broker: what a message and an attempt in flight cost Redis --------------------------


def broker_main(redis_url: str, count: int, tokens: int) -> int:
    """`--broker`: `count` messages of each kind sent as the fleet sends them (the relay's
    `publish` for generate messages, single and bundled; `send_task` for a result of n = 16
    completions of `tokens` tokens, inline), and Redis's used_memory before and after."""
    import random

    import redis

    from refill.models.outbox import Outgoing
    from refill.models.payload import Completion, GenerateMessage, ResultMessage
    from refill.tasks.app import make_app
    from refill.tasks.queues import RESULTS, TASK_RECORD_RESULT
    from refill.tasks.relay import GENERATE_BUNDLE, publish

    prefix = f"refill-bench-broker-{uuid.uuid4().hex[:8]}:"
    app = make_app(redis_url, name="refill-bench-broker", key_prefix=prefix)
    client = redis.Redis.from_url(redis_url)
    rng = random.Random(0)

    def generate(i: int) -> Outgoing:
        body = GenerateMessage(
            run_id=1, attempt_id=10_000_000 + i, prompt=f"What is {i} + {i * 7}? Answer with a number.",
            row={"prompt": f"What is {i} + {i * 7}?", "answer": str(8 * i)}, n=16, temperature=1.0, top_p=1.0,
            max_new_tokens=tokens, seed=i, min_weight_version=0,
        ).to_json()
        return Outgoing("generate", "generate", 1, body)

    def measured(send) -> float:  # type: ignore[no-untyped-def]
        before = int(client.info("memory")["used_memory"])
        send()
        used = int(client.info("memory")["used_memory"]) - before
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
        return used / count

    single = measured(lambda: [publish(app, [generate(i)]) for i in range(count)])
    bundled = measured(
        lambda: [publish(app, [generate(i * GENERATE_BUNDLE + k) for k in range(GENERATE_BUNDLE)]) for i in range(count)]
    )
    result = ResultMessage(
        run_id=1, attempt_id=1, worker="gpu-node-17:1234", weight_version=3,
        prompt_token_ids=[rng.randrange(150_000) for _ in range(200)],
        completions=[
            Completion(
                token_ids=[rng.randrange(150_000) for _ in range(tokens)],
                logprobs=[-rng.random() * 5 for _ in range(tokens)],
                text="x" * (4 * tokens),
            )
            for _ in range(16)
        ],
        rewards=[float(rng.random() < 0.5) for _ in range(16)], generation_seconds=12.5,
    ).to_json()
    results = measured(
        lambda: [
            app.send_task(TASK_RECORD_RESULT, args=[result], queue=RESULTS, routing_key=RESULTS, serializer="json",
                          argsrepr="[result]", kwargsrepr="{}")
            for _ in range(count)
        ]
    )
    client.close()
    print(f"Redis used_memory per message, {count} of each (kombu's Redis transport, JSON):")
    print(f"  generate, one attempt:           {single:8.0f} B")
    print(f"  generate, bundle of {GENERATE_BUNDLE} attempts:    {bundled:8.0f} B ({bundled / GENERATE_BUNDLE:.0f} B per attempt)")
    print(f"  result, n = 16 x {tokens} tokens inline: {results:8.0f} B")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=1_000_000, help="results to record (N attempts)")
    parser.add_argument("--prompts", type=int, default=256, help="N, prompts per step")
    parser.add_argument("--generations", type=int, default=16, help="n, generations per prompt")
    parser.add_argument("--p", type=float, default=0.33, help="zero-variance fraction")
    parser.add_argument("--lookahead", type=int, default=1, help="max_lookahead_versions")
    parser.add_argument("--workers", type=int, default=16, help="W")
    parser.add_argument("--in-flight", type=int, default=64, help="C, groups in flight per worker")
    parser.add_argument("--latency", default="lognormal:mean=1,sigma=0.5")
    parser.add_argument(
        "--batch-window", type=float, default=0.02,
        help="virtual seconds the consumer waits after a batch's first result (its max_wait_ms; at most 64 a batch)",
    )
    parser.add_argument("--dataset", type=int, default=20_000, help="prompts in the (cycled) data set")
    parser.add_argument(
        "--server", default=None,
        help="PostgreSQL admin URL to create the database on (default REFILL_BENCH_PG_URL; without either, a "
        "cluster of the run's own with initdb's defaults is started)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database (its name is printed)")
    parser.add_argument(
        "--weights", action="store_true", help="instead: time publishing and loading weight versions (see weights_main)"
    )
    parser.add_argument("--bulk-mib", type=int, default=1024, help="with --weights: the throughput file's size")
    parser.add_argument(
        "--broker", action="store_true", help="instead: Redis memory per message (REFILL_TEST_REDIS_URL or local Redis)"
    )
    parser.add_argument("--tokens", type=int, default=512, help="with --broker: tokens per completion of a result")
    args = parser.parse_args(argv)
    if args.weights:
        return weights_main(repeat=5, bulk_mib=args.bulk_mib)
    if args.broker:
        url = os.environ.get("REFILL_TEST_REDIS_URL") or "redis://127.0.0.1:6379/0"
        return broker_main(url, count=2000, tokens=args.tokens)
    if args.attempts < 10:
        parser.error("--attempts must be at least 10 (one per tenth)")
    from bench.fill import parse_latency

    latency: Latency = parse_latency(args.latency)
    # Enough steps that the run is still going when the last result is in (extras included).
    steps = math.ceil(args.attempts * (1.0 - args.p) / args.prompts * 1.5) + 10
    scenario = replace(
        ScaleScenario(dataset_size=args.dataset),
        prompts_per_step=args.prompts,
        generations=args.generations,
        p=args.p,
        latency=latency,
        workers=args.workers,
        in_flight=args.in_flight,
        steps=steps,
        max_lookahead_versions=args.lookahead,
    )
    server = args.server or os.environ.get("REFILL_BENCH_PG_URL")
    # A run stopped with SIGTERM still drops its database and stops its own cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.keep and server is None:
        parser.error("--keep needs --server or REFILL_BENCH_PG_URL: the run's own cluster is removed when it ends")
    cluster, workdir = None, None
    if server is None:
        import shutil
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="refill-bench-scale-"))
        cluster = own_server(workdir)
        server = cluster.url
    try:
        return _run(args, scenario, server, own=cluster is not None)
    finally:
        if cluster is not None:
            cluster.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, scenario: Scenario, server: str, *, own: bool) -> int:
    url, handle = temporary_database(server)
    print("refill bench scale: the production ledger on PostgreSQL in virtual time, measured per tenth of the run")
    print(
        f"  {args.attempts} results; N = {args.prompts} prompts/step, n = {args.generations}, p = {args.p}, "
        f"lookahead {args.lookahead}, W x C = {args.workers} x {args.in_flight} in flight, latency {args.latency}, "
        f"consumer window {args.batch_window:g} s, "
        f"data set {args.dataset} prompts (cycled); load average {os.getloadavg()[0]:.2f}"
    )
    where = "a cluster of its own (initdb's defaults)" if own else make_url(server).render_as_string(hide_password=True)
    print(f"  database {make_url(url).database}{' (kept)' if args.keep else ''} on {where}", flush=True)
    if autovacuum_off(url):
        print(
            "  WARNING: this server runs with autovacuum off: the hot tables' dead rows are never reclaimed, so a "
            "long run's cost grows with them as it would on no production server. Use a server with autovacuum on "
            "(leave out --server and REFILL_BENCH_PG_URL to start one).",
            flush=True,
        )
    began = time.perf_counter()
    fleet = None
    try:
        upgrade(url)
        fleet = ScaleFleet(scenario, url, args.attempts, batch_window=args.batch_window)
        fleet.run_to_target()
        print(
            f"{fleet.results} results, {fleet.dispatched} attempts, {fleet.trained_steps} steps trained in "
            f"{time.perf_counter() - began:.0f} s wall ({fleet._ledger_seconds():.0f} s in ledger transactions); "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        print_ops(fleet.tenths)
        print(summary(fleet.tenths))
    finally:
        if fleet is not None:
            fleet.close()
        if not args.keep:
            drop_database(handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
