"""The arithmetic task of the CPU demo: short sums a tiny model can learn in minutes."""

from __future__ import annotations

import random

#: Largest operand of the demo task; the warm start and the data loader share it.
DEFAULT_MAX_OPERAND = 9


def make_row(a: int, b: int, op: str) -> dict[str, str]:
    answer = a + b if op == "+" else a - b
    return {"prompt": f"{a}{op}{b}=", "answer": str(answer)}


def generate(
    size: int, seed: int = 0, max_operand: int = DEFAULT_MAX_OPERAND
) -> list[dict[str, str]]:
    """`size` rows of `a+b=` / `a-b=` with operands in [0, max_operand], deterministic by seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        rows.append(make_row(a, b, op))
    return rows
