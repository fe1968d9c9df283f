"""`python -m bench fill`: step fill time, waste and staleness of three strategies, side by side.

Definitions (printed with the results):

- **L** is the mean of the latency distribution (`--latency`, e.g. lognormal with mean 1): the
  expected time of one generation. **bound** = `max(L, N / ((1 - p) * W * C) * L)` (issue 7).
- **(a) fill**: `released_at - admitted_at` of a step (the ledger's `step_fill_seconds`),
  averaged over the measured steps; **(a) max** is the slowest measured step.
- **(b) interval**: the steady-state time between consecutive releases, i.e. what the trainer
  waits per step when generation is the bottleneck: `(avail(K-1) - avail(w-1)) / (K - w)`
  where `avail(s)` is the time every step up to `s` is released (training is in order).
- The measured steps are `w .. K-1` with `w = lookahead + 1`: the first `lookahead + 1` steps
  are all admitted at time 0, before any weight version exists, and are a start-up transient.
- **waste**: groups with reward spread (non-zero variance) that were generated and never
  trained, counted over the groups whose every admissible step (`v .. v + lookahead` for
  weight version `v`) was trained in the run, i.e. `v <= K - 1 - lookahead` (a group of a
  later version might still train in a step past the run's end). Groups still generating when
  the run ends are counted with the rest (their result is known: the engine is seeded).
  **waste %** is waste over all generated groups of those versions (zero-variance ones
  included).
- **staleness**: `trained step - weight version` of every trained group; its maximum must be
  at most `max_lookahead_versions`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from bench.baselines import simulate
from bench.virtual_fleet import RefillPolicy, Scenario, Trace, VirtualFleet
from refill.tasks.backends.sim import Latency


@dataclass
class Figures:
    strategy: str
    lookahead: int
    seed: int
    bound: float
    fill_mean: float
    fill_max: float
    interval: float
    waste: int
    generated: int
    staleness_max: int
    attempts_per_step: float
    wall_seconds: float
    profile: dict[str, list[float]] = field(default_factory=dict)

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.waste / self.generated if self.generated else 0.0


def figures(trace: Trace, scenario: Scenario, seed: int) -> Figures:
    lookahead = trace.lookahead
    k = scenario.steps
    first = min(lookahead + 1, k - 1)
    by_step = {s.step: s for s in trace.steps}
    if len(by_step) < k:
        raise RuntimeError(f"{trace.strategy}: only {len(by_step)} of {k} steps were released")
    avail, latest = [], -math.inf
    for s in range(k):
        latest = max(latest, by_step[s].released)
        avail.append(latest)
    measured = [by_step[s] for s in range(first, k)]
    fills = [s.released - s.admitted for s in measured]
    interval = (avail[k - 1] - avail[first - 1]) / (k - first)
    horizon = k - 1 - lookahead
    window = [a for a in trace.finished if a.weight_version <= horizon]
    waste = sum(1 for a in window if not a.zero_variance and a.trained_step is None)
    trained = [a for a in trace.finished if a.trained_step is not None]
    staleness = max((a.trained_step - a.weight_version for a in trained), default=0)  # type: ignore[operator]
    return Figures(
        strategy=trace.strategy,
        lookahead=lookahead,
        seed=seed,
        bound=scenario.bound(),
        fill_mean=statistics.fmean(fills),
        fill_max=max(fills),
        interval=interval,
        waste=waste,
        generated=len(window),
        staleness_max=staleness,
        attempts_per_step=trace.dispatched / k,
        wall_seconds=trace.wall_seconds,
        profile=trace.profile,
    )


# --- running ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    strategy: str  # serial, batch or refill
    scenario: Scenario
    policy: RefillPolicy | None = None


def run_job(job: Job) -> Figures:
    began = time.perf_counter()
    if job.strategy == "refill":
        fleet = VirtualFleet(job.scenario, job.policy)
        try:
            trace = fleet.run()
        finally:
            fleet.close()
    else:
        trace = simulate(job.strategy, job.scenario)
        trace.wall_seconds = time.perf_counter() - began
    return figures(trace, job.scenario, job.scenario.seed)


def run_jobs(jobs: Sequence[Job], processes: int) -> list[Figures]:
    if processes <= 1:
        return [run_job(j) for j in jobs]
    # Longest first: the refill runs dominate.
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].strategy != "refill")
    with ProcessPoolExecutor(processes) as pool:
        results = dict(zip(order, pool.map(run_job, [jobs[i] for i in order]), strict=True))
    return [results[i] for i in range(len(jobs))]


# --- reporting -------------------------------------------------------------------------


@dataclass
class Row:
    label: str
    runs: list[Figures]

    def mean(self, attr: str) -> float:
        return statistics.fmean(getattr(f, attr) for f in self.runs)


def aggregate(results: Iterable[tuple[str, Figures]]) -> list[Row]:
    rows: dict[str, Row] = {}
    for label, fig in results:
        rows.setdefault(label, Row(label, [])).runs.append(fig)
    return list(rows.values())


def format_table(rows: Sequence[Row], bound: float) -> list[str]:
    head = (
        f"{'strategy':<44} {'(a) fill/bound':>14} {'(a) max/bound':>13} {'(b) interval/bound':>18} "
        f"{'waste':>7} {'waste %':>8} {'max stale':>9} {'attempts/step':>13}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        waste = sum(f.waste for f in row.runs)
        generated = sum(f.generated for f in row.runs)
        stale = max(f.staleness_max for f in row.runs)
        lookahead = row.runs[0].lookahead
        lines.append(
            f"{row.label:<44} {row.mean('fill_mean') / bound:>14.2f} "
            f"{max(f.fill_max for f in row.runs) / bound:>13.2f} "
            f"{row.mean('interval') / bound:>18.2f} {waste:>7d} "
            f"{100.0 * waste / generated if generated else 0.0:>7.2f}% "
            f"{f'{stale} (<= {lookahead})':>9} {row.mean('attempts_per_step'):>13.1f}"
        )
    return lines


def parse_latency(text: str) -> Latency:
    """`lognormal:mean=1,sigma=0.5`, `exponential:mean=1`, `constant:mean=1`."""
    kind, _, rest = text.partition(":")
    values = {}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        values[key.strip()] = float(value)
    unknown = set(values) - {"mean", "sigma"}
    if unknown:
        raise ValueError(f"unknown latency parameter(s) {sorted(unknown)} in {text!r}")
    return Latency(kind.strip(), values.get("mean", 1.0), values.get("sigma", 0.5))


def policies_for(lookahead: int, names: Sequence[str]) -> list[RefillPolicy]:
    out = []
    for name in names:
        if name == "default":
            out.append(RefillPolicy(name="refill", max_lookahead_versions=lookahead))
        elif name == "no-od":
            out.append(RefillPolicy(name="refill", max_lookahead_versions=lookahead, over_dispatch=False))
        else:
            # `sigma=X`, `tail=Y` or both, comma-separated: async_rl.over_dispatch's knobs
            knobs = {"sigma": "safety_sigmas", "tail": "tail_fraction"}
            values: dict[str, float] = {}
            for part in name.split(","):
                key, _, value = part.partition("=")
                if key not in knobs or not value:
                    raise ValueError(f"unknown refill policy {name!r}: default, no-od, sigma=X, tail=Y or sigma=X,tail=Y")
                values[knobs[key]] = float(value)
            out.append(RefillPolicy(name="refill", max_lookahead_versions=lookahead, **values))
    return out


def main(args) -> int:  # type: ignore[no-untyped-def]
    latency = parse_latency(args.latency)
    base = Scenario(
        prompts_per_step=args.prompts,
        generations=args.generations,
        latency=latency,
        workers=args.workers,
        in_flight=args.in_flight,
        steps=args.steps,
        train_seconds=args.train_seconds,
    )
    jobs: list[tuple[float, str, Job]] = []
    for p in args.p:
        for lookahead in args.lookahead:
            for seed in args.seeds:
                scenario = replace(base, p=p, seed=seed, max_lookahead_versions=lookahead)
                for name in ("serial", "batch"):
                    jobs.append((p, f"{name} (lookahead {lookahead})", Job(name, scenario)))
                for policy in policies_for(lookahead, args.refill):
                    jobs.append((p, policy.label(scenario), Job("refill", scenario, policy)))
    print_parameters(args, base)
    began = time.perf_counter()
    results = run_jobs([j for _, _, j in jobs], args.processes)
    wall = time.perf_counter() - began
    for p in args.p:
        scenario = replace(base, p=p)
        bound = scenario.bound()
        print()
        print(
            f"p = {p}: bound = max(L, N / ((1 - p) * W * C) * L) = max({latency.mean_seconds:g}, "
            f"{args.prompts / ((1 - p) * scenario.capacity) * latency.mean_seconds:.3f}) = {bound:.3f} s"
        )
        rows = aggregate((label, fig) for (jp, label, _), fig in zip(jobs, results, strict=True) if jp == p)
        for line in format_table(rows, bound):
            print("  " + line)
    print()
    refill_runs = [(j, f) for (_, _, j), f in zip(jobs, results, strict=True) if j.strategy == "refill"]
    ledger_seconds = sum(f.wall_seconds for _, f in refill_runs)
    print(
        f"wall time {wall:.1f} s on {args.processes} process(es); the refill runs spent "
        f"{ledger_seconds:.1f} s in ledger work (the baselines are pure simulations)"
    )
    if args.profile:
        totals: dict[str, list[float]] = {}
        for _, fig in refill_runs:
            for what, (seconds, calls) in fig.profile.items():
                entry = totals.setdefault(what, [0.0, 0])
                entry[0] += seconds
                entry[1] += calls
        print("ledger profile of the refill runs (wall seconds, calls, ms per call):")
        for what, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            print(f"  {what:<18} {seconds:8.1f} s {int(calls):8d} {1000 * seconds / max(1, calls):8.2f} ms")
    return 0


def print_parameters(args, base: Scenario) -> None:  # type: ignore[no-untyped-def]
    lat = base.latency
    print("refill bench fill: step fill time with dynamic sampling, three strategies on the same seeds")
    print(
        f"  N = {base.prompts_per_step} prompts/step, n = {base.generations} generations/prompt, "
        f"p = {', '.join(str(p) for p in args.p)}, W = {base.workers} workers x C = {base.in_flight} "
        f"groups in flight = {base.capacity}"
    )
    print(
        f"  latency {lat.distribution} mean {lat.mean_seconds:g} s sigma {lat.sigma:g}: "
        f"L = {lat.mean_seconds:g} s (the distribution's mean); train time {base.train_seconds:g} s "
        f"(virtual); K = {base.steps} steps; seeds {', '.join(map(str, args.seeds))}; "
        f"lookahead {', '.join(map(str, args.lookahead))}"
    )
    print(
        "  (a) fill = released_at - admitted_at per step (mean over steps lookahead+1..K-1; max "
        "= slowest); (b) interval = steady-state time between consecutive releases"
    )
    print(
        "  waste = non-zero-variance groups never trained, over groups of weight versions "
        "<= K-1-lookahead (all their steps trained); % of generated groups"
    )
    print("  refill = the production ledger (SQLite in memory) driven in virtual time; serial, batch = simulations")


def add_arguments(parser) -> None:  # type: ignore[no-untyped-def]
    parser.add_argument("--prompts", type=int, default=256, help="N, prompts per step")
    parser.add_argument("--generations", type=int, default=16, help="n, generations per prompt")
    parser.add_argument("--p", type=float, nargs="+", default=[0.2, 0.33, 0.6], help="zero-variance fractions")
    parser.add_argument("--latency", default="lognormal:mean=1,sigma=0.5")
    parser.add_argument("--workers", type=int, default=16, help="W")
    parser.add_argument("--in-flight", type=int, default=64, help="C, groups in flight per worker")
    parser.add_argument("--steps", type=int, default=10, help="K, steps per run")
    parser.add_argument("--train-seconds", type=float, default=0.1, help="virtual train time per step")
    parser.add_argument("--lookahead", type=int, nargs="+", default=[1, 2], help="max_lookahead_versions")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--refill", nargs="+", default=["default"],
        help="refill policies per lookahead: default (production over-dispatch), no-od, sigma=X, tail=Y, sigma=X,tail=Y",
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print where the ledger time goes")
