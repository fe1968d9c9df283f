"""Reward shaping and group-relative advantages (GRPO), on plain Python floats.

Conventions, fixed here so tests and docs can quote exact numbers:

- The baseline is the group mean, or with `leave_one_out` the mean of the *other* completions
  of the group, `(sum(r) - r_i) / (n - 1)`, which equals `n / (n - 1) * (r_i - mean)`.
- The spread is the population standard deviation of the group's rewards (divide by `n`, not
  `n - 1`), so rewards `[1, 0, 0, 1]` give advantages exactly `[+1, -1, -1, +1]` up to the
  epsilon: `A_i = (r_i - baseline_i) / (std + eps)`.
- A zero-variance group gets all-zero advantages, normalised or not: one whose rewards spread
  by at most `tolerance` (`grpo.zero_variance_tolerance`, the ledger's own test of a group).
  Without it a spread just above zero was divided by a std just as small: rewards
  `[0, 1e-6]` gave advantages of +-0.33 to a group the ledger judges to carry no signal (it
  trains such groups when dynamic sampling is off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Added to the group's std before dividing, so a near-constant group cannot blow up.
STD_EPSILON = 1e-6


def overlong_penalty(
    length: int, *, max_response_length: int, buffer_length: int, penalty: float
) -> float:
    """DAPO's soft overlong punishment for one response of `length` tokens (<= 0).

    Zero up to `max_response_length - buffer_length` tokens, then falling linearly to
    `-penalty` at `max_response_length`, and `-penalty` beyond it.
    """
    if buffer_length <= 0:
        raise ValueError("overlong buffer_length must be >= 1")
    expected = max_response_length - buffer_length
    exceed = length - expected
    if exceed <= 0:
        return 0.0
    return -penalty * min(exceed / buffer_length, 1.0)


def shape_rewards(
    rewards: Sequence[float],
    lengths: Sequence[int],
    *,
    max_response_length: int,
    buffer_length: int,
    penalty: float,
) -> list[float]:
    """Rewards plus the overlong punishment of each response's token length."""
    if len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(lengths)} response lengths")
    return [
        float(r)
        + overlong_penalty(
            n, max_response_length=max_response_length, buffer_length=buffer_length, penalty=penalty
        )
        for r, n in zip(rewards, lengths, strict=True)
    ]


def group_advantages(
    rewards: Sequence[float],
    *,
    normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = STD_EPSILON,
    tolerance: float = 0.0,
) -> list[float]:
    """One advantage per completion of a group, relative to the group (see module notes)."""
    n = len(rewards)
    if n == 0:
        raise ValueError("a group needs at least one reward")
    if leave_one_out and n < 2:
        raise ValueError("a leave-one-out baseline needs at least two completions per group")
    values = [float(r) for r in rewards]
    total = math.fsum(values)
    mean = total / n
    if leave_one_out:
        centred = [r - (total - r) / (n - 1) for r in values]
    else:
        centred = [r - mean for r in values]
    if max(values) - min(values) <= tolerance:
        # Exactly zero, not a rounding residue: such a group must not move the weights.
        return [0.0] * n
    if not normalize:
        return centred
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in values) / n)
    return [c / (std + eps) for c in centred]
