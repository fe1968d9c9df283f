"""The DAPO loss against values worked out by hand (see each test's comment)."""

from __future__ import annotations

import math

import pytest
import torch

from refill.trainer.loss import dapo_loss, kl_k3, truncated_importance_weights

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _loss(logp_new, logp_old, adv, mask=None, **kw):
    logp_new = torch.tensor(logp_new, dtype=torch.float64, requires_grad=True)
    logp_old = torch.tensor(logp_old, dtype=torch.float64)
    mask = torch.ones_like(logp_old) if mask is None else torch.tensor(mask, dtype=torch.float64)
    kw.setdefault("token_level", True)
    kw.setdefault("step_tokens", float(mask.sum()))
    kw.setdefault("step_sequences", float(mask.shape[0]))
    terms = dapo_loss(
        logp_new,
        logp_old,
        torch.tensor(adv, dtype=torch.float64),
        mask,
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        **kw,
    )
    terms.loss.backward()
    return terms, logp_new.grad


def test_low_side_clip_with_negative_advantage_has_no_gradient():
    # ratio 0.5 < 1 - 0.2 with A = -1: -min(0.5 * -1, 0.8 * -1) = -min(-0.5, -0.8) = 0.8,
    # the clipped (constant) branch, so d/dlogp = 0.
    terms, grad = _loss([[math.log(0.5)]], [[0.0]], [-1.0])
    assert terms.loss.item() == pytest.approx(0.8)
    assert grad.item() == 0.0
    assert terms.clipped_low == 1.0 and terms.clipped_high == 0.0


def test_low_ratio_with_positive_advantage_is_not_clipped():
    # ratio 0.5 with A = +1: -min(0.5, 0.8) = -0.5; d/dlogp(-ratio * A) = -ratio = -0.5.
    terms, grad = _loss([[math.log(0.5)]], [[0.0]], [1.0])
    assert terms.loss.item() == pytest.approx(-0.5)
    assert grad.item() == pytest.approx(-0.5)
    assert terms.clipped_low == 0.0 and terms.clipped_high == 0.0


def test_high_side_clip_with_positive_advantage_has_no_gradient():
    # ratio 1.5 > 1 + 0.28 with A = +1: -min(1.5, 1.28) = -1.28, constant.
    terms, grad = _loss([[math.log(1.5)]], [[0.0]], [1.0])
    assert terms.loss.item() == pytest.approx(-1.28)
    assert grad.item() == 0.0
    assert terms.clipped_high == 1.0 and terms.clipped_low == 0.0


def test_high_ratio_with_negative_advantage_is_not_clipped():
    # ratio 1.5 with A = -1: -min(-1.5, -1.28) = 1.5; gradient -ratio * A = 1.5.
    terms, grad = _loss([[math.log(1.5)]], [[0.0]], [-1.0])
    assert terms.loss.item() == pytest.approx(1.5)
    assert grad.item() == pytest.approx(1.5)
    assert terms.clipped_high == 0.0


def test_clip_is_asymmetric():
    # 1.25 is inside [0.8, 1.28] (clip-higher), but would be clipped by a symmetric 0.2.
    terms, grad = _loss([[math.log(1.25)]], [[0.0]], [1.0])
    assert grad.item() == pytest.approx(-1.25)
    assert terms.clipped_high == 0.0


def test_token_level_aggregation_weights_long_sequences_by_their_length():
    # Sequence a: 1 token, A = 2. Sequence b: 3 tokens, A = 1. Ratio 1 everywhere, so each
    # token's loss is -A. Token level: (-2 - 1 - 1 - 1) / 4 = -1.25, and each of b's tokens has
    # gradient -1/4. Sequence mean: (-2 + mean(-1, -1, -1)) / 2 = -1.5, b's tokens -1/(2*3).
    new = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    mask = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    token, g_token = _loss(new, new, [2.0, 1.0], mask, token_level=True)
    seq, g_seq = _loss(new, new, [2.0, 1.0], mask, token_level=False)
    assert token.loss.item() == pytest.approx(-1.25)
    assert seq.loss.item() == pytest.approx(-1.5)
    assert g_token[1].tolist() == pytest.approx([-0.25, -0.25, -0.25])
    assert g_seq[1].tolist() == pytest.approx([-1 / 6, -1 / 6, -1 / 6])
    # The long sequence weighs more under token-level aggregation, the short one less.
    assert g_token[1, 0].abs() > g_seq[1, 0].abs()
    assert g_token[0, 0].item() == pytest.approx(-2 / 4)
    assert g_seq[0, 0].item() == pytest.approx(-2 / 2)
    # Padding gets no gradient.
    assert g_token[0, 1:].tolist() == [0.0, 0.0]


def test_zero_advantage_gives_exactly_zero_gradient():
    new = [[-0.3, -1.2], [-2.0, -0.1]]
    old = [[-0.5, -1.0], [-1.0, -0.4]]
    terms, grad = _loss(new, old, [0.0, 0.0])
    assert torch.count_nonzero(grad).item() == 0
    assert terms.loss.item() == 0.0


def test_step_normaliser_makes_micro_batches_add_up():
    # Splitting 2 sequences into 2 micro-batches with the step totals gives the whole loss.
    new = [[-0.2, -0.7], [-1.1, -0.3]]
    old = [[-0.4, -0.6], [-1.0, -0.5]]
    whole, _ = _loss(new, old, [1.0, -0.5])
    first, _ = _loss(new[:1], old[:1], [1.0], step_tokens=4.0, step_sequences=2.0)
    second, _ = _loss(new[1:], old[1:], [-0.5], step_tokens=4.0, step_sequences=2.0)
    assert (first.loss + second.loss).item() == pytest.approx(whole.loss.item())


def test_kl_k3_value():
    # new 0.5, ref 0.25: r = 0.5, k3 = r - 1 - log r = -0.5 + log 2 = 0.193147...
    value = kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25)))
    assert value.item() == pytest.approx(-0.5 + math.log(2), rel=1e-6)
    assert kl_k3(torch.tensor(-1.0), torch.tensor(-1.0)).item() == 0.0


def test_kl_penalty_adds_beta_times_k3():
    # Zero advantage leaves only beta * k3 = 0.1 * 0.193147 on the single token.
    terms, grad = _loss(
        [[math.log(0.5)]],
        [[math.log(0.5)]],
        [0.0],
        logp_ref=torch.tensor([[math.log(0.25)]], dtype=torch.float64),
        kl_coef=0.1,
    )
    assert terms.loss.item() == pytest.approx(0.1 * (-0.5 + math.log(2)), rel=1e-6)
    # d k3 / d logp_new = 1 - exp(ref - new) = 1 - 0.5.
    assert grad.item() == pytest.approx(0.1 * 0.5)
    assert terms.kl_sum == pytest.approx(-0.5 + math.log(2), rel=1e-6)


def test_importance_weights_are_truncated_and_scale_the_loss():
    old = torch.tensor([[math.log(0.5), math.log(0.5)]])
    sampling = torch.tensor([[math.log(0.1), math.log(0.8)]])
    weights = truncated_importance_weights(old, sampling, 2.0)
    # 0.5 / 0.1 = 5 -> truncated to 2; 0.5 / 0.8 = 0.625 kept.
    assert weights.tolist()[0] == pytest.approx([2.0, 0.625])
    assert truncated_importance_weights(old, sampling, None).tolist()[0] == pytest.approx(
        [5.0, 0.625]
    )
    terms, grad = _loss(
        old.tolist(),
        old.tolist(),
        [1.0],
        logp_sampling=sampling.double(),
        truncation=2.0,
    )
    # Ratio 1, A = 1: per-token -1 times the weights, over 2 tokens.
    assert terms.loss.item() == pytest.approx(-(2.0 + 0.625) / 2)
    assert grad[0].tolist() == pytest.approx([-2.0 / 2, -0.625 / 2])
    assert terms.importance_weight_sum == pytest.approx(2.625)


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="one advantage per sequence"):
        dapo_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(3),
            torch.ones(2, 3),
            eps_low=0.2,
            eps_high=0.28,
            token_level=True,
            step_tokens=6,
            step_sequences=2,
        )


def test_kl_term_is_not_scaled_by_the_importance_weight():
    # As test_kl_penalty_adds_beta_times_k3, but the engine sampled the token at 0.1 while the
    # old policy gives it 0.5: the weight 5 is truncated to 2 and scales the policy-gradient
    # term only. With A = 0 that term is 0, so loss and gradient are beta * k3 exactly as
    # without the weight: 0.1 * (-0.5 + log 2) and 0.1 * (1 - 0.5).
    terms, grad = _loss(
        [[math.log(0.5)]],
        [[math.log(0.5)]],
        [0.0],
        logp_ref=torch.tensor([[math.log(0.25)]], dtype=torch.float64),
        kl_coef=0.1,
        logp_sampling=torch.tensor([[math.log(0.1)]], dtype=torch.float64),
        truncation=2.0,
    )
    assert terms.loss.item() == pytest.approx(0.1 * (-0.5 + math.log(2)), rel=1e-6)
    assert grad.item() == pytest.approx(0.1 * 0.5)
    assert terms.importance_weight_sum == pytest.approx(2.0)
    assert terms.truncated == 1.0
    # With A = 1 the weight doubles the policy-gradient term alone: -2 * 1 + beta * k3.
    terms, grad = _loss(
        [[math.log(0.5)]],
        [[math.log(0.5)]],
        [1.0],
        logp_ref=torch.tensor([[math.log(0.25)]], dtype=torch.float64),
        kl_coef=0.1,
        logp_sampling=torch.tensor([[math.log(0.1)]], dtype=torch.float64),
        truncation=2.0,
    )
    assert terms.loss.item() == pytest.approx(-2.0 + 0.1 * (-0.5 + math.log(2)), rel=1e-6)
    # d/dlogp: -2 * ratio (= 1) + 0.1 * 0.5.
    assert grad.item() == pytest.approx(-2.0 + 0.05)


def test_the_weight_numerator_can_be_the_processed_old_log_prob():
    # The engine sampled under top-p: its log-prob is log(0.3 / 0.6) for a token the old policy
    # gives 0.3 at temperature alone and 0.5 inside the nucleus. The weight compares the
    # processed log-probs, 0.5 / 0.5 = 1; the raw one would be 0.3 / 0.5 = 0.6.
    terms, _ = _loss(
        [[math.log(0.3)]],
        [[math.log(0.3)]],
        [1.0],
        logp_sampling=torch.tensor([[math.log(0.5)]], dtype=torch.float64),
        logp_old_processed=torch.tensor([[math.log(0.5)]], dtype=torch.float64),
    )
    assert terms.importance_weight_sum == pytest.approx(1.0)
    terms, _ = _loss(
        [[math.log(0.3)]],
        [[math.log(0.3)]],
        [1.0],
        logp_sampling=torch.tensor([[math.log(0.5)]], dtype=torch.float64),
    )
    assert terms.importance_weight_sum == pytest.approx(0.6)


def test_log_ratios_and_k3_are_clamped_as_verl_does():
    # A log-ratio of 30 is clamped to 20 before exp; k3 with ref - new = 30 becomes
    # exp(20) - 20 - 1, clamped to 10.
    terms, grad = _loss([[30.0]], [[0.0]], [-1.0], logp_ref=torch.tensor([[60.0]]).double(),
                        kl_coef=1.0)
    assert terms.ratio_sum == pytest.approx(math.exp(20.0))
    assert kl_k3(torch.tensor(0.0), torch.tensor(30.0)).item() == pytest.approx(10.0)
    assert kl_k3(torch.tensor(0.0), torch.tensor(-30.0)).item() == pytest.approx(10.0)
    assert terms.kl_sum == pytest.approx(10.0)
    assert torch.isfinite(grad).all()
    weights = truncated_importance_weights(torch.tensor([[0.0]]), torch.tensor([[-50.0]]), None)
    assert weights.item() == pytest.approx(math.exp(20.0))
