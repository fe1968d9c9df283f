from __future__ import annotations

import random
import sys
from types import SimpleNamespace

import pytest

from refill.models.payload import GenerationRequest
from refill.rewards.sim import SOLVED_MARKER, UNSOLVED_MARKER, solved
from refill.tasks.backends import make_engine
from refill.tasks.backends.base import EngineError, GenerationOutput
from refill.tasks.backends.sim import (
    Latency,
    SimEngine,
    expected_zero_variance_fraction,
    symmetric_beta_for_zero_variance,
)


def request(
    attempt_id: int = 1, prompt: str = "3+4=", n: int = 8, seed: int = 7, **kw
) -> GenerationRequest:
    return GenerationRequest(
        attempt_id=attempt_id,
        prompt=prompt,
        row=kw.pop("row", {"answer": "7"}),
        n=n,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=kw.pop("max_new_tokens", 16),
        seed=seed,
        **kw,
    )


def sim_config(**sim) -> SimpleNamespace:
    return SimpleNamespace(generation=SimpleNamespace(backend="sim", sim=sim))


def test_sim_backend_does_not_pull_in_heavy_libraries():
    import refill.tasks.backends  # noqa: F401
    import refill.tasks.backends.sim  # noqa: F401

    # Other tests in the session may have imported torch; what matters is that these modules
    # do not name it.
    source = open(refill.tasks.backends.sim.__file__).read()
    assert "import torch" not in source and "celery" not in source.lower()
    assert "vllm" not in sys.modules


def test_closed_form_matches_known_values():
    # Uniform solve rates: E[r^n] = 1/(n+1), twice.
    assert expected_zero_variance_fraction(1.0, 1.0, 8) == pytest.approx(2 / 9)
    # n = 1: a single completion never has spread.
    assert expected_zero_variance_fraction(0.3, 2.0, 1) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha,beta,n", [(0.4, 0.4, 8), (2.0, 0.7, 4), (1.0, 3.0, 16)])
def test_closed_form_matches_monte_carlo(alpha, beta, n):
    rng = random.Random(1234)
    draws = 40_000
    zero_variance = 0
    for _ in range(draws):
        r = rng.betavariate(alpha, beta)
        k = sum(rng.random() < r for _ in range(n))
        zero_variance += k in (0, n)
    expected = expected_zero_variance_fraction(alpha, beta, n)
    # 4 standard errors of a binomial proportion.
    tolerance = 4 * (expected * (1 - expected) / draws) ** 0.5
    assert abs(zero_variance / draws - expected) < tolerance


@pytest.mark.parametrize("target,n", [(0.4, 8), (0.2, 4), (0.9, 16), (0.01, 16)])
def test_symmetric_beta_solves_for_the_target(target, n):
    a = symmetric_beta_for_zero_variance(target, n)
    assert expected_zero_variance_fraction(a, a, n) == pytest.approx(target, rel=1e-9)


def test_unreachable_target_names_the_range():
    with pytest.raises(ValueError, match=r"n=2.*\(0\.5, 1\)"):
        symmetric_beta_for_zero_variance(0.3, 2)


def test_same_prompt_same_solve_rate_and_same_seed_same_group():
    engine = SimEngine(solve_rate_alpha=0.5, solve_rate_beta=0.5)
    a = engine.solve_rate(request(attempt_id=1, seed=1))
    b = engine.solve_rate(request(attempt_id=99, seed=555))
    assert a == b
    assert engine.solve_rate(request(prompt="9-2=")) != a
    first = engine.generate([request(seed=42)])[0]
    second = engine.generate([request(seed=42)])[0]
    assert isinstance(first, GenerationOutput)
    assert first == second


def test_key_field_keys_the_solve_rate_by_row_id():
    engine = SimEngine(key_field="id")
    a = engine.solve_rate(request(prompt="a", row={"id": 3}))
    b = engine.solve_rate(request(prompt="completely different text", row={"id": 3}))
    assert a == b
    result = engine.generate([request(row={"answer": "7"})])[0]
    assert isinstance(result, KeyError)


def test_measured_zero_variance_fraction_hits_the_configured_target():
    engine = make_engine(sim_config(zero_variance_fraction=0.4, virtual=True))
    assert isinstance(engine, SimEngine)
    n, prompts = 8, 3000
    requests = [request(attempt_id=i, prompt=f"p{i}", n=n, seed=10_000 + i) for i in range(prompts)]
    outputs = engine.generate(requests)
    zero_variance = 0
    for out in outputs:
        rewards = [solved(c.text, {}) for c in out.completions]
        zero_variance += max(rewards) == min(rewards)
    assert engine.expected_zero_variance_fraction(n) == pytest.approx(0.4)
    assert abs(zero_variance / prompts - 0.4) < 4 * (0.4 * 0.6 / prompts) ** 0.5


def test_payload_shape_tokens_and_logprobs():
    engine = SimEngine(tokens_per_completion=5, vocab_size=11)
    out = engine.generate([request(n=4)])[0]
    assert len(out.completions) == 4
    assert all(0 <= t < 11 for t in out.prompt_token_ids)
    for completion in out.completions:
        assert len(completion.token_ids) == len(completion.logprobs) == 5
        assert all(0 <= t < 11 for t in completion.token_ids)
        assert all(lp <= 0 and lp == lp for lp in completion.logprobs)
        assert completion.text in (SOLVED_MARKER, UNSOLVED_MARKER)
    short = engine.generate([request(max_new_tokens=3)])[0]
    assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in short.completions)


def test_failure_rate_fails_single_requests_deterministically():
    engine = SimEngine(failure_rate=0.3)
    requests = [request(attempt_id=i, seed=i) for i in range(400)]
    first = engine.generate(requests)
    failures = [isinstance(r, EngineError) for r in first]
    assert 0.2 < sum(failures) / len(failures) < 0.4
    assert [isinstance(r, EngineError) for r in engine.generate(requests)] == failures
    assert all(
        isinstance(r, GenerationOutput) for r, f in zip(first, failures, strict=True) if not f
    )


def test_latency_sleeps_the_longest_group_of_a_batch_unless_virtual():
    slept: list[float] = []
    engine = SimEngine(latency=Latency("exponential", mean_seconds=2.0), sleep=slept.append)
    outs = engine.generate([request(seed=s) for s in range(5)])
    latencies = [o.generation_seconds for o in outs]
    assert slept == [max(latencies)]
    assert len(set(latencies)) == 5

    virtual = SimEngine(
        latency=Latency("exponential", mean_seconds=2.0), virtual=True, sleep=slept.append
    )
    again = virtual.generate([request(seed=s) for s in range(5)])
    assert [o.generation_seconds for o in again] == latencies
    assert slept == [max(latencies)]  # no second sleep


@pytest.mark.parametrize("distribution", ["lognormal", "exponential"])
def test_latency_distributions_have_the_configured_mean(distribution):
    latency = Latency(distribution, mean_seconds=1.5, sigma=0.8)
    rng = random.Random(5)
    draws = [latency.sample(rng) for _ in range(40_000)]
    assert sum(draws) / len(draws) == pytest.approx(1.5, rel=0.05)
    assert min(draws) > 0
    assert Latency("constant", 0.25).sample(rng) == 0.25


def test_real_sleep_by_default():
    engine = make_engine(sim_config(latency={"distribution": "constant", "mean_seconds": 0.05}))
    import time

    started = time.perf_counter()
    engine.generate([request()])
    assert time.perf_counter() - started >= 0.05


def test_load_weights_records_the_version():
    engine = SimEngine()
    assert engine.weight_version is None
    engine.load_weights(3, "/nowhere")
    assert engine.weight_version == 3
    assert engine.generate([request()])[0].weight_version == 3


def test_bad_knobs_are_rejected():
    with pytest.raises(ValueError, match="distribution"):
        Latency("gaussian")
    with pytest.raises(ValueError, match="failure_rate"):
        SimEngine(failure_rate=1.5)
    with pytest.raises(ValueError, match="backend"):
        make_engine(SimpleNamespace(generation=SimpleNamespace(backend="tgi")))
