from __future__ import annotations

import threading
import time

import pytest

from refill.rewards import math as math_reward
from refill.rewards.math import VerifierError, VerifierTimeout, verify
from refill.rewards.scoring import RewardError, score_group

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# Slow for SymPy: comparing it with 1 runs into math-verify's comparison timeout.
PATHOLOGICAL = r"$\boxed{\sin(x)^{300} + \cos(x)^{300}}$"


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        ("so the probability is 0.5", r"\frac{1}{2}", 1.0),
        (r"$\boxed{\frac{1}{2}}$", r"\boxed{\frac{2}{4}}", 1.0),
        ("She has 42 left.\n#### 42", "42", 1.0),
        ("She has 41 left.\n#### 41", "42", 0.0),
        ("48 + 24 = 72 clips.\n#### 72", GSM8K_GOLD, 1.0),
        ("48 + 24 = 70 clips.\n#### 70", GSM8K_GOLD, 0.0),
        (r"$x = \boxed{3}$", "3", 1.0),
        (r"The roots are $\boxed{2, 3}$", r"\{2, 3\}", 1.0),
        # A bare gold answer is read whole: {2, 3} is not 3.
        (r"The root is $\boxed{3}$", r"\{2, 3\}", 0.0),
        (r"$\boxed{\sqrt{2}/2}$", r"\frac{\sqrt{2}}{2}", 1.0),
        (r"It costs $\boxed{\$18.90}$.", "18.9", 1.0),
        ("I do not know.", "42", 0.0),
        ("", "42", 0.0),
        (r"$\boxed{\frac{1}{", "0.5", 0.0),
    ],
)
def test_gsm8k_and_math_style_answers(completion, gold, expected):
    assert verify(completion, {"answer": gold}, isolation="inline") == expected


def test_gold_expression_anchors_bare_answers_only():
    from refill.rewards.math import gold_expression

    assert gold_expression(r"\frac{1}{2}") == r"$\frac{1}{2}$"
    assert gold_expression(GSM8K_GOLD) == "$72$"
    solution = r"so the answer is $\boxed{5}$."
    assert gold_expression(solution) == solution
    assert gold_expression(r"\frac{1}{2}", "raw") == r"\frac{1}{2}"
    with pytest.raises(ValueError, match="gold_format"):
        verify("#### 7", {"answer": "7"}, gold_format="latex", isolation="inline")


def test_integer_gold_and_custom_answer_key():
    assert verify("#### 7", {"solution": 7}, answer_key="solution", isolation="inline") == 1.0


def test_unparsable_gold_is_an_error_not_a_zero():
    with pytest.raises(VerifierError, match="does not parse"):
        verify("#### 7", {"answer": "   "}, isolation="inline")
    with pytest.raises(KeyError, match="'answer'"):
        verify("#### 7", {"question": "?"}, isolation="inline")


def test_an_internal_failure_raises(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise AttributeError("sympy changed under us")

    monkeypatch.setattr(math_verify, "verify", broken)
    with pytest.raises(VerifierError, match="AttributeError: sympy changed under us"):
        verify("#### 7", {"answer": "7"}, isolation="inline")


def test_timeouts_raise_by_default_and_score_zero_on_request():
    with pytest.raises(VerifierTimeout):
        verify(PATHOLOGICAL, {"answer": "1"}, isolation="inline", timeout_seconds=1)
    assert (
        verify(
            PATHOLOGICAL, {"answer": "1"}, isolation="inline", timeout_seconds=1, on_timeout="zero"
        )
        == 0.0
    )


def test_inline_with_timeout_refuses_worker_threads():
    errors: list[BaseException] = []

    def run():
        try:
            verify("#### 7", {"answer": "7"}, isolation="inline")
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], VerifierError)
    assert "main thread" in str(errors[0])


def test_process_isolation_works_from_worker_threads_and_kills_stuck_helpers():
    results: dict[int, float] = {}

    def run(i):
        answer = "42" if i % 2 == 0 else "41"
        results[i] = verify(f"#### {answer}", {"answer": "42"})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}

    # A timeout inside the helper comes back as VerifierTimeout through score_group.
    with pytest.raises(RewardError, match="VerifierTimeout"):
        score_group(verify, ["#### 1", PATHOLOGICAL], {"answer": "1"}, {"timeout_seconds": 1})

    # A helper that overruns the hard deadline is killed, and the next call gets a fresh one.
    pool = math_reward._get_pool(None)
    started = time.perf_counter()
    with pytest.raises(VerifierTimeout, match="did not answer"):
        pool.run({"completion": PATHOLOGICAL, "gold": "1", "timeout": 30, "options": {}}, 0.5)
    assert time.perf_counter() - started < 5
    assert verify(r"$\boxed{\frac{1}{2}}$", {"answer": "0.5"}) == 1.0


def test_the_collector_does_not_run_while_math_verify_works(monkeypatch):
    """math-verify raises its timeout from a SIGALRM handler, in whatever Python code runs when
    the alarm fires; in a garbage collector's callback the exception is dropped as unraisable and
    the verification runs on (this file's timeout test failed so in CI, the alarm landing in
    SQLAlchemy's weakref callback). So no collection runs during a verification, and the
    collector is as it was after it, whatever the verification did."""
    import gc

    import math_verify

    seen: list[bool] = []

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return True

    monkeypatch.setattr(math_verify, "verify", recording)
    assert gc.isenabled()
    assert verify("#### 7", {"answer": "7"}, isolation="inline") == 1.0
    assert seen == [False] and gc.isenabled()
    with pytest.raises(VerifierError):
        verify("#### 7", {"answer": "   "}, isolation="inline")
    assert gc.isenabled()
    gc.disable()
    try:
        verify("#### 7", {"answer": "7"}, isolation="inline")
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
