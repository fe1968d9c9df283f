"""Turning a step's groups into padded micro-batches, and scoring them with a model.

A step's completions are packed into micro-batches whose padded size (sequences x longest
sequence) stays within a token budget, so memory per forward pass is bounded whatever the
completion lengths are. A sequence longer than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainSequence:
    """One completion with its prompt, as the loss needs it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    sampling_logprobs: list[float]
    attempt_id: int

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    """Right-padded tensors of some sequences; position t of `completion_mask` (and of every
    per-token tensor) is the prediction of `input_ids[:, t + 1]` from the tokens up to t."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L-1], 1 where the target token is a completion token
    advantages: torch.Tensor  # [B]
    sampling_logprobs: torch.Tensor  # [B, L-1], 0 outside the completion

    @property
    def tokens(self) -> int:
        return int(self.completion_mask.sum())


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into micro-batches of padded size at most `budget` tokens.

    Sequences are taken longest first so that each micro-batch pads to similar lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        width = max(longest, lengths[i])
        if current and width * (len(current) + 1) > budget:
            batches.append(current)
            current, longest = [], 0
            width = lengths[i]
        current.append(i)
        longest = width
    if current:
        batches.append(current)
    return batches


def collate(sequences: list[TrainSequence], pad_id: int) -> MicroBatch:
    width = max(s.length for s in sequences)
    n = len(sequences)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    completion = torch.zeros((n, width - 1), dtype=torch.float32)
    sampling = torch.zeros((n, width - 1), dtype=torch.float32)
    for row, seq in enumerate(sequences):
        ids = seq.prompt_ids + seq.completion_ids
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, : len(ids)] = 1
        start = len(seq.prompt_ids) - 1
        stop = start + len(seq.completion_ids)
        completion[row, start:stop] = 1.0
        if seq.sampling_logprobs:
            sampling[row, start:stop] = torch.tensor(seq.sampling_logprobs, dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    return MicroBatch(input_ids, attention, completion, advantages, sampling)


@dataclass
class Scored:
    logprobs: torch.Tensor  # [B, L-1] log-prob of each next token
    entropy: torch.Tensor | None  # [B, L-1] entropy of each next-token distribution (no grad)


def score(
    model: Any,
    batch: MicroBatch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = True,
) -> Scored:
    """Log-probs of the actual next tokens under `model` at `temperature`, in float32."""
    input_ids = batch.input_ids.to(device)
    logits = model(input_ids=input_ids, attention_mask=batch.attention_mask.to(device)).logits
    logits = logits[:, :-1, :].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = torch.gather(logp_all, 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return Scored(logprobs=logprobs, entropy=entropy)
