"""A training step's mini-batches (one optimizer update each) and the step's metric sums.

DAPO, like verl and NeMo RL, makes several optimizer updates per training step: the step's
groups are split into mini-batches (`optimizer.groups_per_update`; verl's
`ppo_mini_batch_size`), each mini-batch is one update, and the whole list may be walked more
than once (`optimizer.passes_per_step`; verl's `ppo_epochs`). Every update is scored against
the same proximal ("old") log-probs, computed once before the step's first update, which is
what lets the ratio move away from 1 and the clip act.

A mini-batch is split into micro-batches by token budget for memory; the loss of an update is
normalised by its mini-batch's token (or sequence) count, so the micro-batch split changes
nothing but floating-point order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from refill.trainer.loss import LossTerms
from refill.trainer.sequence_batches import MicroBatch, TrainSequence, collate, pack


@dataclass
class MiniBatch:
    """The sequences of one optimizer update, packed into micro-batches, with what the step
    scored for them before its first update (filled by the trainer)."""

    sequences: list[TrainSequence]
    micro: list[MicroBatch]
    #: Per micro-batch: proximal log-probs at the sampling temperature.
    old: list[torch.Tensor] = field(default_factory=list)
    #: Per micro-batch: proximal log-probs under temperature and top-p (None at top_p = 1).
    old_processed: list[torch.Tensor | None] = field(default_factory=list)
    #: Per micro-batch: the reference policy's log-probs (None without a KL term).
    ref: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.sequences)


def split_into_mini_batches(
    sequences: list[TrainSequence],
    group_order: list[int],
    groups_per_update: int | None,
    micro_batch_tokens: int,
    pad_id: int,
) -> list[MiniBatch]:
    """The step's sequences as mini-batches of `groups_per_update` groups each (in the order
    of `group_order`, a list of attempt ids; None: one mini-batch), packed into micro-batches.

    A group's completions stay together, so each update sees whole groups, whose advantages
    were computed together. Groups whose completions are all empty add no sequence, and a
    mini-batch left with none is dropped: there is nothing to update on.
    """
    by_group: dict[int, list[TrainSequence]] = {attempt: [] for attempt in group_order}
    for seq in sequences:
        by_group[seq.attempt_id].append(seq)
    size = groups_per_update or max(len(group_order), 1)
    mini_batches = []
    for start in range(0, len(group_order), size):
        chosen = [seq for a in group_order[start : start + size] for seq in by_group[a]]
        if not chosen:
            continue
        plan = pack([seq.length for seq in chosen], micro_batch_tokens)
        micro = [collate([chosen[i] for i in idx], pad_id) for idx in plan]
        mini_batches.append(MiniBatch(sequences=chosen, micro=micro))
    return mini_batches


@dataclass
class StepSums:
    """Token sums over a training step, turned into its metrics by `metrics`.

    Two denominators: the step's tokens (scored once, before the first update: entropy,
    advantages, importance weights) and the tokens visited by the updates (each token once
    per pass: clip fractions, ratio, KL).
    """

    step_tokens: float = 0.0
    entropy: float = 0.0
    advantage_abs: float = 0.0
    importance_weight: float = 0.0
    truncated: float = 0.0
    visited: float = 0.0
    clipped_low: float = 0.0
    clipped_high: float = 0.0
    ratio: float = 0.0
    kl: float = 0.0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def add_update_terms(self, terms: LossTerms) -> None:
        self.visited += terms.tokens
        self.clipped_low += terms.clipped_low
        self.clipped_high += terms.clipped_high
        self.ratio += terms.ratio_sum
        self.kl += terms.kl_sum

    def metrics(self) -> dict[str, float]:
        tokens, visited = self.step_tokens, self.visited
        updates = len(self.losses)
        return {
            "loss": sum(self.losses) / updates,
            "clip_fraction": (self.clipped_low + self.clipped_high) / visited,
            "clip_fraction_lower": self.clipped_low / visited,
            "clip_fraction_upper": self.clipped_high / visited,
            "ratio_mean": self.ratio / visited,
            "entropy": self.entropy / tokens,
            "grad_norm": sum(self.grad_norms) / updates,
            "grad_norm_max": max(self.grad_norms),
            "tokens": tokens,
            "updates": float(updates),
            "advantage_abs_mean": self.advantage_abs / tokens,
            "importance_weight_mean": self.importance_weight / tokens,
            "importance_weight_truncated_fraction": self.truncated / tokens,
        }
