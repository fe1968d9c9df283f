"""`python -m bench payloads` keeps working (issue 17): at a small size it measures both stores
at two rollout lengths and ends with the line of its targets. The figures themselves come from
running it at full size (bench/README.md); only what holds at any size and on any machine is
asserted: a claim check's message is the same few hundred bytes at every length, far under
4 KB, while an inline one grows with the rollout."""

from __future__ import annotations

import re

from tests.acceptance.test_bench_smoke import run_bench


def test_payloads_bench_prints_both_stores_and_its_target_line() -> None:
    out = run_bench("payloads", "--tokens", "8,256", "--groups", "8", "--repeat", "1", "--warmup", "0")
    rows = {
        (m.group(1), int(m.group(2))): (int(m.group(3)), float(m.group(4)))
        for m in re.finditer(r"^(inline|files)\s+(\d+)\s+[\d.]+\s+(\d+)\s+\d+\s+[\d.]+\s+([\d.]+)", out, re.MULTILINE)
    }
    assert set(rows) == {("inline", 8), ("inline", 256), ("files", 8), ("files", 256)}, out
    assert rows[("files", 256)][0] < 4096 and abs(rows[("files", 256)][0] - rows[("files", 8)][0]) < 200
    assert rows[("inline", 256)][0] > 10 * rows[("files", 256)][0]
    assert all(cpu > 0 for _, cpu in rows.values())
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"consumer CPU per result 256/8 tokens: [\d.]+; redis bytes per result at 256 tokens: \d+", last), out
