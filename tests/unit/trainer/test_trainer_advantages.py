"""Group-relative advantages and overlong shaping, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from refill.trainer.advantages import group_advantages, overlong_penalty, shape_rewards


def test_std_normalised_known_group():
    # mean 0.5, population std 0.5: (1 - 0.5) / 0.5 = +1, (0 - 0.5) / 0.5 = -1.
    adv = group_advantages([1, 0, 0, 1])
    assert adv == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_uses_population_std():
    # [1, 0, 0]: mean 1/3, population std sqrt(2)/3 (sample std would be 1/sqrt(3)).
    adv = group_advantages([1, 0, 0])
    std = math.sqrt(2) / 3
    assert adv == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std], rel=1e-5)


def test_mean_centred_without_normalisation():
    assert group_advantages([1, 0, 0, 0], normalize=False) == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )


def test_leave_one_out_baseline():
    # r_i minus the mean of the others: 1 - 1/3 = 2/3 and 0 - 2/3 = -2/3.
    assert group_advantages([1, 0, 0, 1], normalize=False, leave_one_out=True) == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    )
    # Normalised by the group's population std (0.5).
    assert group_advantages([1, 0, 0, 1], leave_one_out=True) == pytest.approx(
        [4 / 3, -4 / 3, -4 / 3, 4 / 3], rel=1e-5
    )


def test_zero_variance_group_has_exactly_zero_advantages():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0], leave_one_out=True, normalize=False) == [0.0, 0.0]


def test_a_group_within_the_zero_variance_tolerance_has_zero_advantages():
    """The ledger judges a group by `grpo.zero_variance_tolerance`; the trainer judged by exact
    equality, so a spread of 1e-6 (no signal, by the ledger) was scaled up to +-0.33."""
    assert group_advantages([0.0, 1e-6]) == pytest.approx([-1 / 3, 1 / 3], rel=1e-3)  # exact test
    assert group_advantages([0.0, 1e-6], tolerance=1e-6) == [0.0, 0.0]
    assert group_advantages([0.5, 0.5 + 5e-7, 0.5], leave_one_out=True, tolerance=1e-6) == [0.0, 0.0, 0.0]
    assert group_advantages([0.0, 1e-3], tolerance=1e-6) == pytest.approx([-1.0, 1.0], rel=1e-2)


def test_leave_one_out_needs_two():
    with pytest.raises(ValueError, match="at least two"):
        group_advantages([1.0], leave_one_out=True)


def test_overlong_penalty_at_the_buffer_edges():
    # max 20, buffer 4, penalty 1: free up to 16 tokens, -1/4 per token after, -1 from 20 on.
    kw = dict(max_response_length=20, buffer_length=4, penalty=1.0)
    assert overlong_penalty(10, **kw) == 0.0
    assert overlong_penalty(16, **kw) == 0.0
    assert overlong_penalty(17, **kw) == pytest.approx(-0.25)
    assert overlong_penalty(18, **kw) == pytest.approx(-0.5)
    assert overlong_penalty(20, **kw) == pytest.approx(-1.0)
    assert overlong_penalty(25, **kw) == pytest.approx(-1.0)
    assert overlong_penalty(18, max_response_length=20, buffer_length=4, penalty=0.5) == (
        pytest.approx(-0.25)
    )


def test_shaping_then_advantages():
    # Two right answers, one of them in the buffer: shaped rewards [1, 0.75, 0, 0].
    shaped = shape_rewards(
        [1, 1, 0, 0], [5, 17, 5, 5], max_response_length=20, buffer_length=4, penalty=1.0
    )
    assert shaped == pytest.approx([1.0, 0.75, 0.0, 0.0])
    adv = group_advantages(shaped, normalize=False)
    assert adv == pytest.approx([1 - 0.4375, 0.75 - 0.4375, -0.4375, -0.4375])
