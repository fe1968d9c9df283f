"""decisions.payload_problem checks payloads as arrays first and falls back to loops that name
the problem: the answer must be the loops' answer for every payload (issue 7)."""

from __future__ import annotations

import math
import random

from refill.models import decisions
from refill.models.payload import Completion, ResultMessage
from refill.models.rollout_codec import MAX_TOKEN_ID


def reference(result: ResultMessage, group_size: int, vocab_size: int | None) -> str | None:
    """payload_problem as plain loops: the rules before the fast path, with the three added
    when rollouts were stored packed (a completion's log-probs one per token, token ids within
    32 bits, no bool log-probs)."""
    if len(result.completions) != group_size:
        return f"group has {len(result.completions)} completions, the run expects {group_size}"
    if len(result.rewards) != group_size:
        return f"group has {len(result.rewards)} rewards for {group_size} completions"
    for i, reward in enumerate(result.rewards):
        if not math.isfinite(reward):
            return f"reward of completion {i} is {reward}, not a finite number"
    if not result.prompt_token_ids:
        return "prompt_token_ids is empty"
    for i, c in enumerate(result.completions):
        if len(c.logprobs) != len(c.token_ids):
            return f"completion {i} has {len(c.token_ids)} token ids but {len(c.logprobs)} log-probs"
    for where, ids in [("prompt", result.prompt_token_ids)] + [
        (f"completion {i}", c.token_ids) for i, c in enumerate(result.completions)
    ]:
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                return f"{where} has token id {token!r}; token ids are non-negative integers"
            if vocab_size is not None and token >= vocab_size:
                return f"{where} has token id {token}, outside the vocabulary of {vocab_size}"
            if token > MAX_TOKEN_ID:
                return f"{where} has token id {token}, above the largest the ledger stores ({MAX_TOKEN_ID})"
    for i, completion in enumerate(result.completions):
        for logprob in completion.logprobs:
            if (
                isinstance(logprob, bool)
                or not isinstance(logprob, (int, float))
                or not _finite(logprob)
                or logprob > 1e-3
            ):
                return f"completion {i} has log-prob {logprob!r}; log-probs are finite and <= 0"
    return None


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


BAD_TOKENS = [-1, 100, 10**9, MAX_TOKEN_ID, MAX_TOKEN_ID + 1, 10**400, True, False, 1.0, "3", None]
BAD_LOGPROBS = [math.nan, math.inf, -math.inf, 0.5, 2e-3, True, False, "x", None, 0, -3, -(10**400)]


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
            if rng.random() < 0.03:
                logprobs.append(-1.0)  # one log-prob too many
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
