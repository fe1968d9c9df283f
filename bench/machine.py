"""What the benchmarks read about the machine: its load and the CPU time of processes."""

from __future__ import annotations

import os
from pathlib import Path


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def process_cpu(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of a process (and of its waited-for children); 0 once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(stolen, total) CPU ticks of the whole machine since boot, from /proc/stat ((0, 0)
    where there is none): two readings give the share of a stretch of time the hypervisor ran
    other guests on this machine's CPUs, which slows every timing taken meanwhile."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(f) for f in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[7], sum(fields)


def steal_since(before: tuple[int, int]) -> str:
    """The share of CPU time stolen since the reading `before` (`cpu_ticks`), as text."""
    stolen, total = cpu_ticks()
    if total <= before[1]:
        return "steal n/a"
    return f"steal {100 * (stolen - before[0]) / (total - before[1]):.1f}%"
