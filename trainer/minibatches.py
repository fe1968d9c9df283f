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

A trainer of several ranks splits each mini-batch's sequences over the ranks, balanced by tokens
(`share_by_tokens`); each rank packs its share into micro-batches, and the normaliser stays the
whole mini-batch's count, so the gradients the ranks sum are the single-process gradient. FSDP
pairs the ranks' forward and backward passes collective by collective, so every rank runs as
many micro-batches as the busiest one: the others get empty ones (no completion token, no
gradient).
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

    #: This rank's share of the update's sequences, and their micro-batches.
    sequences: list[TrainSequence]
    micro: list[MicroBatch]
    #: The update's completion tokens and sequences over every rank: its loss's normaliser.
    total_tokens: int = 0
    total_sequences: int = 0
    #: Per micro-batch: proximal log-probs at the sampling temperature.
    old: list[torch.Tensor] = field(default_factory=list)
    #: Per micro-batch: proximal log-probs under temperature and top-p (None at top_p = 1).
    old_processed: list[torch.Tensor | None] = field(default_factory=list)
    #: Per micro-batch: the reference policy's log-probs (None without a KL term).
    ref: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """This rank's completion tokens."""
        return sum(len(s.completion_ids) for s in self.sequences)


def share_by_tokens(sequences: list[TrainSequence], ranks: int) -> list[list[int]]:
    """Indices of `sequences` per rank, in their order, balanced by tokens (prompt and
    completion: what a forward pass costs): longest first, each to the least loaded rank."""
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sequences)), key=lambda i: (-sequences[i].length, i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += sequences[i].length
    return [sorted(share) for share in shares]


def padding_micro_batch(pad_id: int) -> MicroBatch:
    """A micro-batch with no completion token: a rank's forward and backward pass that adds
    nothing (two attended tokens, so that every logit stays finite)."""
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        completion_mask=torch.zeros((1, 1), dtype=torch.float32),
        advantages=torch.zeros(1, dtype=torch.float32),
        sampling_logprobs=torch.zeros((1, 1), dtype=torch.float32),
    )


def split_into_mini_batches(
    sequences: list[TrainSequence],
    group_order: list[int],
    groups_per_update: int | None,
    micro_batch_tokens: int,
    pad_id: int,
    *,
    rank: int = 0,
    ranks: int = 1,
) -> list[MiniBatch]:
    """The step's sequences as mini-batches of `groups_per_update` groups each (in the order
    of `group_order`, a list of attempt ids; None: one mini-batch), with this rank's share of
    each packed into micro-batches.

    A group's completions stay together, so each update sees whole groups, whose advantages
    were computed together. Groups whose completions are all empty add no sequence, and a
    mini-batch left with none is dropped: there is nothing to update on. Every rank gets the
    same number of mini-batches, and within one the same number of micro-batches.
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
        shares = share_by_tokens(chosen, ranks)
        plans = [pack([chosen[i].length for i in share], micro_batch_tokens) for share in shares]
        mine = [chosen[i] for i in shares[rank]]
        micro = [collate([mine[i] for i in idx], pad_id) for idx in plans[rank]]
        width = max(len(plan) for plan in plans)
        micro += [padding_micro_batch(pad_id) for _ in range(width - len(micro))]
        mini_batches.append(
            MiniBatch(
                sequences=mine,
                micro=micro,
                total_tokens=sum(len(seq.completion_ids) for seq in chosen),
                total_sequences=len(chosen),
            )
        )
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
