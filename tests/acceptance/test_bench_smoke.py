"""The benchmarks keep working: `python -m bench fill` and `python -m bench overhead` at a
small size print every figure their README promises. (The figures themselves are measured by
running the benchmarks at full size, never asserted here: a timed test is a flaky test.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_fill_bench_prints_three_strategies_with_staleness_in_bound() -> None:
    out = run_bench(
        "fill", "--prompts", "16", "--steps", "4", "--p", "0.33", "--lookahead", "1",
        "--workers", "2", "--in-flight", "8", "--processes", "1",
    )
    rows = {}
    for line in out.splitlines():
        match = re.match(r"\s+(serial|batch|refill) \(lookahead 1.*?\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)%\s+(\d+) \(<= 1\)", line)
        if match:
            rows[match.group(1)] = match
    assert set(rows) == {"serial", "batch", "refill"}, out
    for match in rows.values():
        assert int(match.group(7)) <= 1  # max staleness within max_lookahead_versions
    assert "bound = max(L, N / ((1 - p) * W * C) * L)" in out


def test_overhead_bench_prints_each_phase_and_the_target() -> None:
    out = run_bench("overhead", "--groups", "64", "--repeat", "1", "--tokens", "40", "--rtt-ms", "0.1", "--parts")
    assert "a simulated round trip of 0.1 ms" in out, out
    assert "n=16 x 40 tokens" in out and "; 40.0 tokens per completion" in out, out  # as asked, recorded
    for phase in ("admission", "relay", "record", "release", "metrics", "controller overhead"):
        assert re.search(rf"^{phase}\s+[\d.]+\s+[\d.]+", out, re.MULTILINE), (phase, out)
    assert re.search(r"results recorded (\d+) \((\d+) committed", out), out
    assert "target <= 2.0 s wall" in out
    # The share of the machine's CPU time other guests took during the round (noise to judge by).
    assert re.search(r"^  round 1: total .*, steal (\d+\.\d%|n/a)$", out, re.MULTILINE), out
    # The floor replayed the step's rows (its UPDATEs check the rows they matched) and is printed.
    assert re.search(r"^controller overhead / floor: [\d.]+ \([\d.]+ s / [\d.]+ s;", out, re.MULTILINE), out
    # --parts: each part of a batch timed inside the record phase, what is left over not negative.
    parts = dict(re.findall(r"^  (lock|read|decide|write|rest)\s+(-?[\d.]+)\s", out, re.MULTILINE))
    assert list(parts) == ["lock", "read", "decide", "write", "rest"], out
    assert all(float(wall) > 0 for wall in parts.values()), out


def test_scale_bench_prints_each_tenth_and_the_two_growth_figures() -> None:
    out = run_bench(
        "scale", "--attempts", "400", "--prompts", "16", "--generations", "4",
        "--workers", "2", "--in-flight", "8", "--dataset", "400",
    )
    tenths = re.findall(r"^tenth\s+(\d+): .*cpu ms/result\s+[\d.]+ .*KiB/attempt .*peak RSS bench \d+ MiB", out, re.MULTILINE)
    assert tenths == [str(i) for i in range(1, 11)], out
    assert re.search(
        r"^per-result cost last/first tenth: [\d.]+; peak RSS growth after the first tenth: -?[\d.]+%$",
        out.splitlines()[-1],
    ), out


def test_skip_bench_prints_both_arms_with_and_without_learning_and_the_ratio() -> None:
    out = run_bench(
        "skip", "--prompts", "8", "--generations", "8", "--dataset", "64", "--epochs", "3",
        "--workers", "2", "--in-flight", "8", "--processes", "1",
    )
    arms = re.findall(r"^  (ds|skip)( \+ learning)?\s+\d+\s+\d+\s+\d+\s+([\d.]+)", out, re.MULTILINE)
    assert [a + b for a, b, _ in arms] == ["ds", "skip", "ds + learning", "skip + learning"], out
    assert re.search(r"^  skip\s.*\s\d+\s+[\d.]+%$", out, re.MULTILINE), out  # skips, share never retried
    assert "floor over 3 epochs (no history in the first)" in out
    assert re.match(r"^skip/ds rollouts per trained group: [\d.]+$", out.splitlines()[-1]), out


def test_learning_bench_prints_three_arms_a_figure_and_the_comparison(tmp_path: Path) -> None:
    png = tmp_path / "learning.png"
    out = run_bench(
        "learning", "--steps", "2", "--prompts", "4", "--generations", "4", "--dataset", "16",
        "--warm-start-steps", "10", "--cache-dir", str(tmp_path / "cache"), "-o", str(png),
    )
    for arm in ("grpo", "ds", "skip"):
        assert re.search(rf"^  {arm}\s+2\s+\d+\s+[\d.]+\s+[\d.]+", out, re.MULTILINE), out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.match(r"^skip vs ds: tokens \d+% of ds, first-attempt reward gap -?[\d.]+$", out.splitlines()[-1]), out


def test_compare_runs_a_bench_on_an_earlier_commit_and_on_this_checkout() -> None:
    out = run_bench(
        "compare", "HEAD", "--grep", r"^  refill \(", "--",
        "fill", "--prompts", "8", "--steps", "2", "--p", "0.33", "--lookahead", "1",
        "--workers", "1", "--in-flight", "4", "--processes", "1",
    )
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    summary = out.split("summary (lines matching --grep, each round):\n", 1)[1].splitlines()
    # One refill row from each side: the extracted commit's, then this checkout's.
    assert [line.split(" round 1: ")[0].strip() for line in summary] == [f"HEAD {head[:10]}", f"here {head[:10]}"], out
    assert all(" round 1: refill (lookahead 1" in line for line in summary), out


def test_compare_names_a_revision_that_does_not_exist() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "compare", "no-such-rev", "--", "fill"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert "git rev-parse --verify no-such-rev^{commit} failed" in done.stderr, done.stderr
