"""`python -m bench fill ...`: the benchmarks of refill (see bench/README.md)."""

from __future__ import annotations

import argparse
import sys

#: Subcommands that parse their own arguments: name -> (module with main(argv), help).
OWN_PARSERS = {
    "throughput": (
        "bench.throughput",
        "results consumed per second: the real pipeline beside a bare Celery round trip",
    ),
    "overhead": ("bench.overhead", "ledger time of one 4096-group step at p = 0.33, by phase"),
    "payloads": (
        "bench.payloads",
        "the consumer's CPU and Redis bytes per result at 8 to 8,192 tokens: inline and as claim checks",
    ),
    "soak": (
        "bench.soak",
        "a chaos soak: runs back to back on a sim fleet under overlapping random faults",
    ),
    "scale": ("bench.scale", "ledger cost per result and memory per tenth of a long run (1,000,000 attempts)"),
    "skip": (
        "bench.skip",
        "dynamic sampling with and without pre-rollout skipping: rollouts per trained group (sim)",
    ),
    "compare": (
        "bench.compare",
        "any benchmark on an earlier commit and on this checkout, side by side (python -m bench compare REV -- fill)",
    ),
    "learning": (
        "bench.learning",
        "the tiny model on the CPU: GRPO, + dynamic sampling, + skipping; reward against tokens",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSERS:
        import importlib

        return int(importlib.import_module(OWN_PARSERS[argv[0]][0]).main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in OWN_PARSERS.items():
        commands.add_parser(name, help=f"{text} (python -m bench {name} --help)", add_help=False)
    from bench import fill

    fill_parser = commands.add_parser(
        "fill", help="step fill time, waste and staleness: serial, batch and refill side by side"
    )
    fill.add_arguments(fill_parser)
    fill_parser.set_defaults(run=fill.main)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
