from __future__ import annotations

import pytest

from refill.data.arith import make_row
from refill.rewards.arith import exact_match


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("7", 1.0),
        (" 7 ", 1.0),
        ("7\n3+4=7", 1.0),
        ("7<eos>", 1.0),
        ("7<eos>garbage", 1.0),
        ("\n7\n", 1.0),
        ("8", 0.0),
        ("77", 0.0),
        ("", 0.0),
        ("7 apples", 0.0),
    ],
)
def test_exact_match(completion, expected):
    assert exact_match(completion, make_row(3, 4, "+")) == expected


def test_negative_answers_and_custom_key():
    assert exact_match("-3", make_row(1, 4, "-")) == 1.0
    assert exact_match("12", {"target": 12}, answer_key="target") == 1.0


def test_missing_answer_field_raises_with_the_fields():
    with pytest.raises(KeyError, match="no 'answer' field"):
        exact_match("7", {"prompt": "3+4="})
