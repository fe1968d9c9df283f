"""decisions.payload_problem checks payloads with builtins first and falls back to loops that
name the problem: the answer must be the loops' answer for every payload (issue 7)."""

from __future__ import annotations

import math
import random

from refill.models import decisions
from refill.models.payload import Completion, ResultMessage


def reference(result: ResultMessage, group_size: int, vocab_size: int | None) -> str | None:
    """payload_problem as it was before the fast path."""
    if len(result.completions) != group_size:
        return f"group has {len(result.completions)} completions, the run expects {group_size}"
    if len(result.rewards) != group_size:
        return f"group has {len(result.rewards)} rewards for {group_size} completions"
    for i, reward in enumerate(result.rewards):
        if not math.isfinite(reward):
            return f"reward of completion {i} is {reward}, not a finite number"
    if not result.prompt_token_ids:
        return "prompt_token_ids is empty"
    for where, ids in [("prompt", result.prompt_token_ids)] + [
        (f"completion {i}", c.token_ids) for i, c in enumerate(result.completions)
    ]:
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                return f"{where} has token id {token!r}; token ids are non-negative integers"
            if vocab_size is not None and token >= vocab_size:
                return f"{where} has token id {token}, outside the vocabulary of {vocab_size}"
    for i, completion in enumerate(result.completions):
        for logprob in completion.logprobs:
            if not isinstance(logprob, (int, float)) or not math.isfinite(logprob) or logprob > 1e-3:
                return f"completion {i} has log-prob {logprob!r}; log-probs are finite and <= 0"
    return None


BAD_TOKENS = [-1, 100, 10**9, True, False, 1.0, "3", None]
BAD_LOGPROBS = [math.nan, math.inf, -math.inf, 0.5, 2e-3, True, False, "x", None, 0, -3]


def test_the_fast_path_agrees_with_the_loops_on_random_payloads() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 4)
        completions = []
        for _ in range(n):
            length = rng.randint(0, 5)
            tokens: list = [rng.randrange(100) for _ in range(length)]
            logprobs: list = [-rng.random() * 5 for _ in range(length)]
            if length and rng.random() < 0.3:
                tokens[rng.randrange(length)] = rng.choice(BAD_TOKENS)
            if length and rng.random() < 0.3:
                logprobs[rng.randrange(length)] = rng.choice(BAD_LOGPROBS)
            completions.append(Completion(token_ids=tokens, logprobs=logprobs, text="t"))
        prompt: list = [rng.randrange(100) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.2:
            prompt[0] = rng.choice(BAD_TOKENS)
        message = ResultMessage(
            run_id=1, attempt_id=1, worker="w", weight_version=0, prompt_token_ids=prompt,
            completions=completions, rewards=[0.0] * n,
        )
        vocab = rng.choice([None, 100, 50])
        assert decisions.payload_problem(message, n, vocab) == reference(message, n, vocab)
