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
