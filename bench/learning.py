"""`python -m bench learning`: what dynamic sampling buys, and what pre-rollout skipping adds, on
the tiny arithmetic model trained on the CPU.

Three arms on the same seeds, each a real run of the production ledger (SQLite), the `hf`
back-end and the torch trainer, driven in one thread so that every arm sees the same sequence
of events (no fleet timing):

- `grpo`: GRPO without dynamic sampling (zero-variance groups are trained, with no signal);
- `ds`: with dynamic sampling (zero-variance groups filtered and replaced);
- `skip`: dynamic sampling plus `data.prompt_skipping` (GRESO's defaults).

Every arm trains `S` steps of `N` prompts x `n` completions on a data set of `D` arithmetic
prompts small enough to be revisited many times (`grpo.max_num_epochs: null` cycles it), from
the same warm-started weights. Over-dispatch is off: in a loop with no fleet latency its extras
would only add generations. The loop: admit, relay, generate the queued attempts in batches
with the newest weights, record the results, and train each released step at once.

Printed per arm and step: trained reward, first-attempt reward (each slot's first group: what
GRPO without dynamic sampling sees) and generated tokens so far; per arm: the last 5 steps'
means, tokens, and the final weights' mean reward over the whole data set (`eval`, `n`
samples per prompt: unbiased by which prompts an arm chose to generate). A PNG shows both
rewards per step and first-attempt reward against generated tokens. The last line:

    skip vs ds: tokens T% of ds, first-attempt reward gap G

T = the skip arm's generated tokens over the ds arm's for the same trained steps (x 100);
G = ds's last-5-step first-attempt reward minus skip's (targets: T <= 75, G <= 0.03). Skipping
generates fewer of the prompts the model always solves, so its first attempts are harder ones:
G measures that selection as well as learning; `eval` does not.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select

from refill.admin.progress_queries import step_metrics
from refill.config import config_from_dict
from refill.models.admission import admit_steps
from refill.models.context import utcnow
from refill.models.db import Ledger
from refill.models.leases import start_attempt
from refill.models.outbox import claim_outbox, mark_sent
from refill.models.payload import GenerateMessage, GenerationRequest, ResultMessage
from refill.models.results import record_results
from refill.models.runs import start_run
from refill.models.tables import Prompt, Run, WeightVersion
from refill.rewards.loader import load_reward_fn
from refill.rewards.scoring import score_group
from refill.tasks.backends.hf import HFEngine
from refill.tasks.setup import create_run_from_config
from refill.trainer.service import TrainerService

ARMS = ("grpo", "ds", "skip")


def arm_config(arm: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    return {
        "run": {"name": f"learning-{arm}", "seed": args.seed, "output_dir": str(workdir / "runs")},
        "data": {
            "builtin": "arith",
            "builtin_size": args.dataset,
            "prompt_skipping": {"enabled": arm == "skip"},
        },
        "model": {
            "name_or_path": "builtin:tiny-arith",
            "warm_start": {"enabled": True, "steps": args.warm_start_steps, "cache_dir": args.cache_dir},
        },
        "generation": {"backend": "hf", "temperature": 1.0, "max_new_tokens": 4, "hf": {"device": "cpu"}},
        "reward": {"function": "refill.rewards.arith:exact_match"},
        "grpo": {
            "num_prompts_per_step": args.prompts,
            "num_generations_per_prompt": args.generations,
            "max_num_steps": args.steps,
            "max_num_epochs": None,
            "use_dynamic_sampling": arm != "grpo",
            "dynamic_sampling_max_replacements_per_slot": 256,
        },
        "optimizer": {"lr": args.lr, "warmup_steps": 5, "scheduler": "constant"},
        "async_rl": {"max_lookahead_versions": 1, "over_dispatch": {"enabled": False}},
        "infra": {"trainer": "torch", "database_url": f"sqlite:///{workdir}/{arm}.db"},
    }


@dataclass
class Arm:
    name: str
    steps: list[dict[str, Any]] = field(default_factory=list)  # step_metrics rows, in order
    eval_reward: float = float("nan")
    seconds: float = 0.0

    def tokens(self, steps: int) -> int:
        return sum(int(r["generated_tokens"] or 0) for r in self.steps[:steps])

    def last(self, key: str, window: int = 5) -> float:
        values = [r[key] for r in self.steps[-window:] if r[key] is not None]
        return statistics.fmean(values) if values else float("nan")


def run_arm(arm: str, args: argparse.Namespace, workdir: Path) -> Arm:
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    config = config_from_dict(arm_config(arm, args, workdir))
    ledger = Ledger(config.infra.database_url)
    run_id = create_run_from_config(ledger, config)
    ledger.transaction(lambda s: start_run(s, run_id, "bench-controller"))
    engine = HFEngine.from_config(config)
    reward_fn = load_reward_fn(config.reward.function, config.reward.kwargs)
    trainer = TrainerService(ledger, trainer_id="bench-trainer")
    queue: deque[GenerateMessage] = deque()

    def relay() -> list[int]:
        def go(session: Any) -> list[Any]:
            sent = claim_outbox(session, claimer="bench", now=utcnow(), limit=100_000, run_id=run_id)
            mark_sent(session, sent, utcnow())
            return sent

        steps = []
        for message in ledger.transaction(go):
            if message.queue == "generate":
                queue.append(GenerateMessage.from_json(message.body))
            else:
                steps.append(int(message.body["step"]))
        return steps

    def newest_weights(session: Any) -> tuple[int, str | None]:
        version, path = session.execute(
            select(WeightVersion.version, WeightVersion.path)
            .where(WeightVersion.run_id == run_id)
            .order_by(WeightVersion.version.desc())
            .limit(1)
        ).one()
        return version, path

    def generate(batch: list[GenerateMessage]) -> None:
        version, path = ledger.transaction(newest_weights)
        if engine.weight_version != version:
            engine.load_weights(version, path)
        leases = ledger.transaction(
            lambda s: [start_attempt(s, m.attempt_id, "bench-worker", utcnow(), version) for m in batch]
        )
        ours = [m for m, lease in zip(batch, leases, strict=True) if lease is not None]
        results = []
        for message, output in zip(ours, engine.generate(ours), strict=True):
            if isinstance(output, Exception):
                raise output
            results.append(
                ResultMessage(
                    run_id=run_id,
                    attempt_id=message.attempt_id,
                    worker="bench-worker",
                    weight_version=version,
                    prompt_token_ids=output.prompt_token_ids,
                    completions=output.completions,
                    rewards=score_group(reward_fn, [c.text for c in output.completions], message.row),
                )
            )
        if results:
            ledger.transaction(lambda s: record_results(s, results, utcnow()))

    try:
        ledger.transaction(lambda s: admit_steps(s, run_id))
        pending = relay()
        while True:
            for step in pending:
                trainer.train(run_id, step)
            if ledger.transaction(lambda s: s.get(Run, run_id).status) != "running":
                break
            ledger.transaction(lambda s: admit_steps(s, run_id))
            pending = relay()
            if pending:
                continue
            if not queue:
                raise RuntimeError(f"arm {arm}: nothing to generate or train and the run goes on")
            batch = [queue.popleft() for _ in range(min(args.batch, len(queue)))]
            generate(batch)
            pending = relay()
        rows = ledger.transaction(lambda s: step_metrics(s, run_id))
        # The final weights on every prompt of the data set, n samples each.
        version, path = ledger.transaction(newest_weights)
        engine.load_weights(version, path)
        data = ledger.transaction(
            lambda s: s.execute(select(Prompt.text, Prompt.row).where(Prompt.run_id == run_id).order_by(Prompt.position)).all()
        )
        requests = [
            GenerationRequest(
                attempt_id=i, prompt=text, row=row, n=args.generations, temperature=1.0, top_p=1.0,
                max_new_tokens=4, seed=10_000 + i,
            )
            for i, (text, row) in enumerate(data)
        ]
        rewards = []
        for start in range(0, len(requests), args.batch):
            chunk = requests[start : start + args.batch]
            for request, output in zip(chunk, engine.generate(chunk), strict=True):
                if isinstance(output, Exception):
                    raise output
                rewards.extend(score_group(reward_fn, [c.text for c in output.completions], request.row))
    finally:
        trainer.close()
        engine.close()
        ledger.dispose()
    return Arm(arm, rows, statistics.fmean(rewards), time.perf_counter() - began)


def plot(arms: list[Arm], output: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    per_step, per_token = figure.subplots(1, 2)
    for arm in arms:
        steps = [r["step"] for r in arm.steps]
        (line,) = per_step.plot(steps, [r["first_attempt_reward"] for r in arm.steps], label=f"{arm.name} first-attempt")
        per_step.plot(steps, [r["reward"] for r in arm.steps], linestyle="--", color=line.get_color(), label=f"{arm.name} trained")
        tokens, total = [], 0
        for r in arm.steps:
            total += int(r["generated_tokens"] or 0)
            tokens.append(total)
        per_token.plot(tokens, [r["first_attempt_reward"] for r in arm.steps], color=line.get_color(), label=arm.name)
    per_step.set(xlabel="step", ylabel="mean reward", title="reward per step")
    per_token.set(xlabel="generated tokens", ylabel="first-attempt reward", title="against generated tokens")
    for ax in (per_step, per_token):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.savefig(output, format="png")


def report(args: argparse.Namespace, arms: list[Arm], png: Path) -> list[str]:
    by = {a.name: a for a in arms}
    lines = [
        "refill bench learning: the tiny arithmetic model on the CPU, GRPO / + dynamic sampling / + skipping",
        f"  N = {args.prompts} prompts/step, n = {args.generations}, S = {args.steps} steps, D = {args.dataset} "
        f"prompts (builtin arith, cycled), lr {args.lr:g}, seed {args.seed}, warm start {args.warm_start_steps} steps",
        "",
        "  per step: trained reward / first-attempt reward / generated tokens so far",
        f"  {'step':>4} " + " ".join(f"{a.name:>26}" for a in arms),
    ]
    totals = {a.name: 0 for a in arms}
    for i in range(max(len(a.steps) for a in arms)):
        cells = []
        for a in arms:
            if i < len(a.steps):
                r = a.steps[i]
                totals[a.name] += int(r["generated_tokens"] or 0)
                cells.append(f"{_f(r['reward'])} / {_f(r['first_attempt_reward'])} / {totals[a.name]:>7}")
            else:
                cells.append("-")
        lines.append(f"  {i:>4} " + " ".join(f"{c:>26}" for c in cells))
    lines += ["", f"  {'arm':<6} {'steps':>5} {'tokens':>9} {'reward(5)':>9} {'1st-try(5)':>10} {'rollouts/grp':>12} {'skipped':>7} {'eval':>6} {'seconds':>7}"]
    for a in arms:
        rollouts = [r["rollouts_per_trained_group"] for r in a.steps if r["rollouts_per_trained_group"] is not None]
        lines.append(
            f"  {a.name:<6} {len(a.steps):>5} {a.tokens(len(a.steps)):>9} {a.last('reward'):>9.3f} "
            f"{a.last('first_attempt_reward'):>10.3f} {statistics.fmean(rollouts) if rollouts else float('nan'):>12.2f} "
            f"{sum(int(r['skipped_prompts'] or 0) for r in a.steps):>7} {a.eval_reward:>6.3f} {a.seconds:>7.0f}"
        )
    ds, skip = by["ds"], by["skip"]
    steps = min(len(ds.steps), len(skip.steps))
    t = 100.0 * skip.tokens(steps) / ds.tokens(steps)
    g = ds.last("first_attempt_reward") - skip.last("first_attempt_reward")
    lines += [
        "",
        f"  what dynamic sampling buys: ds/grpo tokens {100.0 * ds.tokens(steps) / by['grpo'].tokens(steps):.0f}%, "
        f"eval {ds.eval_reward:.3f} vs {by['grpo'].eval_reward:.3f}",
        f"  what skipping adds: eval {skip.eval_reward:.3f} vs ds {ds.eval_reward:.3f}; figure {png}",
        f"skip vs ds: tokens {t:.0f}% of ds, first-attempt reward gap {g:.3f}",
    ]
    return lines


def _f(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=32, help="N, prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="n, completions per prompt")
    parser.add_argument("--steps", type=int, default=40, help="S, trained steps per arm")
    parser.add_argument("--dataset", type=int, default=128, help="D, arithmetic prompts (revisited)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-start-steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64, help="attempts generated together")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    parser.add_argument("--cache-dir", default=None, help="warm-start cache (default: the user's)")
    parser.add_argument("--workdir", default=None, help="where the arms' ledgers and runs go (default: a temporary one)")
    parser.add_argument("-o", "--output", default="bench-learning.png", help="the PNG to write")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench learning", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    png = Path(args.output)
    with tempfile.TemporaryDirectory(prefix="refill-bench-learning-") as scratch:
        workdir = Path(args.workdir or scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        arms = [run_arm(arm, args, workdir) for arm in ARMS]
    plot(arms, png)
    for line in report(args, arms, png):
        print(line)
    return 0
