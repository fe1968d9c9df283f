"""`python -m bench compare REV [--rounds K] [--grep RE] -- BENCH ARGS`: a benchmark run on an
earlier commit and on this checkout, side by side, rounds alternating.

Every performance figure in bench/README.md is a ratio measured side by side in one run, never
against another day's numbers: this machine's speed moves by 2x from one day to the next. This
command does what each of those comparisons needs:

1. extracts REV (any git revision) into a scratch directory (`git archive`, so this checkout's
   work tree and its worktrees are left alone), and makes it importable as `refill.*` the way
   the editable install makes this checkout importable: REV's own `[tool.setuptools]
   package-dir` (read from its pyproject.toml) is laid out as links inside its `refill/`;
2. runs `python -m bench BENCH ARGS` in REV's directory with `PYTHONPATH` set to it, and the
   same in this checkout, alternating for `--rounds` rounds (REV first); each side runs its own
   `bench/` (an older commit's bench may lack a newer option: pick ARGS both understand);
3. prints each run's output as it comes, then the lines matching `--grep` from every round,
   side by side, as the summary.

The editable install's import finder is turned off in REV's runs (a `sitecustomize` that
removes it from `sys.meta_path`), so a module REV lacks fails to import rather than being taken
from this checkout. Processes the benchmark starts (`refill worker ...`, `celery worker`)
inherit the environment and run REV's code too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Removes setuptools' editable finder for this project from the import system (see the module
#: docstring); written as `sitecustomize.py` on REV's PYTHONPATH.
SITECUSTOMIZE = '''\
import sys
sys.meta_path[:] = [
    finder for finder in sys.meta_path
    if not (getattr(finder, "__module__", "") or "").startswith("__editable___refill")
    and not (getattr(type(finder), "__module__", "") or "").startswith("__editable___refill")
]
'''


def git(*args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.decode().strip()}")
    return done.stdout


def extract(rev: str, into: Path) -> str:
    """REV's tree under `into`, importable as `refill.*`; returns its full commit id."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    with tarfile.open(fileobj=BytesIO(git("archive", "--format=tar", commit))) as archive:
        archive.extractall(into, filter="data")
    pyproject = into / "pyproject.toml"
    if not pyproject.exists():
        raise SystemExit(f"{rev} ({commit[:10]}) has no pyproject.toml: it is not a refill commit to compare with")
    mapping = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    for package, folder in mapping.items():
        parts = package.split(".")
        if parts[0] != "refill" or len(parts) == 1:
            continue
        link = into.joinpath(*parts)
        target = into / folder
        if not link.exists() and target.is_dir():
            link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=True)
    (into / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return commit


def run_side(label: str, cwd: Path, env: dict[str, str], bench_args: list[str]) -> list[str]:
    """One benchmark run, its output printed line by line with the side's label; its lines."""
    print(f"\n=== {label}: python -m bench {' '.join(bench_args)}", flush=True)
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench", *bench_args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        print(f"[{label}] {line}", end="", flush=True)
    code = process.wait()
    print(f"=== {label}: exit {code} after {time.perf_counter() - began:.0f} s", flush=True)
    if code != 0:
        raise SystemExit(f"the benchmark failed on {label} (exit {code}); its output is above")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m bench compare",
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m bench compare HEAD~3 --grep '^controller overhead' -- overhead --repeat 1",
    )
    parser.add_argument("rev", help="the earlier commit (any git revision: HEAD~1, a tag, an id)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side, alternating, REV first")
    parser.add_argument(
        "--grep", action="append", default=[], metavar="RE",
        help="a regular expression: the lines of each run that match go in the summary (repeatable)",
    )
    parser.add_argument("--keep", action="store_true", help="keep REV's extracted tree (its path is printed)")
    args = parser.parse_args(argv)
    if not bench_args:
        parser.error("name the benchmark after --, e.g. `python -m bench compare HEAD~1 -- fill --seeds 0`")
    if bench_args[0] == "compare":
        parser.error("compare cannot compare itself; name another benchmark after --")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    patterns = [re.compile(p) for p in args.grep]

    scratch = Path(tempfile.mkdtemp(prefix="refill-compare-"))
    try:
        commit = extract(args.rev, scratch)
        here = git("rev-parse", "HEAD").decode().strip()[:10]
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
        this = f"this checkout ({here}{' + uncommitted changes' if dirty else ''})"
        print(f"bench compare: {args.rev} = {commit[:10]} (in {scratch}) against {this}, {args.rounds} round(s)")
        env_rev = dict(os.environ, PYTHONPATH=os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        env_here = dict(os.environ)
        sides = [(f"{args.rev} {commit[:10]}", scratch, env_rev), (f"here {here}", REPO, env_here)]
        matched: dict[str, list[list[str]]] = {label: [] for label, _, _ in sides}
        for round_no in range(1, args.rounds + 1):
            for label, cwd, env in sides:
                lines = run_side(f"{label} round {round_no}", cwd, env, bench_args)
                matched[label].append([line for line in lines if any(p.search(line) for p in patterns)])
        if patterns:
            print("\nsummary (lines matching --grep, each round):")
            for label, _, _ in sides:
                for round_no, lines in enumerate(matched[label], start=1):
                    for line in lines or ["(no line matched)"]:
                        print(f"  {label} round {round_no}: {line.strip()}")
    finally:
        if args.keep:
            print(f"kept {args.rev}'s tree in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
