"""Turning a step's groups into padded micro-batches, and scoring them with a model.

A mini-batch's completions (the sequences of one optimizer update) are packed into
micro-batches whose padded size (sequences x longest sequence) stays within a token budget, so
memory per forward pass is bounded whatever the completion lengths are. A sequence longer than
the budget gets a micro-batch of its own.

Scoring gives the log-prob of each next token at the sampling temperature (the policy the
loss trains) and, when asked with `top_p < 1`, also under the engine's whole sampling transform
(temperature, then the top-p nucleus renormalised: `processed_logprobs`, the very function the
hf back-end samples with), which is what the engines record and so what the importance weight
must compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refill.sampling import processed_logprobs


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
    #: [B, L-1] log-prob under temperature and top-p (no grad; 0 outside the completion);
    #: None unless asked for with top_p < 1.
    processed: torch.Tensor | None = None


def score(
    model: Any,
    batch: MicroBatch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = True,
    top_p: float = 1.0,
) -> Scored:
    """Log-probs of the actual next tokens under `model` at `temperature`, in float32; with
    `top_p < 1` also under the sampling transform (`Scored.processed`)."""
    input_ids = batch.input_ids.to(device)
    raw = model(input_ids=input_ids, attention_mask=batch.attention_mask.to(device)).logits
    logits = raw[:, :-1, :].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, 1:]
    logprobs = torch.gather(logp_all, 2, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    processed = None
    if top_p < 1:
        with torch.no_grad():
            processed = _processed(raw[:, :-1, :], targets, batch, temperature, top_p, device)
    return Scored(logprobs=logprobs, entropy=entropy, processed=processed)


def _processed(
    logits: torch.Tensor,
    targets: torch.Tensor,
    batch: MicroBatch,
    temperature: float,
    top_p: float,
    device: torch.device,
) -> torch.Tensor:
    # Only completion positions: the nucleus needs a sort over the vocabulary per position.
    where = batch.completion_mask.to(device) > 0
    out = torch.zeros(targets.shape, dtype=torch.float32, device=device)
    rows = logits[where]
    count = rows.shape[0]
    if count == 0:  # a rank's padding micro-batch
        return out
    sampled = targets[where]
    logp = processed_logprobs(
        rows,
        torch.full((count,), temperature, device=device),
        torch.full((count,), top_p, device=device),
        keep=sampled,  # rounding must not cut a token the engine drew (refill.sampling)
    )
    out[where] = logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    return out
