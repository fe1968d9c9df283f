"""The ``sim`` generation back-end: simulated rollouts for tests, benchmarks and capacity planning.

No model runs. Each prompt has a *solve rate* ``r`` drawn from ``Beta(alpha, beta)`` with an RNG
keyed by ``(generation.sim.seed, prompt key)``, so the same prompt is always equally hard, across
attempts, workers and runs. Each of a group's ``n`` completions solves the prompt with probability
``r``, drawn from an RNG seeded by the request's seed (an attempt's seed is the run seed plus its
attempt id, so a retry is a fresh draw and a replay is identical). A completion's text is
``refill.rewards.sim.SOLVED_MARKER`` or ``UNSOLVED_MARKER``; the reward function
``refill.rewards.sim:solved`` turns it into 1.0 / 0.0, so a simulated run scores rewards along
the same path as a real one.

The fraction of zero-variance groups (all solved or all failed) is then

    p = E[r**n + (1 - r)**n] = (B(alpha + n, beta) + B(alpha, beta + n)) / B(alpha, beta)

(``expected_zero_variance_fraction``). Setting ``zero_variance_fraction`` instead of the two Beta
parameters picks the symmetric ``Beta(a, a)`` that yields that ``p`` for the request's ``n``
(``symmetric_beta_for_zero_variance``); reachable values lie in ``(2**(1 - n), 1)``.

Knobs (``generation.sim.*``, defaults in brackets):

- ``seed`` [null: ``run.seed``]: keys the per-prompt solve rates; fix it to keep the same
  difficulty per prompt across runs with different seeds.
- ``solve_rate_alpha`` [1.0], ``solve_rate_beta`` [1.0]: the Beta of the solve rates (uniform by
  default: ``p = 2 / (n + 1)``).
- ``zero_variance_fraction`` [null]: target ``p``; when set it overrides the two above.
- ``key_field`` [null]: a row field that identifies the prompt (e.g. ``id``); by default the
  prompt text is the key.
- ``learning`` {``share`` [0.0], ``rate`` [0.05]}: the model learns. A ``share`` of the
  prompts (chosen by a draw keyed by the seed and the prompt key) have a solve rate that rises
  with the weight version ``v`` the engine holds: ``r_v = 1 - (1 - r) * (1 - rate)**v``; the
  others keep ``r``. A prompt all-failed at first can then become useful, so pre-rollout
  skipping (``data.prompt_skipping``) is tested against a moving target, not a fixed one.
- ``latency`` {``distribution``: ``constant`` | ``lognormal`` | ``exponential`` [constant],
  ``mean_seconds`` [0.0], ``sigma`` [0.5]}: per-group latency, drawn from the request's seed.
  ``sigma`` is the log-space standard deviation of ``lognormal``, whose mean stays
  ``mean_seconds``. A batch sleeps the longest latency among its groups, since an engine runs
  the groups of a batch concurrently.
- ``virtual`` [false]: do not sleep; the sampled latency is still reported as each output's
  ``generation_seconds``, for virtual-time benchmarks and fleet capacity planning.
- ``failure_rate`` [0.0]: probability that a request fails with an infra error
  (``EngineError``), drawn from the request's seed.
- ``tokens_per_completion`` [8], ``vocab_size`` [100]: fake token ids in ``[0, vocab_size)`` and
  fake (negative, finite) log-probs, so the trainer and ledger see well-formed payloads. Each
  completion holds them as 1-D numpy arrays (``int64`` and ``float64``), not lists: the claim
  check packs them without a Python number per token (``ResultMessage.to_json`` writes lists).
- ``wrong_group_size_rate`` [0.0]: probability that a group comes back with one completion
  too few (one too many when ``n`` is 1), drawn from the request's seed: a malformed output the
  ledger must record as a data failure (fault tests).
- ``oversized_rate`` [0.0]: probability that a group comes back larger than
  ``infra.max_result_bytes`` (its first completion's text padded past the limit), drawn from
  the request's seed: an output the worker must refuse to send (fault tests).

``load_weights`` only records the version.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from refill.models.payload import Completion, GenerationRequest
from refill.rewards.sim import SOLVED_MARKER, UNSOLVED_MARKER
from refill.tasks.backends.base import EngineError, GenerationOutput, engine_config, stable_seed

LATENCY_DISTRIBUTIONS = ("constant", "lognormal", "exponential")


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def expected_zero_variance_fraction(alpha: float, beta: float, n: int) -> float:
    """``E[r**n + (1 - r)**n]`` for ``r ~ Beta(alpha, beta)``: the chance a group of ``n`` 0/1
    rewards has no spread."""
    if alpha <= 0 or beta <= 0:
        raise ValueError(f"Beta parameters must be positive, got alpha={alpha}, beta={beta}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    base = _log_beta(alpha, beta)
    return math.exp(_log_beta(alpha + n, beta) - base) + math.exp(_log_beta(alpha, beta + n) - base)


def symmetric_beta_for_zero_variance(target: float, n: int) -> float:
    """The ``a`` of ``Beta(a, a)`` whose zero-variance fraction at group size ``n`` is ``target``.

    ``p(a)`` falls monotonically from 1 (``a -> 0``: every prompt always or never solved) to
    ``2**(1 - n)`` (``a -> inf``: every prompt a coin flip), so bisection in ``log a`` finds it.
    """
    low_p = 2.0 ** (1 - n)
    if not low_p < target < 1.0:
        raise ValueError(
            f"generation.sim.zero_variance_fraction={target} cannot be reached with groups of "
            f"n={n}: a symmetric Beta gives values in ({low_p:.6g}, 1)"
        )
    lo, hi = math.log(1e-9), math.log(1e9)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if expected_zero_variance_fraction(math.exp(mid), math.exp(mid), n) > target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


@dataclass(frozen=True)
class Learning:
    """``generation.sim.learning``: see the module docstring."""

    share: float
    rate: float

    def __post_init__(self) -> None:
        for name in ("share", "rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"generation.sim.learning.{name} must be in [0, 1]")

    def learns(self, seed: int, key: str) -> bool:
        return random.Random(stable_seed(seed, "learns", key)).random() < self.share

    def moved(self, rate: float, version: int) -> float:
        return 1.0 - (1.0 - rate) * (1.0 - self.rate) ** max(0, version)


@dataclass(frozen=True)
class Latency:
    distribution: str = "constant"
    mean_seconds: float = 0.0
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if self.distribution not in LATENCY_DISTRIBUTIONS:
            raise ValueError(
                f"generation.sim.latency.distribution must be one of "
                f"{', '.join(LATENCY_DISTRIBUTIONS)}; got {self.distribution!r}"
            )
        if self.mean_seconds < 0:
            raise ValueError("generation.sim.latency.mean_seconds must be >= 0")
        if self.sigma < 0:
            raise ValueError("generation.sim.latency.sigma must be >= 0")

    def sample(self, rng: random.Random) -> float:
        if self.mean_seconds == 0 or self.distribution == "constant":
            return self.mean_seconds
        if self.distribution == "exponential":
            return rng.expovariate(1.0 / self.mean_seconds)
        # Shift mu so that the mean, not the median, equals mean_seconds.
        mu = math.log(self.mean_seconds) - 0.5 * self.sigma**2
        return rng.lognormvariate(mu, self.sigma)


class SimEngine:
    """Simulated engine; see the module docstring for its model and knobs."""

    def __init__(
        self,
        *,
        seed: int = 0,
        solve_rate_alpha: float = 1.0,
        solve_rate_beta: float = 1.0,
        zero_variance_fraction: float | None = None,
        key_field: str | None = None,
        latency: Latency | None = None,
        learning: Learning | None = None,
        failure_rate: float = 0.0,
        tokens_per_completion: int = 8,
        vocab_size: int = 100,
        virtual: bool = False,
        wrong_group_size_rate: float = 0.0,
        oversized_rate: float = 0.0,
        oversized_chars: int = 64 * 2**20 + 1,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if solve_rate_alpha <= 0 or solve_rate_beta <= 0:
            raise ValueError("generation.sim.solve_rate_alpha and solve_rate_beta must be positive")
        if zero_variance_fraction is not None and not 0 < zero_variance_fraction < 1:
            raise ValueError("generation.sim.zero_variance_fraction must be in (0, 1)")
        if not 0 <= failure_rate <= 1:
            raise ValueError("generation.sim.failure_rate must be in [0, 1]")
        if tokens_per_completion < 1:
            raise ValueError("generation.sim.tokens_per_completion must be at least 1")
        if vocab_size < 1:
            raise ValueError("generation.sim.vocab_size must be at least 1")
        if not 0 <= wrong_group_size_rate <= 1:
            raise ValueError("generation.sim.wrong_group_size_rate must be in [0, 1]")
        if not 0 <= oversized_rate <= 1:
            raise ValueError("generation.sim.oversized_rate must be in [0, 1]")
        self.seed = seed
        self.alpha = solve_rate_alpha
        self.beta = solve_rate_beta
        self.zero_variance_fraction = zero_variance_fraction
        self.key_field = key_field
        self.latency = latency or Latency()
        self.learning = learning
        self.failure_rate = failure_rate
        self.tokens_per_completion = tokens_per_completion
        self.vocab_size = vocab_size
        self.virtual = virtual
        self.wrong_group_size_rate = wrong_group_size_rate
        self.oversized_rate = oversized_rate
        self.oversized_chars = oversized_chars
        self._sleep = sleep
        self._symmetric: dict[int, float] = {}
        self.weight_version: int | None = None
        self.loaded_versions: list[int] = []
        self.calls = 0

    @classmethod
    def from_config(cls, config: Any, *, virtual: bool | None = None, **kwargs: Any) -> SimEngine:
        config = engine_config(config)
        sim = config.generation.sim
        latency = Latency(
            distribution=sim.latency.distribution,
            mean_seconds=sim.latency.mean_seconds,
            sigma=sim.latency.sigma,
        )
        return cls(
            seed=config.run.seed if sim.seed is None else sim.seed,
            solve_rate_alpha=sim.solve_rate_alpha,
            solve_rate_beta=sim.solve_rate_beta,
            zero_variance_fraction=sim.zero_variance_fraction,
            key_field=sim.key_field,
            latency=latency,
            learning=Learning(sim.learning.share, sim.learning.rate) if sim.learning.share > 0 else None,
            failure_rate=sim.failure_rate,
            tokens_per_completion=sim.tokens_per_completion,
            vocab_size=sim.vocab_size,
            virtual=sim.virtual if virtual is None else virtual,
            wrong_group_size_rate=sim.wrong_group_size_rate,
            oversized_rate=sim.oversized_rate,
            oversized_chars=config.infra.max_result_bytes + 1,
            **kwargs,
        )

    # ------------------------------------------------------------------ the model of difficulty

    def beta_params(self, n: int) -> tuple[float, float]:
        """The Beta the solve rates are drawn from for groups of ``n``."""
        if self.zero_variance_fraction is None:
            return self.alpha, self.beta
        if n not in self._symmetric:
            self._symmetric[n] = symmetric_beta_for_zero_variance(self.zero_variance_fraction, n)
        a = self._symmetric[n]
        return a, a

    def prompt_key(self, request: GenerationRequest) -> str:
        if self.key_field is None:
            return request.prompt
        if self.key_field not in request.row:
            raise KeyError(
                f"generation.sim.key_field is {self.key_field!r} but the row of attempt "
                f"{request.attempt_id} has no such field"
            )
        return str(request.row[self.key_field])

    def solve_rate(self, request: GenerationRequest) -> float:
        """The prompt's solve rate with the weights the engine holds (``learning``)."""
        alpha, beta = self.beta_params(request.n)
        key = self.prompt_key(request)
        rate = random.Random(stable_seed(self.seed, "solve-rate", key)).betavariate(alpha, beta)
        if self.learning is not None and self.learning.learns(self.seed, key):
            rate = self.learning.moved(rate, self.weight_version or 0)
        return rate

    def expected_zero_variance_fraction(self, n: int) -> float:
        return expected_zero_variance_fraction(*self.beta_params(n), n)

    # ------------------------------------------------------------------ Engine

    def _group(self, request: GenerationRequest) -> GenerationOutput:
        rate = self.solve_rate(request)
        outcomes = random.Random(stable_seed(request.seed, "outcomes"))
        length = min(self.tokens_per_completion, request.max_new_tokens)
        # The group's tokens in one draw, as numpy arrays (a row per completion) that the
        # worker packs as they are: drawn one Python number at a time they cost 7.7 ms of CPU
        # per group of 16 x 512 tokens, more than the rest of the result's path.
        tokens = np.random.default_rng(stable_seed(request.seed, "tokens"))
        token_ids = tokens.integers(0, self.vocab_size, size=(request.n, length), dtype=np.int64)
        logprobs = -tokens.standard_exponential(size=(request.n, length))
        completions = []
        for j in range(request.n):
            ok = outcomes.random() < rate
            completions.append(
                Completion(
                    token_ids=token_ids[j],
                    logprobs=logprobs[j],
                    text=SOLVED_MARKER if ok else UNSOLVED_MARKER,
                    finish_reason="stop" if length == self.tokens_per_completion else "length",
                )
            )
        if random.Random(stable_seed(request.seed, "wrong-size")).random() < self.wrong_group_size_rate:
            if len(completions) > 1:
                completions.pop()
            else:
                completions.append(completions[0])
        if random.Random(stable_seed(request.seed, "oversized")).random() < self.oversized_rate:
            completions[0].text += " " * self.oversized_chars
        prompt_ids = [b % self.vocab_size for b in request.prompt.encode("utf-8")] or [0]
        return GenerationOutput(prompt_token_ids=prompt_ids, completions=completions)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        self.calls += 1
        results: list[GenerationOutput | Exception] = []
        longest = 0.0
        for request in requests:
            latency = self.latency.sample(random.Random(stable_seed(request.seed, "latency")))
            longest = max(longest, latency)
            failure = random.Random(stable_seed(request.seed, "failure")).random()
            if failure < self.failure_rate:
                results.append(
                    EngineError(f"simulated infra failure of attempt {request.attempt_id}")
                )
                continue
            try:
                output = self._group(request)
            except (KeyError, ValueError) as exc:
                results.append(exc)
                continue
            output.weight_version = self.weight_version
            output.generation_seconds = latency
            results.append(output)
        if not self.virtual and longest > 0:
            self._sleep(longest)
        return results

    def load_weights(self, version: int, path: str | None) -> None:
        self.weight_version = version
        self.loaded_versions.append(version)

    def close(self) -> None:
        return None
