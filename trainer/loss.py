"""DAPO's clipped policy-gradient loss, with the decoupled (off-policy) correction and KL.

Per completion token t of a sequence with advantage A, with three policies: `new` (the weights
being updated), `old` (the proximal policy: the weights at the start of the training step,
scored once before its first update) and `sampling` (the behaviour policy: what the engine
reported while sampling, possibly with an older weight version):

    ratio_t  = exp(clamp(logp_new_t - logp_old_t, -20, 20))
    pg_t     = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)
    w_t      = min(exp(clamp(logp_old_t - logp_sampling_t, -20, 20)), truncation)  (if corrected)
    kl_t     = clamp(exp(d) - d - 1, -10, 10), d = clamp(logp_ref_t - logp_new_t, -20, 20)  (k3)
    loss_t   = w_t * pg_t + beta * kl_t

This is AReaL's decoupled PPO objective (`ppo_actor_loss_fn` with proximal log-probs), with
the behaviour weight truncated at the cap (truncated importance sampling) where AReaL drops
the tokens above it. The weight corrects the policy-gradient term only: the KL term is a
penalty on the current policy, whose value does not depend on which policy sampled the
token (as in verl, TRL and NeMo RL). The clamps are verl's (`compute_policy_loss`,
`kl_penalty` low_var_kl): a log-ratio past +-20 is a numerical accident, not a signal. No
gradient flows through `w_t` nor through `logp_old`.

The weight compares like with like: `logp_sampling` is the log-prob under the transform the
engine sampled with (temperature, then the top-p nucleus renormalised), so `logp_old_processed`
(the proximal policy under that same transform) is its numerator when given; without it
`logp_old` stands in, which is the same thing at top_p = 1. On fresh data the weight is then
exactly 1 up to floating-point noise, whatever top_p is.

Aggregation is over one optimizer update, which may span many micro-batches, so the
normaliser is passed in rather than read off the micro-batch: token-level (DAPO) divides the
sum over every completion token of the update's mini-batch by that mini-batch's token count,
so a long completion weighs in proportion to its length; sequence-level averages each sequence
over its own tokens, then averages sequences. Either way the gradient of an update does not
depend on how its mini-batch was split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: verl's clamp of a log-ratio before it is exponentiated.
LOG_RATIO_CLAMP = 20.0
#: verl's clamp of the k3 estimate itself.
K3_CLAMP = 10.0


@dataclass
class LossTerms:
    """One micro-batch's share of an update's loss, and sums for the step's metrics.

    The sums are token sums (not means) so micro-batches add up to exact step figures.
    """

    loss: torch.Tensor  # scalar with grad; already divided by the update's normaliser
    tokens: float
    clipped_low: float
    clipped_high: float
    kl_sum: float
    importance_weight_sum: float
    advantage_abs_sum: float
    ratio_sum: float = 0.0
    #: Tokens whose importance weight hit the truncation cap.
    truncated: float = 0.0


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(new || ref) per sampled token: unbiased and >= 0,
    clamped as verl clamps it."""
    log_ratio = (logp_ref - logp_new).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def raw_importance_weights(logp_old: torch.Tensor, logp_sampling: torch.Tensor) -> torch.Tensor:
    """`pi_old / pi_sampling` per token, before truncation, without gradient."""
    log_ratio = (logp_old - logp_sampling).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio).detach()


def truncated_importance_weights(
    logp_old: torch.Tensor, logp_sampling: torch.Tensor, truncation: float | None
) -> torch.Tensor:
    """`min(pi_old / pi_sampling, truncation)` per token (no cap when None), without gradient."""
    weights = raw_importance_weights(logp_old, logp_sampling)
    if truncation is not None:
        weights = weights.clamp(max=truncation)
    return weights


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
    logp_old_processed: torch.Tensor | None = None,
) -> LossTerms:
    """The loss of one micro-batch as its share of one optimizer update's loss.

    Shapes: `logp_*` and `mask` are [batch, tokens] (mask 1 on completion tokens, 0 on
    padding); `advantages` is [batch], one per sequence. `step_tokens` / `step_sequences` are
    the totals over the update's whole mini-batch (all its micro-batches), the normaliser of
    the aggregation. Passing `logp_sampling` turns the importance correction on (`truncation`
    caps it; `logp_old_processed`, the proximal log-probs under the engine's sampling
    transform, is the weight's numerator when given); passing `logp_ref` with `kl_coef > 0`
    adds the KL penalty.
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

    ratio = torch.exp((logp_new - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)

    truncated = torch.zeros_like(mask)
    if logp_sampling is not None:
        numerator = logp_old if logp_old_processed is None else logp_old_processed.detach()
        raw = raw_importance_weights(numerator, logp_sampling)
        weights = raw if truncation is None else raw.clamp(max=truncation)
        if truncation is not None:
            truncated = (raw > truncation).to(mask.dtype)
        per_token = per_token * weights
    else:
        weights = torch.ones_like(logp_new)

    kl = None
    if logp_ref is not None and kl_coef > 0:
        kl = kl_k3(logp_new, logp_ref.detach())
        per_token = per_token + kl_coef * kl

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
            ratio_sum=float((ratio * mask).sum()),
            truncated=float((truncated * mask).sum()),
        )
