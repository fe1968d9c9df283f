from __future__ import annotations

import numpy as np
import pytest

from refill.rewards.arith import exact_match
from refill.rewards.scoring import RewardError, score_group


def test_scores_in_order_with_kwargs():
    assert score_group(exact_match, ["7", "8", "7\n"], {"answer": "7"}, {}) == [1.0, 0.0, 1.0]
    assert score_group(exact_match, ["7"], {"a": "7"}, {"answer_key": "a"}) == [1.0]


def test_numeric_types_are_accepted_as_floats():
    values = iter([1, True, np.float32(0.5), np.int64(2)])
    rewards = score_group(lambda c, r: next(values), ["a", "b", "c", "d"], {}, None)
    assert rewards == [1.0, 1.0, 0.5, 2.0]
    assert all(type(r) is float for r in rewards)


def test_a_raising_reward_names_the_completion():
    def fn(completion, row):
        if completion == "boom":
            raise ZeroDivisionError("division by zero")
        return 0.0

    with pytest.raises(RewardError) as info:
        score_group(fn, ["ok", "ok", "boom"], {}, {})
    assert info.value.index == 2
    assert "completion 2" in str(info.value) and "ZeroDivisionError" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -float("inf"), "1.0", None, 1 + 2j, [1.0]]
)
def test_non_finite_or_non_numeric_values_are_data_failures(bad):
    with pytest.raises(RewardError, match="completion 1"):
        score_group(lambda c, r: bad if c == "x" else 1.0, ["y", "x"], {}, {})


def test_base_exception_timeouts_become_reward_errors_but_interrupts_propagate():
    class LibraryTimeout(BaseException):
        pass

    def times_out(completion, row):
        raise LibraryTimeout()

    with pytest.raises(RewardError, match="LibraryTimeout"):
        score_group(times_out, ["a"], {}, {})

    def interrupted(completion, row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_group(interrupted, ["a"], {}, {})


def test_unknown_kwargs_are_data_failures_not_crashes():
    with pytest.raises(RewardError, match="TypeError"):
        score_group(exact_match, ["7"], {"answer": "7"}, {"answr_key": "x"})
