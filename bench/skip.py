"""`python -m bench skip`: dynamic sampling with and without pre-rollout skipping, side by side.

Each arm is the production ledger driven in virtual time (`bench.virtual_fleet`) on the `sim`
back-end: `N` prompts per step, `n` generations each, `E` epochs of a data set of `D`
prompts whose solve rates are U-shaped (`Beta(a, a)`, a = 0.3 by default: most prompts nearly
always or nearly never solved), run until the data ends. `ds` is dynamic sampling as shipped;
`skip` adds `data.prompt_skipping` with its defaults (GRESO's). Both run on the same seeds,
without and with the sim back-end's learning option (a share of the prompts' solve rates rise
with the weight version, so a prompt skipped as all-failed can become useful again).

Figures (per arm; "groups" are generations of `n` completions):

- **rollouts / trained group**: finished generations over trained groups; under dynamic
  sampling about `1 / (1 - p)`. Split by epoch too: an attempt's epoch is how many times the
  loader handed its prompt out before (retries not counted).
- **tokens / trained group**: generated tokens over trained groups.
- **interval / bound**: the steady-state time between releases (as `bench fill`) over
  `max(L, N / ((1 - p) * W * C) * L)` with the arm's measured `p`.
- **waste %**: groups with spread generated and never trained, of all generated (the run's last
  `lookahead + 1` steps' versions left out, as `bench fill`).
- **never retried**: of the prompts skipped at least once, the share never generated again
  after their first skip (GRESO keeps each prompt a chance: `min_exploration`).

The last line is `skip/ds rollouts per trained group: R`, the skip arm's rollouts per trained
group over the ds arm's, on the U-shaped case without learning (issue 15's target: R <= 0.6).
The first epoch has no history to skip by, so over `E` epochs R cannot fall below
`(1 + (E - 1) * (1 - p)) / E` (printed as the floor).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import select

from bench.virtual_fleet import RefillPolicy, Scenario, Trace, VirtualFleet
from refill.models.tables import Attempt, AttemptReason, Group, Prompt, PromptDraw
from refill.tasks.backends.sim import Latency, Learning, SimEngine, expected_zero_variance_fraction


@dataclass(frozen=True)
class SkipScenario(Scenario):
    """A `bench fill` scenario over a fixed data set, run to the end of its epochs."""

    dataset: int = 4096
    epochs: int = 3
    alpha: float = 0.3
    skipping: bool = False
    exploration_rate: float | None = None  # data.prompt_skipping.exploration_rate (None: default)
    learning: tuple[float, float] | None = None  # (share, rate) of generation.sim.learning

    def num_prompts(self) -> int:
        return self.dataset

    def engine(self) -> SimEngine:
        return SimEngine(
            seed=self.seed,
            solve_rate_alpha=self.alpha,
            solve_rate_beta=self.alpha,
            latency=self.latency,
            learning=Learning(*self.learning) if self.learning else None,
            tokens_per_completion=2,
            vocab_size=100,
            virtual=True,
        )


class SkipFleet(VirtualFleet):
    """`VirtualFleet` with the run's config made this scenario's before the run is created."""

    def _create(self) -> int:
        s: SkipScenario = self.scenario  # type: ignore[assignment]
        sim = self.config["generation"]["sim"]
        sim.pop("zero_variance_fraction", None)
        sim.update(solve_rate_alpha=s.alpha, solve_rate_beta=s.alpha)
        if s.learning:
            sim["learning"] = {"share": s.learning[0], "rate": s.learning[1]}
        self.config["grpo"].update(max_num_steps=100_000, max_num_epochs=s.epochs)
        self.config["data"]["prompt_skipping"] = {"enabled": s.skipping}
        if s.exploration_rate is not None:
            knobs = self.config["data"]["prompt_skipping"]
            knobs.update(exploration_rate=s.exploration_rate, exploration_rate_min=min(0.05, s.exploration_rate))
        return super()._create()


@dataclass
class Figures:
    arm: str
    steps: int
    trained: int
    rollouts: int
    tokens: int
    p: float
    interval: float
    bound: float
    waste: int
    generated: int
    skipped_draws: int = 0
    skipped_prompts: int = 0
    never_retried: int = 0
    by_epoch: dict[int, tuple[int, int]] = field(default_factory=dict)  # epoch -> (rollouts, trained)
    wall_seconds: float = 0.0

    @property
    def per_group(self) -> float:
        return self.rollouts / self.trained if self.trained else math.nan

    def epoch_per_group(self, epoch: int) -> float:
        rollouts, trained = self.by_epoch.get(epoch, (0, 0))
        return rollouts / trained if trained else math.nan


def run_arm(scenario: SkipScenario) -> Figures:
    began = time.perf_counter()
    fleet = SkipFleet(scenario, RefillPolicy(name="skip" if scenario.skipping else "ds"))
    try:
        trace = fleet.run()
        figures = measure(fleet, trace, scenario)
    finally:
        fleet.close()
    figures.wall_seconds = time.perf_counter() - began
    return figures


def measure(fleet: VirtualFleet, trace: Trace, scenario: SkipScenario) -> Figures:
    steps = sorted(trace.steps, key=lambda s: s.step)
    k = len(steps)
    first = min(trace.lookahead + 1, k - 1)
    avail, latest = [], -math.inf
    for s in steps:
        latest = max(latest, s.released)
        avail.append(latest)
    interval = (avail[k - 1] - avail[first - 1]) / (k - first) if k > first else math.nan
    horizon = k - 1 - trace.lookahead
    window = [a for a in trace.finished if a.weight_version <= horizon]
    waste = sum(1 for a in window if not a.zero_variance and a.trained_step is None)
    p = sum(1 for a in trace.finished if a.zero_variance) / len(trace.finished)
    mean = scenario.latency.mean_seconds
    bound = max(mean, scenario.prompts_per_step / (max(1e-9, 1 - p) * scenario.capacity) * mean)

    def read(session: Any) -> Figures:
        run_id = fleet.run_id
        rows = session.execute(
            select(Attempt.id, Attempt.prompt_id, Attempt.reason, Attempt.zero_variance, Attempt.num_tokens)
            .where(Attempt.run_id == run_id)
            .order_by(Attempt.id)
        ).all()
        trained_ids = set(
            session.scalars(select(Group.attempt_id).where(Group.run_id == run_id, Group.trained_step.is_not(None)))
        )
        draws = session.execute(
            select(Prompt.position, PromptDraw.epoch, PromptDraw.skipped, PromptDraw.prompt_id)
            .join(Prompt, Prompt.id == PromptDraw.prompt_id)
            .where(PromptDraw.run_id == run_id)
            .order_by(PromptDraw.epoch, PromptDraw.position)
        ).all()
        # The epochs in which the loader handed each prompt out (every epoch without skipping):
        # a prompt's k-th attempt (retries aside) is its k-th hand-out.
        handed: dict[int, list[int]] = {}
        for _, epoch, skipped, prompt_id in draws:
            if not skipped:
                handed.setdefault(prompt_id, []).append(epoch)
        seen: Counter[int] = Counter()
        by_epoch: dict[int, list[int]] = {}
        for attempt_id, prompt_id, reason, zero_variance, _ in rows:
            if reason != AttemptReason.RETRY.value:
                seen[prompt_id] += 1
            nth = seen[prompt_id] - 1
            epochs = handed.get(prompt_id)
            epoch = epochs[nth] if epochs is not None and nth < len(epochs) else nth
            entry = by_epoch.setdefault(epoch, [0, 0])
            entry[0] += zero_variance is not None
            entry[1] += attempt_id in trained_ids
        first_skip: dict[int, int] = {}
        retried: set[int] = set()
        for position, epoch, skipped, _ in draws:
            if skipped:
                first_skip.setdefault(position, epoch)
            elif position in first_skip:
                retried.add(position)
        return Figures(
            arm=("skip" if scenario.skipping else "ds") + (" + learning" if scenario.learning else ""),
            steps=k,
            trained=len(trained_ids),
            rollouts=sum(1 for r in rows if r.zero_variance is not None),
            tokens=sum(int(r.num_tokens or 0) for r in rows),
            p=p,
            interval=interval,
            bound=bound,
            waste=waste,
            generated=len(window),
            skipped_draws=sum(1 for _, _, skipped, _ in draws if skipped),
            skipped_prompts=len(first_skip),
            never_retried=len(set(first_skip) - retried),
            by_epoch={e: (v[0], v[1]) for e, v in sorted(by_epoch.items())},
        )

    return fleet.tx("read", read)


def scenarios(args: argparse.Namespace) -> list[SkipScenario]:
    base = SkipScenario(
        prompts_per_step=args.prompts,
        generations=args.generations,
        latency=Latency("lognormal", args.latency, 0.5),
        workers=args.workers,
        in_flight=args.in_flight,
        seed=args.seed,
        dataset=args.dataset,
        epochs=args.epochs,
        alpha=args.alpha,
        exploration_rate=args.exploration_rate,
    )
    learning = (args.learning_share, args.learning_rate)
    return [
        replace(base, skipping=skipping, learning=learns)
        for learns in (None, learning)
        for skipping in (False, True)
    ]


def report(args: argparse.Namespace, results: list[Figures]) -> list[str]:
    n, epochs = args.generations, args.epochs
    p_u = expected_zero_variance_fraction(args.alpha, args.alpha, n)
    lines = [
        "refill bench skip: dynamic sampling (ds) and ds + pre-rollout skipping (skip), same seeds",
        f"  N = {args.prompts} prompts/step, n = {n}, {epochs} epochs of {args.dataset} prompts, solve rates "
        f"Beta({args.alpha:g}, {args.alpha:g}) (p = {p_u:.3f} before learning), W x C = "
        f"{args.workers} x {args.in_flight}, latency lognormal mean {args.latency:g} s (virtual), seed {args.seed}",
        f"  learning: {args.learning_share:g} of the prompts' failure rates shrink by {args.learning_rate:g} per "
        "weight version; skip = data.prompt_skipping"
        + (f" with exploration_rate {args.exploration_rate:g}" if args.exploration_rate is not None else "'s defaults (GRESO's)"),
        "",
    ]
    head = (
        f"  {'arm':<18} {'steps':>5} {'trained':>7} {'rollouts':>8} {'rollouts/grp':>12} "
        + " ".join(f"{f'epoch {e}':>8}" for e in range(epochs))
        + f" {'tokens/grp':>10} {'p':>6} {'interval/bound':>14} {'waste %':>8} {'skipped':>8} {'never retried':>13}"
    )
    lines += [head, "  " + "-" * (len(head) - 2)]
    for f in results:
        never = f"{100 * f.never_retried / f.skipped_prompts:.1f}%" if f.skipped_prompts else "-"
        lines.append(
            f"  {f.arm:<18} {f.steps:>5} {f.trained:>7} {f.rollouts:>8} {f.per_group:>12.3f} "
            + " ".join(f"{f.epoch_per_group(e):>8.3f}" for e in range(epochs))
            + f" {f.tokens / f.trained if f.trained else math.nan:>10.1f} {f.p:>6.3f} "
            f"{f.interval / f.bound:>14.2f} {100 * f.waste / f.generated if f.generated else 0.0:>7.2f}% "
            f"{f.skipped_draws:>8} {never:>13}"
        )
    lines.append("")
    pairs = {f.arm: f for f in results}
    floor = (1 + (epochs - 1) * (1 - p_u)) / epochs
    for suffix in (" + learning", ""):
        ds, skip = pairs[f"ds{suffix}"], pairs[f"skip{suffix}"]
        later = [skip.epoch_per_group(e) / ds.epoch_per_group(e) for e in range(1, epochs)]
        lines.append(
            f"  {'with' if suffix else 'without'} learning: skip/ds rollouts per trained group "
            f"{skip.per_group / ds.per_group:.3f} (epochs 2..{epochs}: "
            f"{statistics.fmean(later) if later else math.nan:.3f}); tokens per trained group "
            f"{(skip.tokens / skip.trained) / (ds.tokens / ds.trained):.3f}"
        )
    lines.append(f"  floor over {epochs} epochs (no history in the first): (1 + {epochs - 1}(1 - p)) / {epochs} = {floor:.3f}")
    wall = sum(f.wall_seconds for f in results)
    lines.append(f"  ledger wall time {wall:.1f} s over {len(results)} runs")
    ds, skip = pairs["ds"], pairs["skip"]
    lines.append(f"skip/ds rollouts per trained group: {skip.per_group / ds.per_group:.3f}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=256, help="N, prompts per step")
    parser.add_argument("--generations", type=int, default=16, help="n, generations per prompt")
    parser.add_argument("--dataset", type=int, default=4096, help="prompts in the data set")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.3, help="solve rates ~ Beta(alpha, alpha)")
    parser.add_argument("--learning-share", type=float, default=0.5)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--latency", type=float, default=1.0, help="mean seconds (lognormal, sigma 0.5)")
    parser.add_argument("--workers", type=int, default=8, help="W")
    parser.add_argument("--in-flight", type=int, default=64, help="C, groups in flight per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exploration-rate", type=float, default=None,
        help="data.prompt_skipping.exploration_rate of the skip arms (default: the schema's, GRESO's 0.5)",
    )
    parser.add_argument("--processes", type=int, default=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench skip", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    arms = scenarios(args)
    if args.processes > 1:
        with ProcessPoolExecutor(args.processes) as pool:
            results = list(pool.map(run_arm, arms))
    else:
        results = [run_arm(s) for s in arms]
    for line in report(args, results):
        print(line)
    return 0
