"""DAPO's clipped policy-gradient loss, with optional KL and importance correction.

Per completion token t of a sequence with advantage A:

    ratio_t  = exp(logp_new_t - logp_old_t)
    pg_t     = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
    kl_t     = exp(logp_ref_t - logp_new_t) - (logp_ref_t - logp_new_t) - 1     (k3 estimator)
    w_t      = min(exp(logp_old_t - logp_sampling_t), truncation)               (if corrected)
    loss_t   = w_t * (pg_t + beta * kl_t)

`logp_old` is the trainer's own recomputation with the weights it is about to update (the
PPO "old policy"); `logp_sampling` is what the engine reported while sampling, possibly with
an older weight version, and `w_t` corrects for that gap. The weight is a constant (no
gradient flows through it).

Aggregation is over the whole optimizer step, which may span many micro-batches, so the
normaliser is passed in rather than read off the micro-batch: token-level (DAPO) divides the
sum over every completion token of the step by the step's token count, so a long completion
weighs in proportion to its length; sequence-level averages each sequence over its own tokens,
then averages sequences. Either way the gradient of a step does not depend on how its batch
was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossTerms:
    """One micro-batch's share of the step loss, and sums for the step's metrics.

    The sums are token sums (not means) so micro-batches add up to exact step figures.
    """

    loss: torch.Tensor  # scalar with grad; already divided by the step's normaliser
    tokens: float
    clipped_low: float
    clipped_high: float
    kl_sum: float
    importance_weight_sum: float
    advantage_abs_sum: float


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(new || ref) per sampled token: unbiased and >= 0."""
    log_ratio = logp_ref - logp_new
    return torch.exp(log_ratio) - log_ratio - 1.0


def truncated_importance_weights(
    logp_old: torch.Tensor, logp_sampling: torch.Tensor, truncation: float | None
) -> torch.Tensor:
    """`min(pi_old / pi_sampling, truncation)` per token (no cap when None), without gradient."""
    weights = torch.exp(logp_old - logp_sampling)
    if truncation is not None:
        weights = weights.clamp(max=truncation)
    return weights.detach()


def dapo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    token_level: bool,
    step_tokens: float,
    step_sequences: float,
    logp_sampling: torch.Tensor | None = None,
    truncation: float | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> LossTerms:
    """The loss of one micro-batch as its share of the whole step's loss.

    Shapes: `logp_*` and `mask` are [batch, tokens] (mask 1 on completion tokens, 0 on
    padding); `advantages` is [batch], one per sequence. `step_tokens` / `step_sequences` are
    the totals over the whole step (all micro-batches), the normaliser of the aggregation.
    Passing `logp_sampling` turns the importance correction on (`truncation` caps it);
    passing `logp_ref` with `kl_coef > 0` adds the KL penalty.
    """
    if logp_new.shape != logp_old.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"log-prob and mask shapes differ: new {tuple(logp_new.shape)}, "
            f"old {tuple(logp_old.shape)}, mask {tuple(mask.shape)}"
        )
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(
            f"need one advantage per sequence: {tuple(advantages.shape)} for "
            f"{logp_new.shape[0]} sequences"
        )
    if step_tokens <= 0 or step_sequences <= 0:
        raise ValueError("the step has no completion tokens to train on")
    mask = mask.to(logp_new.dtype)
    adv = advantages.to(logp_new.dtype).unsqueeze(1)
    logp_old = logp_old.detach()

    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)

    kl = None
    if logp_ref is not None and kl_coef > 0:
        kl = kl_k3(logp_new, logp_ref.detach())
        per_token = per_token + kl_coef * kl

    if logp_sampling is not None:
        weights = truncated_importance_weights(logp_old, logp_sampling, truncation)
        per_token = per_token * weights
    else:
        weights = torch.ones_like(logp_new)

    masked = per_token * mask
    if token_level:
        loss = masked.sum() / step_tokens
    else:
        lengths = mask.sum(dim=1)
        has_tokens = lengths > 0
        per_sequence = masked.sum(dim=1)[has_tokens] / lengths[has_tokens]
        loss = per_sequence.sum() / step_sequences

    with torch.no_grad():
        # Where the min picks the clipped, constant branch: exactly the tokens with no gradient.
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype) * mask
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype) * mask
        return LossTerms(
            loss=loss,
            tokens=float(mask.sum()),
            clipped_low=float(low.sum()),
            clipped_high=float(high.sum()),
            kl_sum=float((kl * mask).sum()) if kl is not None else 0.0,
            importance_weight_sum=float((weights * mask).sum()),
            advantage_abs_sum=float((adv.abs() * mask).sum()),
        )
