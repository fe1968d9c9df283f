"""`python -m bench payloads`: the consumer's path with long rollouts, inline and as claim checks.

For each rollout length (`--tokens`, default 8, 512 and 8192 tokens per completion, `--n` 16
completions per group) and each way a group travels (`inline`: in the result message, body
version 1; `files`: the claim check, body version 2, the group in the run's payload store), one
step of `--groups` groups at zero-variance fraction `--p` under dynamic sampling goes through
the real code on a fresh PostgreSQL database (the sim back-end's completions, the same prompts,
rewards and decisions at every length):

worker    what a generation worker does with a finished group before sending it, CPU ms per
          result: `files` checks, packs and stores it (`refill.tasks.claim_checks.claim_check`,
          fsync included), both encode the body to JSON
redis     the bytes Redis holds for a result in flight: the list entry of a lone result
          message (kombu's envelope around the base64 JSON body, headers included), and per
          result of the bundles a worker's ResultSender sends when results finish together;
          measured by sending them through Celery, with refill's settings, to a probe queue
consumer  the results consumer's CPU ms per result: each entry decoded as kombu decodes it
          (JSON envelope, base64, JSON body), then `refill.tasks.consumer.ResultConsumer`
          (the body checked, the batch recorded in one transaction of `--batch`, discarded
          payloads removed); this process's CPU time (all its threads), and beside it its
          PostgreSQL backend's

It ends with `consumer CPU per result 8192/8 tokens: R; redis bytes per result at 8192 tokens: B`
for claim checks (issue 17's targets: R <= 1.5, B <= 4096), R from this process's CPU.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import load_average, process_cpu

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: The application name of the measured consumer's connections (its backends' CPU is read).
CONSUMER_APP = "bench-payloads-consumer"


# --- what Redis holds -----------------------------------------------------------------------


class RedisProbe:
    """Sends result bodies through Celery with refill's settings (as a worker's ResultSender
    does) to a queue nobody consumes, and reads back the list entries Redis holds for them."""

    def __init__(self, redis_url: str) -> None:
        import redis
        from celery import Celery

        from refill.tasks.app import celery_settings

        self.prefix = f"refill-bench-payloads-{uuid.uuid4().hex[:8]}:"
        self.app = Celery("bench-payloads", set_as_current=False)
        self.app.conf.update(celery_settings(redis_url, self.prefix))
        self.client = redis.Redis.from_url(redis_url)

    def entries(self, bodies: list[dict[str, Any]], *, bundled: bool) -> list[bytes]:
        """The Redis entries of these results: each alone, or bundled as ResultSender bundles
        results that finish together (cut at its byte budget)."""
        from kombu import Exchange, Queue

        from refill.tasks.runtime import ResultSender

        queue = f"probe-{uuid.uuid4().hex[:8]}"
        destination = Queue(queue, Exchange("refill-bench-probe", type="direct"), routing_key=queue)
        sender = ResultSender(self.app, max_wait_ms=0)
        try:
            # ResultSender sends to the results queue; the probe reroutes its app's sends.
            original = self.app.send_task

            def to_probe(name, args=None, **options):  # type: ignore[no-untyped-def]
                options.update(queue=destination, routing_key=queue)
                return original(name, args=args, **options)

            self.app.send_task = to_probe  # type: ignore[method-assign]
            if bundled:
                sender._publish(bodies)
            else:
                for body in bodies:
                    sender._publish([body])
        finally:
            self.app.send_task = original  # type: ignore[method-assign]
            sender.close()
        key = self.prefix + queue
        found = list(reversed(self.client.lrange(key, 0, -1)))  # LPUSHed: oldest last
        self.client.delete(key)
        return found

    def close(self) -> None:
        keys = list(self.client.scan_iter(match=self.prefix + "*"))
        if keys:
            self.client.delete(*keys)
        self.client.close()


def entry_bodies(entry: bytes) -> list[dict[str, Any]]:
    """The result bodies of a Redis entry, decoded as kombu and the consumer decode them."""
    envelope = json.loads(entry)
    body = base64.b64decode(envelope["body"]) if envelope["properties"].get("body_encoding") == "base64" else envelope["body"]
    args, _kwargs, _embed = json.loads(body)
    message = args[0]
    return message["bundle"] if isinstance(message, dict) and "bundle" in message else [message]


class QueueSampler:
    """Samples what Redis holds on a results queue while a fleet runs, from a process of its own
    (so that neither its reads nor its decoding count as the bench process's CPU): every
    `interval` seconds, each entry's bytes and how many results it carries."""

    def __init__(self, redis_url: str, key: str, interval: float = 0.05) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._out = context.Queue()
        self._process = context.Process(
            target=_sample_queue, args=(redis_url, key, interval, self._stop, self._out), daemon=True
        )

    def __enter__(self) -> QueueSampler:
        self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.bytes, self.results, self.largest = self._out.get(timeout=60)
        self._process.join(30)

    def line(self) -> str:
        if not self.results:
            return "no result message waited on the queue when sampled"
        return (
            f"{self.bytes / self.results:.0f} B per result waiting on the results queue "
            f"({self.results} sampled), the largest message {self.largest[0]} B for {self.largest[1]} result(s)"
        )


def _sample_queue(redis_url: str, key: str, interval: float, stop: Any, out: Any) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    total = results = 0
    largest = (0, 0)
    while not stop.is_set():
        for entry in client.lrange(key, 0, -1):
            carried = len(entry_bodies(entry))
            total, results = total + len(entry), results + carried
            largest = max(largest, (len(entry), carried))
        stop.wait(interval)
    client.close()
    out.put((total, results, largest))


# --- one length, one store ------------------------------------------------------------------


def run_config(args: argparse.Namespace, tokens: int, store: str, output_dir: str) -> dict[str, Any]:
    return {
        "run": {"seed": 5, "name": "payloads", "output_dir": output_dir},
        "data": {"builtin": "arith", "builtin_size": int(args.groups / (1 - args.p) * 3) + 2 * args.groups},
        "generation": {
            "backend": "sim",
            "max_new_tokens": max(16, tokens),  # the sim back-end stops a completion there
            "lease_seconds": 3600,
            "queue_timeout_seconds": 3600,
            "sim": {
                "zero_variance_fraction": args.p,
                "tokens_per_completion": tokens,
                "vocab_size": 32000,
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
        "async_rl": {"max_lookahead_versions": 1, "over_dispatch": {"enabled": False}},
        "infra": {"trainer": "null", "consumer_batch_size": args.batch, "payloads": {"store": store}},
    }


@dataclass
class Measured:
    store: str
    tokens: int
    results: int
    outcomes: dict[str, int]
    body_bytes: float  # mean JSON body of a lone result
    redis_lone: int  # the largest entry of a lone result
    redis_bundled: float  # bytes per result in bundles
    worker_ms: float
    consumer_ms: float
    consumer_db_ms: float
    consumer_wall_ms: float


def one(url: str, args: argparse.Namespace, tokens: int, store: str, probe: RedisProbe) -> Measured:
    from sqlalchemy import text

    from refill.config import config_from_dict
    from refill.models.admission import admit_steps
    from refill.models.context import utcnow
    from refill.models.dataset import load_dataset
    from refill.models.db import Ledger
    from refill.models.leases import start_attempts
    from refill.models.outbox import claim_outbox, mark_sent
    from refill.models.payload import GenerateMessage, ResultMessage
    from refill.models.payload_store import store_for
    from refill.models.runs import PromptRow, create_run, publish_initial_weights, start_run
    from refill.models.settings import LedgerSettings
    from refill.rewards.loader import load_reward_fn
    from refill.rewards.scoring import score_group
    from refill.tasks.backends.sim import SimEngine
    from refill.tasks.claim_checks import claim_check
    from refill.tasks.consumer import ResultConsumer
    from refill.tasks.setup import format_prompt

    output_dir = tempfile.mkdtemp(prefix="refill-bench-payloads-")
    ledger = Ledger(url, application_name="bench-payloads")
    consumer_ledger = Ledger(url, application_name=CONSUMER_APP)
    try:
        config = config_from_dict(run_config(args, tokens, store, output_dir), name="payloads")
        snapshot = config.snapshot()
        rows = load_dataset(config)

        def create(session):  # type: ignore[no-untyped-def]
            run = create_run(
                session, name="payloads", config=snapshot,
                config_hash=hashlib.sha256(json.dumps(snapshot, sort_keys=True).encode()).hexdigest(),
                prompts=[PromptRow(text=format_prompt(config.data.prompt_template, row), row=row) for row in rows],
                data_fingerprint="bench", output_dir=output_dir,
            )
            session.flush()
            publish_initial_weights(session, run.id, None)
            return run.id, run.run_dir

        run_id, run_dir = ledger.transaction(create)
        ledger.transaction(lambda s: start_run(s, run_id, "bench-controller"))
        ledger.transaction(lambda s: admit_steps(s, run_id))
        def relay(session):  # type: ignore[no-untyped-def]
            out = claim_outbox(session, claimer="bench", now=utcnow(), limit=100_000)
            mark_sent(session, out, utcnow())
            return out

        sent = ledger.transaction(relay)
        messages = [GenerateMessage.from_json(m.body) for m in sent if m.kind == "generate"]
        ledger.transaction(lambda s: start_attempts(s, run_id, [m.attempt_id for m in messages], "bench-worker", 3600, None, 0))

        # The worker's side, outside the consumer's figures.
        engine = SimEngine.from_config(snapshot)
        engine.weight_version = 0
        reward_fn = load_reward_fn("refill.rewards.sim:solved", None)
        payload_store = store_for(config, run_dir)
        settings = LedgerSettings.from_config(config)
        bodies: list[dict[str, Any]] = []
        worker_cpu = 0.0
        for output, message in zip(engine.generate(messages), messages, strict=True):
            result = ResultMessage(
                run_id=run_id, attempt_id=message.attempt_id, worker="bench-worker", weight_version=0,
                prompt_token_ids=output.prompt_token_ids, completions=output.completions,
                rewards=score_group(reward_fn, [c.text for c in output.completions], message.row),
            )
            started = time.process_time()
            if payload_store is not None:
                result = claim_check(result, payload_store, settings, config.infra.max_result_bytes)
            body = result.to_json()
            json.dumps(body)  # Celery encodes it once more when it sends: the worker pays that
            worker_cpu += time.process_time() - started
            bodies.append(body)
            del output, result

        lone = probe.entries(bodies[: args.lone], bundled=False)
        bundled = probe.entries(bodies, bundled=True)
        body_bytes = statistics.mean(len(json.dumps(b)) for b in bodies[: args.lone])
        del bodies

        consumer = ResultConsumer(consumer_ledger, max_batch=args.batch, max_wait_ms=0)
        try:
            # One connection in the pool is the consumer's recording thread's: warm it first.
            consumer_ledger.transaction(lambda s: s.execute(text("select 1")))
            backends = ledger.transaction(
                lambda s: list(s.scalars(text("select pid from pg_stat_activity where application_name = :a"), {"a": CONSUMER_APP}))
            )
            db_started = sum(process_cpu(pid) for pid in backends)
            cpu_started, wall_started = time.process_time(), time.perf_counter()
            # As the consumer's task threads receive them: each message decoded in its own
            # thread, the results batched by the recording thread.
            with ThreadPoolExecutor(max_workers=64) as pool:
                answers = list(pool.map(lambda entry: consumer.submit({"bundle": entry_bodies(entry)}), bundled))
            consumer._remover.flush(60)
            consumer_cpu = time.process_time() - cpu_started
            consumer_wall = time.perf_counter() - wall_started
            consumer_db = sum(process_cpu(pid) for pid in backends) - db_started
        finally:
            consumer.close()
        outcomes: dict[str, int] = {}
        for outcome in " ".join(answers).split():
            name, count = outcome.rsplit("x", 1)
            outcomes[name] = outcomes.get(name, 0) + int(count)
        results = sum(outcomes.values())
        return Measured(
            store=store, tokens=tokens, results=results, outcomes=outcomes, body_bytes=body_bytes,
            redis_lone=max(len(e) for e in lone), redis_bundled=sum(len(e) for e in bundled) / results,
            worker_ms=worker_cpu * 1000 / results, consumer_ms=consumer_cpu * 1000 / results,
            consumer_db_ms=consumer_db * 1000 / results, consumer_wall_ms=consumer_wall * 1000 / results,
        )
    finally:
        consumer_ledger.dispose()
        ledger.dispose()
        shutil.rmtree(output_dir, ignore_errors=True)


# --- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench payloads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8,512,8192", help="tokens per completion, comma-separated")
    parser.add_argument("--stores", default="inline,files", help="infra.payloads.store values, comma-separated")
    parser.add_argument("--groups", type=int, default=64, help="N, groups of the step (results measured per round)")
    parser.add_argument("--n", type=int, default=16, help="completions per group")
    parser.add_argument("--p", type=float, default=0.33, help="zero-variance fraction")
    parser.add_argument("--batch", type=int, default=64, help="results per consumer transaction")
    parser.add_argument("--lone", type=int, default=8, help="results sent alone to measure a lone message")
    parser.add_argument("--repeat", type=int, default=2, help="rounds (medians printed)")
    parser.add_argument(
        "--warmup", type=int, default=1,
        help="unmeasured rounds first, at the shortest length (imports, caches, connections)",
    )
    parser.add_argument("--redis-url", default=os.environ.get("REFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from refill.models.migrate import upgrade
    from tests.support.databases import temporary_pg_database

    lengths = [int(t) for t in args.tokens.split(",")]
    stores = args.stores.split(",")
    print(
        f"payloads: one step of {args.groups} groups of {args.n} completions, p={args.p}, consumer batches of "
        f"{args.batch}, tokens per completion {lengths}, stores {stores}, {os.cpu_count()} CPUs, load average {load_average()}",
        flush=True,
    )
    probe = RedisProbe(args.redis_url)
    rounds: dict[tuple[str, int], list[Measured]] = {}
    try:
        for _ in range(args.warmup):
            for store in stores:
                with temporary_pg_database("refill_bench_payloads") as url:
                    upgrade(url)
                    one(url, args, min(lengths), store, probe)
        for i in range(args.repeat):
            for tokens in lengths:
                # Alternate which store goes first: neither always meets a warmer machine.
                for store in stores if i % 2 == 0 else stores[::-1]:
                    with temporary_pg_database("refill_bench_payloads") as url:
                        upgrade(url)
                        m = one(url, args, tokens, store, probe)
                    rounds.setdefault((store, tokens), []).append(m)
                    print(
                        f"  round {i + 1} {store:6} {tokens:5d} tokens: {m.results} results {m.outcomes}; consumer "
                        f"{m.consumer_ms:.2f} ms CPU (+{m.consumer_db_ms:.2f} database) per result; redis "
                        f"{m.redis_lone} B lone   load {load_average()}",
                        flush=True,
                    )
    finally:
        probe.close()
    print()
    header = (
        f"{'store':8}{'tokens':>7}{'body KB':>10}{'redis B lone':>14}{'B bundled':>11}{'worker ms':>11}"
        f"{'consumer CPU ms':>17}{'database ms':>13}{'wall ms':>9}"
    )
    print(header + "   (per result, medians of rounds)")
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for (store, tokens), ms in rounds.items():
        row = {
            name: statistics.median(getattr(m, name) for m in ms)
            for name in ("body_bytes", "redis_lone", "redis_bundled", "worker_ms", "consumer_ms", "consumer_db_ms", "consumer_wall_ms")
        }
        medians[(store, tokens)] = row
        print(
            f"{store:8}{tokens:7d}{row['body_bytes'] / 1024:10.1f}{row['redis_lone']:14.0f}{row['redis_bundled']:11.0f}"
            f"{row['worker_ms']:11.2f}{row['consumer_ms']:17.2f}{row['consumer_db_ms']:13.2f}{row['consumer_wall_ms']:9.2f}"
        )
    print(f"load average after: {load_average()}")
    low, high = min(lengths), max(lengths)
    claim = "files" if "files" in stores else stores[0]
    if (claim, low) in medians and (claim, high) in medians:
        ratio = medians[(claim, high)]["consumer_ms"] / medians[(claim, low)]["consumer_ms"]
        redis_bytes = medians[(claim, high)]["redis_lone"]
        print(f"consumer CPU per result {high}/{low} tokens: {ratio:.2f}; redis bytes per result at {high} tokens: {redis_bytes:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
