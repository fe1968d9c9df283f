"""`python -m bench overhead`: the ledger time one large step costs the controller side.

One step of `--groups` (4096) groups at zero-variance fraction `--p` (0.33), with zero
generation latency, driven through the ledger API in this process on a fresh PostgreSQL
database (no broker, no workers), the way the fleet's roles call it:

admission   `admit_steps` (the controller): the step's slots, first attempts and extras
            (adaptive over-dispatch), and the spare pool
relay       `claim_outbox` + `mark_sent` (the relay), every generate message of the step,
            replacements included, `--relay-batch` rows per transaction (the controller's
            relay takes up to 1000; the consumer relays what each batch wrote), passes until
            one sends fewer than that (everything due was sent)
record      `record_results` (the consumer), `--batch` results per transaction (the
            consumer's group commit: `infra.consumer_batch_size`, 64), excluding the step's
            release
release     the barrier's release inside the last batch: `maybe_release` minus its metrics
metrics     `record_release_metrics` (part of the release transaction)

Printed beside them, not part of the total: the generation workers' lease handshakes
(`start_attempts`, one transaction per bundle of up to 8 attempts, in the workers' processes) and the trainer's
`claim_training` (the ledger's claim of the released batch, target <= 0.2 s) and, apart, the
reading and checking of its stored payloads (claim checks) that the trainer does after the claim.

How a group travels (`--payload-store`, `infra.payloads.store`): `files` (the default) stores
it in the run's payload store in the worker (`refill.tasks.claim_checks.claim_check`, outside the
timers) and the consumer records a claim check of a few hundred bytes, removing the payloads it
discards after its commit (inside the record phase); `inline` sends it in the result message.
Printed after the phases: the consumer's CPU ms per result (the record phase: decoding,
recording, removing) and the Redis bytes of a result in flight (a sample of the results sent
through Celery to a probe queue, as `python -m bench payloads` measures them; skipped when
Redis cannot be reached).

Results come from the `sim` back-end's model (prompt difficulty, n completions of
`tokens_per_completion` tokens, `refill.rewards.sim:solved`), made outside the timers. `--profile`
prints the top functions (cumulative time) of the record phase, where the time goes; `--parts`
the record phase's lock, read, decisions and write, each by wall and CPU time (`bench/parts.py`). `--rtt-ms`
makes every SQL round trip wait that long first, as for a ledger on another host (what saving a
round trip is worth only shows at that price).

The floor (`bench/floor.py`), measured in each round: every row the step's transactions wrote
(read back after each commit, outside the timers) written again into a scratch database with
the same schema by the simplest bulk SQL, with no decisions, one transaction for each of the
step's: per table one Core insert of a list of dicts and one `UPDATE ... FROM unnest(...)` per
set of changed columns. Printed per phase beside the controller overhead, with
`controller overhead / floor`.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from bench.floor import ChangeLog, Floor, describe, replay
from bench.machine import cpu_ticks, load_average, process_cpu, steal_since
from bench.parts import Parts, print_parts

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    prompts = int(args.groups / (1 - args.p) * 1.6) + 3 * args.groups
    return {
        "run": {"seed": 5, "name": "overhead", "output_dir": OUTPUT_DIR},
        "data": {"builtin": "arith", "builtin_size": prompts},
        "generation": {
            "backend": "sim",
            "max_new_tokens": max(16, args.tokens),  # the sim back-end stops a completion there
            "lease_seconds": LEASE_SECONDS,
            "queue_timeout_seconds": 3600,
            "sim": {
                "zero_variance_fraction": args.p,
                "tokens_per_completion": args.tokens,
                "latency": {"distribution": "constant", "mean_seconds": 0.0},
            },
        },
        "reward": {"function": "refill.rewards.sim:solved"},
        "grpo": {
            "num_prompts_per_step": args.groups,
            "num_generations_per_prompt": args.n,
            "max_num_steps": 1,
            "max_num_epochs": None,
            "use_dynamic_sampling": True,
        },
        "async_rl": {"max_lookahead_versions": 1, "over_dispatch": {"enabled": not args.no_over_dispatch}},
        "infra": {"trainer": "null", "payloads": {"store": args.payload_store}},
    }


#: The runs' directory (their payload stores); emptied after each round.
OUTPUT_DIR = "/tmp/refill-bench-overhead"


PHASE = [""]
#: the run's lease length
LEASE_SECONDS = 600


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (the ledger's PostgreSQL backends)."""
    return sum(process_cpu(pid) for pid in pids)


class Timers:
    """Wall time, this process's CPU time and the database backends' CPU time, per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.db_cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.backends: list[int] = []

    @contextmanager
    def time(self, name: str):  # type: ignore[no-untyped-def]
        # Nested (the release's metrics inside a batch): the outer phase goes on after it.
        outer, PHASE[0] = PHASE[0], name
        db_started = cpu_seconds(self.backends)
        cpu_started = time.process_time()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started
            self.cpu[name] += time.process_time() - cpu_started
            self.db_cpu[name] += cpu_seconds(self.backends) - db_started
            self.calls[name] += 1
            PHASE[0] = outer


def one_step(
    url: str, args: argparse.Namespace, profile: cProfile.Profile | None, phase: str | None = None
) -> tuple[Timers, dict[str, int], list[dict[str, Any]], ChangeLog]:
    from refill.config import config_from_dict
    from refill.models import metrics as metrics_module
    from refill.models import slots as slots_module
    from refill.models.admission import admit_steps
    from refill.models.dataset import load_dataset
    from refill.models.db import Ledger, make_engine
    from refill.models.leases import start_attempts
    from refill.models.outbox import claim_outbox, mark_sent
    from refill.models.payload import GenerateMessage, ResultMessage
    from refill.models.payload_store import FileStore, store_for
    from refill.models.results import Outcome, record_results
    from refill.models.runs import PromptRow, create_run, publish_initial_weights, start_run
    from refill.models.settings import LedgerSettings
    from refill.models.training import claim_training
    from refill.rewards.loader import load_reward_fn
    from refill.rewards.scoring import score_group
    from refill.tasks.backends.sim import SimEngine
    from refill.tasks.claim_checks import claim_check
    from refill.tasks.relay import GENERATE_BUNDLE
    from refill.tasks.setup import format_prompt

    timers = Timers()
    ledger = Ledger(url)
    # Its own connection: reading the rows back never touches the timed backend.
    log = ChangeLog(make_engine(url))
    statements: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    if args.statements:
        from sqlalchemy import event

        @event.listens_for(ledger.engine, "before_cursor_execute")
        def before(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
            conn.info["bench_started"] = time.perf_counter()

        @event.listens_for(ledger.engine, "after_cursor_execute")
        def after(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
            phase = current_phase[0]
            if phase:
                # Head and tail: statements on one table share their column list, and differ
                # in their WHERE, ORDER BY and LIMIT.
                flat = " ".join(statement.split())
                entry = statements[f"{phase}: {flat[:70]} ... {flat[-70:]}" if len(flat) > 150 else f"{phase}: {flat}"]
                entry[0] += 1
                entry[1] += time.perf_counter() - conn.info.pop("bench_started", time.perf_counter())
                entry[2] += len(parameters) if executemany else 1

    current_phase = PHASE
    raw = run_config(args)
    config = config_from_dict(raw, name="overhead")
    snapshot = config.snapshot()
    rows = load_dataset(config)
    prompts = [PromptRow(text=format_prompt(config.data.prompt_template, row), row=row) for row in rows]

    def create(session):  # type: ignore[no-untyped-def]
        run = create_run(
            session,
            name="overhead",
            config=snapshot,
            config_hash=hashlib.sha256(json.dumps(snapshot, sort_keys=True).encode()).hexdigest(),
            prompts=prompts,
            data_fingerprint="bench",
            output_dir=OUTPUT_DIR,
        )
        session.flush()
        publish_initial_weights(session, run.id, None)
        return run.id, run.run_dir

    run_id, run_dir = ledger.transaction(create)
    log.capture("setup")
    payload_store = store_for(config, run_dir)
    settings = LedgerSettings.from_config(config)
    # The pool hands this single thread the same connection every time; read its backend's CPU.
    from sqlalchemy import text

    timers.backends = [ledger.transaction(lambda s: s.execute(text("select pg_backend_pid()")).scalar_one())]
    ledger.transaction(lambda s: start_run(s, run_id, "bench-controller"))
    log.capture("setup")
    engine = SimEngine.from_config(snapshot)
    engine.weight_version = 0
    reward_fn = load_reward_fn("refill.rewards.sim:solved", None)

    # Time the release's metrics apart from the rest of the release.
    real_metrics = metrics_module.record_release_metrics

    def timed_metrics(ctx, step):  # type: ignore[no-untyped-def]
        with timers.time("metrics"):
            return real_metrics(ctx, step)

    metrics_module.record_release_metrics = timed_metrics
    real_release = slots_module.maybe_release

    def timed_release(ctx, step):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        released = real_release(ctx, step)
        if released:
            timers.seconds["release"] += time.perf_counter() - started
        return released

    slots_module.maybe_release = timed_release
    counts: dict[str, int] = defaultdict(int)
    samples: list[dict[str, Any]] = []  # result bodies, for the Redis bytes of one in flight
    try:
        if profile is not None and phase == "admission":
            profile.enable()
        with timers.time("admission"):
            admitted = ledger.transaction(lambda s: admit_steps(s, run_id))
        if profile is not None and phase == "admission":
            profile.disable()
        log.capture("admission")
        assert admitted.steps == [0], admitted.steps
        pending: list[dict[str, Any]] = []  # generate messages relayed, not yet finished
        while True:
            # relay everything due
            while True:
                if profile is not None and phase == "relay":
                    profile.enable()
                with timers.time("relay"):
                    sent = ledger.transaction(
                        lambda s: _relay(s, claim_outbox, mark_sent, args.relay_batch, run_id)
                    )
                if profile is not None and phase == "relay":
                    profile.disable()
                log.capture("relay")
                counts["messages"] += len(sent)
                pending.extend(m.body for m in sent if m.kind == "generate")
                counts["train_step messages"] += sum(1 for m in sent if m.kind == "train_step")
                # A pass that sent fewer than its limit sent everything due: another would find
                # nothing. The fleet's consumer relays what its batch wrote in one pass; a
                # pass here that finds nothing is a cost the fleet does not pay per batch.
                if len(sent) < args.relay_batch:
                    break
            if counts["train_step messages"]:
                break
            if not pending:
                raise RuntimeError("nothing in flight and the step is not released")
            batch, pending = pending[: args.batch], pending[args.batch :]
            results = []
            messages = [GenerateMessage.from_json(body) for body in batch]
            # As a worker leases a bundle (the relay sends up to 8 attempts per message): one
            # transaction per bundle.
            for first in range(0, len(messages), GENERATE_BUNDLE):
                bundle = messages[first : first + GENERATE_BUNDLE]
                if profile is not None and phase == "lease":
                    profile.enable()
                with timers.time("lease handshakes"):
                    leases = ledger.transaction(
                        lambda s, ids=[m.attempt_id for m in bundle]: start_attempts(
                            s, run_id, ids, "bench-worker", LEASE_SECONDS, None, 0
                        )
                    )
                if profile is not None and phase == "lease":
                    profile.disable()
                for message in bundle:
                    if message.attempt_id not in leases:
                        continue
                    output = engine.generate([message])[0]
                    rewards = score_group(reward_fn, [c.text for c in output.completions], message.row)
                    result = ResultMessage(
                        run_id=run_id,
                        attempt_id=message.attempt_id,
                        worker="bench-worker",
                        weight_version=0,
                        prompt_token_ids=output.prompt_token_ids,
                        completions=output.completions,
                        rewards=rewards,
                    )
                    if payload_store is not None:
                        result = claim_check(result, payload_store, settings, config.infra.max_result_bytes)
                    results.append(result.to_json())
                    if len(samples) < SAMPLES:
                        samples.append(results[-1])
            log.capture("lease handshakes")  # the batch's bundles together: not part of the floor
            if not results:
                continue
            # The consumer decodes each body it receives; decoding is part of its cost.
            before = timers.seconds["release"]
            if profile is not None and phase == "record":
                profile.enable()
            with timers.time("record"):
                decoded = [ResultMessage.from_json(r) for r in results]
                recorded = ledger.transaction(lambda s, d=decoded: record_results(s, d))
                # What the consumer's remover thread does after the commit.
                FileStore.of_run(run_dir).remove(name for _, name in recorded.discarded)
            if profile is not None and phase == "record":
                profile.disable()
            log.capture("record")
            timers.seconds["record"] -= timers.seconds["release"] - before
            for outcome in recorded.outcomes:
                counts[outcome.outcome.value] += 1
            counts["results"] += len(recorded.outcomes)
            counts["completions"] += sum(len(_lengths(r)) for r in decoded)
            counts["completion tokens"] += sum(sum(_lengths(r)) for r in decoded)
            counts["record batches"] += 1
        # The claim is the ledger's (who trains the step, which groups); reading the groups'
        # stored payloads is the trainer's data loading, after the claim's transaction, and
        # timed apart (with inline groups it is nothing: the claim decoded them).
        with timers.time("trainer claim"):
            batch = ledger.transaction(lambda s: claim_training(s, run_id, 0, "bench-trainer"))
        log.capture("trainer claim")
        with timers.time("payload read"):
            assert batch is not None and len(batch.groups) == args.groups, "the step did not release whole"
        counts["trained groups"] = len(batch.groups)
        assert counts[Outcome.COMMITTED.value] >= args.groups
    finally:
        metrics_module.record_release_metrics = real_metrics
        slots_module.maybe_release = real_release
        timers.seconds["release"] -= timers.seconds["metrics"]
        ledger.dispose()
        log.engine.dispose()
    if statements:
        print("statements by phase (this round): executions, parameter sets, seconds in the driver (server included)")
        for key, (number, seconds, rows) in sorted(statements.items(), key=lambda kv: -kv[1][1]):
            print(f"  {number:7d} {rows:7d} {seconds:7.3f}  {key}")
    return timers, counts, samples, log


def _lengths(result: Any) -> list[int]:
    """Each completion's length, of a result inline or a claim check."""
    lengths = getattr(result, "lengths", None)
    return lengths if lengths is not None else [len(c.token_ids) for c in result.completions]


#: Result bodies sent through Celery to measure what Redis holds for one in flight.
SAMPLES = 64


def _relay(session, claim_outbox, mark_sent, limit, run_id):  # type: ignore[no-untyped-def]
    from refill.models.context import utcnow

    now = utcnow()
    # As the controller's relay (refill.tasks.relay): the run's due messages, marked sent in
    # this transaction, no claim first.
    sent = claim_outbox(session, claimer="bench-relay", now=now, limit=limit, run_id=run_id, claim_seconds=None)
    mark_sent(session, sent, now)
    return sent


def simulate_round_trip(seconds: float) -> None:
    """Make every SQL round trip of this process wait `seconds` first (`--rtt-ms`): a
    loopback connection costs about 0.1 ms a round trip, a ledger on another host several
    times that, and what a change saves in round trips only shows at that price. One wait per
    cursor execute (an executemany is pipelined: one round trip), none for a statement sent in
    the round trip of the one before it (`driver.execute_pipelined`), and one per commit."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from refill.models.driver import PIPELINED

    def wait(conn: Any, *_args: Any, **_kw: Any) -> None:
        if not conn.info.get(PIPELINED):
            time.sleep(seconds)

    event.listen(Engine, "before_cursor_execute", wait)
    event.listen(Engine, "commit", wait)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4096, help="N, groups of the step")
    parser.add_argument("--p", type=float, default=0.33, help="zero-variance fraction")
    parser.add_argument("--n", type=int, default=16, help="completions per group")
    parser.add_argument(
        "--tokens", type=int, default=8, help="tokens per completion (the sim back-end's default 8; real rollouts run to thousands)"
    )
    parser.add_argument("--batch", type=int, default=64, help="results per consumer transaction")
    parser.add_argument("--relay-batch", type=int, default=1000, help="messages per relay transaction")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-over-dispatch", action="store_true", help="turn adaptive over-dispatch off")
    parser.add_argument(
        "--payload-store", choices=["files", "inline"], default="files",
        help="infra.payloads.store: claim checks (files) or groups in the result message (inline)",
    )
    parser.add_argument("--redis-url", default=os.environ.get("REFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument(
        "--profile", nargs="?", const="record", default=None,
        help="profile one phase of the last round with cProfile: record (default), admission, relay, lease",
    )
    parser.add_argument("--profile-out", default=None, help="also write the profile to this file (for pstats/snakeviz)")
    parser.add_argument("--statements", action="store_true", help="count SQL statements per phase")
    parser.add_argument("--parts", action="store_true", help="time the record phase's parts (bench/parts.py)")
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0,
        help="simulated network latency: every SQL round trip (a statement, an executemany, a "
        "commit) of this process first waits this long, as for a ledger on another host; the floor pays it too",
    )
    parser.add_argument("--target", type=float, default=2.0, help="seconds")
    return parser.parse_args(argv)


PHASES = ("admission", "relay", "record", "release", "metrics")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from refill.models.migrate import upgrade
    from tests.support.databases import temporary_pg_database

    print(
        f"overhead: one step of {args.groups} groups, p={args.p}, n={args.n} x {args.tokens} tokens, consumer batches of "
        f"{args.batch}, PostgreSQL, {os.cpu_count()} CPUs, load average {load_average()}"
        + (f", a simulated round trip of {args.rtt_ms:g} ms" if args.rtt_ms > 0 else ""),
        flush=True,
    )
    if args.rtt_ms > 0:
        simulate_round_trip(args.rtt_ms / 1000.0)
    # The controller side runs in worker processes (the consumer, the relay): their garbage
    # collector's settings, as `refill worker` sets them.
    from refill.tasks.runtime import tune_collector

    tune_collector()
    rounds: list[Timers] = []
    # CPU time, not wall time: waits on the database (and on other processes for a core) drop out.
    profile = cProfile.Profile(time.process_time) if args.profile else None
    counts: dict[str, int] = {}
    samples: list[dict[str, Any]] = []
    floors: list[Floor] = []
    part_rounds: list[tuple[Parts, float, float, int]] = []
    for i in range(args.repeat):
        ticks = cpu_ticks()
        with temporary_pg_database("refill_bench_overhead") as url:
            upgrade(url)
            parts = Parts(lambda: PHASE[0] in ("record", "metrics"))
            try:
                with parts.installed() if args.parts else nullcontext():
                    timers, counts, samples, log = one_step(url, args, profile if i == args.repeat - 1 else None, args.profile)
            finally:
                shutil.rmtree(OUTPUT_DIR, ignore_errors=True)
        # A database of its own, after the step: the floor neither shares the step's tables
        # nor runs beside it.
        with temporary_pg_database("refill_bench_floor") as scratch:
            upgrade(scratch)
            floors.append(replay(scratch, log.changes))
        rounds.append(timers)
        if args.parts:
            record = sum(timers.seconds[p] for p in ("record", "release", "metrics"))
            part_rounds.append((parts, record, timers.cpu["record"], counts["record batches"]))
        total = sum(timers.seconds[p] for p in PHASES)
        cpu = sum(timers.cpu[p] + timers.db_cpu[p] for p in PHASES)
        print(
            f"  round {i + 1}: total {total:.2f} s wall, {cpu:.2f} s CPU (this process + its "
            f"database backend)  ("
            + ", ".join(f"{p} {timers.seconds[p]:.2f}" for p in PHASES)
            + f")  lease handshakes {timers.seconds['lease handshakes']:.2f} s, trainer claim "
            f"{timers.seconds['trainer claim']:.2f} s (+ its payloads read {timers.seconds['payload read']:.2f} s)   "
            f"load {load_average()}, {steal_since(ticks)}",
            flush=True,
        )
        print(
            f"  round {i + 1} floor: "
            + ", ".join(f"{p} {floors[-1].seconds[p]:.2f}" for p in FLOOR_PHASES)
            + f" s (reading the step's rows back, untimed: {log.seconds:.1f} s)",
            flush=True,
        )
    print()
    print(
        f"results recorded {counts['results']} ({counts.get('COMMITTED', 0)} committed, "
        f"{counts.get('FILTERED', 0)} filtered, {counts.get('FAILED', 0)} failed) in "
        f"{counts['record batches']} batches; messages relayed {counts['messages']}; "
        f"{counts['completion tokens'] / max(1, counts['completions']):.1f} tokens per completion"
    )
    results = counts["results"]
    print(f"{'phase (median of rounds)':30}{'wall s':>9}{'per result ms':>15}{'CPU s: bench':>14}{'db':>7}")

    def row(name: str, phases: tuple[str, ...], note: str = "") -> float:
        wall = statistics.median(sum(t.seconds[p] for p in phases) for t in rounds)
        cpu = statistics.median(sum(t.cpu[p] for p in phases) for t in rounds)
        db = statistics.median(sum(t.db_cpu[p] for p in phases) for t in rounds)
        print(f"{name:30}{wall:9.3f}{wall / results * 1000:15.3f}{cpu:14.3f}{db:7.3f}{note}")
        return wall

    for phase in PHASES:
        row(phase, (phase,))
    total = statistics.median(sum(t.seconds[p] for p in PHASES) for t in rounds)
    verdict = "met" if total <= args.target else f"NOT met (over by {total - args.target:.2f} s)"
    row("controller overhead", PHASES, f"   target <= {args.target:.1f} s wall: {verdict}")
    for extra in ("lease handshakes", "trainer claim"):
        row(extra + " (not counted)", (extra,))
    claim = statistics.median(t.seconds["trainer claim"] for t in rounds)
    row("payloads read (not counted)", ("payload read",), f"   claim target <= 0.2 s: {'met' if claim <= 0.2 else 'NOT met'}")
    print_floor(rounds, floors)
    if part_rounds:
        print_parts(part_rounds)
    consumer_cpu = statistics.median(t.cpu["record"] for t in rounds)
    print(
        f"consumer CPU per result (record phase: decode, record, remove discarded payloads): "
        f"{consumer_cpu / results * 1000:.2f} ms ({args.payload_store})"
    )
    print(f"redis bytes per result in flight: {_redis_bytes(args.redis_url, samples)}")
    print(f"load average after: {load_average()}")
    if profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        if args.profile_out:
            stats.dump_stats(args.profile_out)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(45)
        print(f"\nprofile of the {args.profile} phase (last round), by cumulative time:")
        print(out.getvalue())
    return 0


#: The floor's phases, and the measured phases each stands beside (the release and its metrics
#: run inside the last record transaction, so their rows are in its floor).
FLOOR_PHASES = {"admission": ("admission",), "relay": ("relay",), "record": ("record", "release", "metrics")}


def print_floor(rounds: list[Timers], floors: list[Floor]) -> None:
    print(
        "floor: the rows each phase wrote, written again by plain bulk SQL with no decisions "
        "(a scratch database, one transaction for each of the step's that wrote)"
    )
    print(
        f"  {'phase (median of rounds)':28}{'overhead s':>11}{'floor s':>9}{'ratio':>7}{'floor CPU s: bench':>20}{'db':>7}"
        f"{'transactions':>13}{'statements':>11}  rows: +inserted ~updated -deleted =written unchanged (not replayed)"
    )
    ratios = []
    for name, phases in FLOOR_PHASES.items():
        overhead = statistics.median(sum(t.seconds[p] for p in phases) for t in rounds)
        floor = statistics.median(f.seconds[name] for f in floors)
        cpu = statistics.median(f.cpu[name] for f in floors)
        db = statistics.median(f.db_cpu[name] for f in floors)
        label = name if len(phases) == 1 else f"{name} (+ {', '.join(phases[1:])})"
        ratios.append(f"{name} {overhead / floor:.2f}" if floor else f"{name} -")
        print(
            f"  {label:28}{overhead:11.3f}{floor:9.3f}{(overhead / floor if floor else 0):7.2f}{cpu:20.3f}{db:7.3f}"
            f"{floors[-1].transactions[name]:13d}{floors[-1].statements[name]:11d}  {describe(floors[-1].rows[name])}"
        )
    overhead = statistics.median(sum(t.seconds[p] for p in PHASES) for t in rounds)
    floor = statistics.median(sum(f.seconds[p] for p in FLOOR_PHASES) for f in floors)
    print(f"controller overhead / floor: {overhead / floor:.2f} ({overhead:.2f} s / {floor:.2f} s; {', '.join(ratios)})")
    # CPU seconds do not count the waits for a core, so on a loaded machine they are the steadier figure.
    cpu = statistics.median(sum(t.cpu[p] + t.db_cpu[p] for p in PHASES) for t in rounds)
    floor_cpu = statistics.median(sum(f.cpu[p] + f.db_cpu[p] for p in FLOOR_PHASES) for f in floors)
    print(
        f"CPU (this process + its database backend), controller / floor: {cpu / floor_cpu:.2f} "
        f"({cpu:.2f} s / {floor_cpu:.2f} s)"
    )


def _redis_bytes(redis_url: str, samples: list[dict[str, Any]]) -> str:
    from bench.payloads import RedisProbe

    try:
        probe = RedisProbe(redis_url)
        try:
            lone = probe.entries(samples, bundled=False)
            bundled = probe.entries(samples, bundled=True)
        finally:
            probe.close()
    except Exception as error:  # noqa: BLE001 - a figure beside the bench's, not its subject
        return f"not measured ({type(error).__name__}: {error})"
    return (
        f"{max(len(e) for e in lone)} B the largest lone message, {sum(len(e) for e in bundled) / len(samples):.0f} B "
        f"per result bundled ({len(samples)} results sampled)"
    )


if __name__ == "__main__":
    sys.exit(main())
