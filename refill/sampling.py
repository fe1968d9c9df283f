"""The sampling transform shared by the generation back-end and the trainer.

A sampled token's recorded log-prob describes the distribution it was drawn from: the logits
divided by the temperature, cut to the top-p nucleus and renormalised. The ``hf`` back-end samples
from it, and the trainer scores the behaviour policy with the very same function, so a fresh
sample's importance weight is exactly 1 whatever the temperature and top-p. It lives here, not in
either package, because a generation worker must not need the trainer and the trainer must not
need a generation back-end.
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of the distribution sampled from: ``softmax(logits / T)`` cut to the top-p nucleus.

    ``logits`` is ``[rows, vocab]``; ``temperature`` and ``top_p`` are ``[rows]``. Tokens outside
    the nucleus get ``-inf``. The nucleus is the smallest set of most likely tokens whose mass
    reaches ``top_p`` (the token that crosses the threshold is kept), as in transformers' and
    vLLM's top-p. Rows with temperature 0 are computed at temperature 1 (callers decode them
    greedily). A row whose ``top_p`` is 1 is never cut, whatever the other rows ask.

    ``keep`` (``[rows]`` token ids), for scoring tokens that were sampled: each row's token stays
    in its nucleus. The engine drew it, so it was inside the engine's; a recomputation whose
    rounding differs (bf16, another kernel, a batch of another shape) can put a token near the
    edge just outside, where its log-prob would be ``-inf`` and its importance weight nothing.
    """
    temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    if bool((top_p >= 1).all()):
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    sorted_p = sorted_logp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    # A row with top_p 1 beside rows that cut: float32's running sum reaches 1.0 before the end
    # of a large vocabulary, which would drop that row's tail.
    drop_sorted = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    if keep is not None:
        drop[torch.arange(drop.shape[0], device=drop.device), keep] = False
    masked = logp.masked_fill(drop, float("-inf"))
    return masked - torch.logsumexp(masked, dim=-1, keepdim=True)


def inverse_cdf_sample(logp: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logp`` (``[rows, vocab]``) by inverting its CDF at ``uniforms``
    (``[rows]``, drawn in [0, 1) as ``torch.rand`` does).

    The draw is at ``1 - u``, in (0, 1]: the first token whose cumulative mass reaches a
    positive draw has positive mass, so a token outside the nucleus (mass 0, log-prob -inf)
    is never picked. At ``u = 0`` a draw of 0 would pick token 0 whatever its mass.
    """
    cdf = logp.exp().cumsum(dim=-1)
    draw = ((1.0 - uniforms) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, draw).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
