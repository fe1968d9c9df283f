"""Every decision of SPEC §3 as a pure function, with values worked out by hand."""

from __future__ import annotations

import math

import pytest

from refill.models import decisions as d
from refill.models.payload import Completion, ResultMessage
from refill.models.rollout_codec import MAX_TOKEN_ID


def result(
    rewards: list[float],
    *,
    completions: list[Completion] | None = None,
    prompt_token_ids: list | None = None,
) -> ResultMessage:
    return ResultMessage(
        run_id=1,
        attempt_id=1,
        worker="w",
        weight_version=0,
        prompt_token_ids=[1, 2, 3] if prompt_token_ids is None else prompt_token_ids,
        completions=completions
        if completions is not None
        else [Completion(token_ids=[4, 5], logprobs=[-0.1, -2.0], text="x") for _ in rewards],
        rewards=rewards,
    )


def completion(token_ids: list, logprobs: list) -> Completion:
    return Completion(token_ids=token_ids, logprobs=logprobs, text="x")


# --- zero-variance filter ----------------------------------------------------------------


def test_reward_spread() -> None:
    assert d.reward_spread([0.25, 1.0, 0.5]) == 0.75
    assert d.reward_spread([3.0]) == 0.0
    assert d.reward_spread([]) == 0.0


@pytest.mark.parametrize(
    ("rewards", "tolerance", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.0], 0.0, True),
        ([0.0, 0.0, 0.0, 0.0], 0.0, True),
        ([0.0, 1.0, 1.0, 1.0], 0.0, False),
        # one part in a million apart: spread without tolerance, none with it
        ([0.5, 0.500001], 0.0, False),
        ([0.5, 0.500001], 1e-5, True),
        # the tolerance is inclusive: spread 0.25 <= 0.25
        ([0.0, 0.25], 0.25, True),
        ([0.0, 0.25], 0.2, False),
        ([-1.0, -1.0], 0.0, True),
    ],
)
def test_is_zero_variance(rewards: list[float], tolerance: float, expected: bool) -> None:
    assert d.is_zero_variance(rewards, tolerance) is expected


def test_is_zero_variance_defaults_to_exact_equality() -> None:
    assert d.is_zero_variance([0.3, 0.3]) is True
    assert d.is_zero_variance([0.3, 0.30000000000000004]) is False


# --- payload checks ----------------------------------------------------------------------


def test_valid_payload_has_no_problem() -> None:
    assert d.payload_problem(result([0.0, 1.0, 0.5, 1.0]), group_size=4, vocab_size=6) is None
    # log-prob 0 (a certain token) is fine, so is the top of the vocabulary
    ok = result([0.0, 1.0], completions=[completion([5], [0.0]), completion([0], [-1.0])])
    assert d.payload_problem(ok, group_size=2, vocab_size=6) is None


@pytest.mark.parametrize(
    ("message", "group_size", "vocab", "expected"),
    [
        (result([0.0, 1.0, 1.0]), 4, None, "group has 3 completions, the run expects 4"),
        (
            result([0.0, 1.0, 1.0], completions=[completion([1], [-1.0])] * 4),
            4,
            None,
            "group has 3 rewards for 4 completions",
        ),
        (result([0.0, math.nan, 1.0, 1.0]), 4, None, "reward of completion 1 is nan, not a finite number"),
        (result([math.inf, 0.0]), 2, None, "reward of completion 0 is inf, not a finite number"),
        (result([0.0, -math.inf]), 2, None, "reward of completion 1 is -inf, not a finite number"),
        (result([0.0, 1.0], prompt_token_ids=[]), 2, None, "prompt_token_ids is empty"),
        (
            result([0.0, 1.0], prompt_token_ids=[1, -1]),
            2,
            None,
            "prompt has token id -1; token ids are non-negative integers",
        ),
        (
            result([0.0, 1.0], prompt_token_ids=[1, 2.0]),
            2,
            None,
            "prompt has token id 2.0; token ids are non-negative integers",
        ),
        (
            result([0.0, 1.0], prompt_token_ids=[True]),
            2,
            None,
            "prompt has token id True; token ids are non-negative integers",
        ),
        (
            result([0.0, 1.0], prompt_token_ids=[1, 100]),
            2,
            100,
            "prompt has token id 100, outside the vocabulary of 100",
        ),
        (
            result([0.0, 1.0], completions=[completion([1], [-1.0]), completion([3, 7], [-1.0, -1.0])]),
            2,
            7,
            "completion 1 has token id 7, outside the vocabulary of 7",
        ),
        (
            result([0.0, 1.0], completions=[completion(["a"], [-1.0]), completion([1], [-1.0])]),
            2,
            None,
            "completion 0 has token id 'a'; token ids are non-negative integers",
        ),
        (
            result([0.0, 1.0], completions=[completion([1], [-1.0]), completion([1], [0.5])]),
            2,
            None,
            "completion 1 has log-prob 0.5; log-probs are finite and <= 0",
        ),
        (
            result([0.0, 1.0], completions=[completion([1], [math.nan]), completion([1], [-1.0])]),
            2,
            None,
            "completion 0 has log-prob nan; log-probs are finite and <= 0",
        ),
        (
            result([0.0, 1.0], completions=[completion([1], [-math.inf]), completion([1], [-1.0])]),
            2,
            None,
            "completion 0 has log-prob -inf; log-probs are finite and <= 0",
        ),
        (
            result([0.0, 1.0], completions=[completion([1], ["x"]), completion([1], [-1.0])]),
            2,
            None,
            "completion 0 has log-prob 'x'; log-probs are finite and <= 0",
        ),
    ],
)
def test_payload_problem(message: ResultMessage, group_size: int, vocab: int | None, expected: str) -> None:
    assert d.payload_problem(message, group_size, vocab) == expected


def test_payload_problem_without_a_vocabulary_is_bounded_by_what_the_ledger_stores() -> None:
    big = result([0.0, 1.0], prompt_token_ids=[10**9])
    assert d.payload_problem(big, 2, None) is None
    assert d.payload_problem(big, 2, 10**9) == f"prompt has token id {10**9}, outside the vocabulary of {10**9}"
    largest = result([0.0, 1.0], completions=[completion([MAX_TOKEN_ID], [-1.0]), completion([1], [-1.0])])
    assert d.payload_problem(largest, 2, None) is None
    too_big = result([0.0, 1.0], completions=[completion([1], [-1.0]), completion([MAX_TOKEN_ID + 1], [-1.0])])
    assert d.payload_problem(too_big, 2, None) == (
        f"completion 1 has token id {MAX_TOKEN_ID + 1}, above the largest the ledger stores ({MAX_TOKEN_ID})"
    )


def test_payload_problem_names_values_past_the_float_range_and_bools() -> None:
    huge = result([0.0, 1.0], completions=[completion([1], [-1.0]), completion([1], [-(10**400)])])
    assert d.payload_problem(huge, 2) == f"completion 1 has log-prob {-(10**400)!r}; log-probs are finite and <= 0"
    flag = result([0.0, 1.0], completions=[completion([1], [False]), completion([1], [-1.0])])
    assert d.payload_problem(flag, 2) == "completion 0 has log-prob False; log-probs are finite and <= 0"


def test_checked_payload_hands_back_the_arrays_it_checked() -> None:
    message = result([0.0, 1.0], completions=[completion([4, 5], [-0.5, -0.25]), completion([6], [-1.0])])
    problem, rollout = d.checked_payload(message, 2, 10)
    assert problem is None and rollout is not None
    assert (rollout.num_tokens, rollout.max_token_id()) == (3, 6)  # the prompt [1, 2, 3] counts for the id
    problem, rollout = d.checked_payload(message, 2, 6)
    assert (problem, rollout) == ("completion 1 has token id 6, outside the vocabulary of 6", None)


def test_payload_problem_names_a_completion_whose_logprobs_do_not_match_its_tokens() -> None:
    # Decoding a message checks this, but a ResultMessage built in process is not decoded.
    short = result([0.0, 1.0], completions=[completion([1], [-1.0]), completion([1, 2], [-1.0])])
    assert d.payload_problem(short, 2) == "completion 1 has 2 token ids but 1 log-probs"


def test_payload_logprob_tolerance_is_a_thousandth() -> None:
    # Engines report log-probs of certain tokens as tiny positives from rounding.
    at = result([0.0, 1.0], completions=[completion([1], [1e-3]), completion([1], [-1.0])])
    past = result([0.0, 1.0], completions=[completion([1], [2e-3]), completion([1], [-1.0])])
    assert d.payload_problem(at, 2) is None
    assert d.payload_problem(past, 2) == "completion 0 has log-prob 0.002; log-probs are finite and <= 0"


def test_payload_checks_run_in_order() -> None:
    # The group size is reported before a non-finite reward, and a reward before a token id.
    both = result([math.nan, 0.0, 1.0])
    assert d.payload_problem(both, 4) == "group has 3 completions, the run expects 4"
    nan_and_bad_token = result([math.nan, 1.0], prompt_token_ids=[-5])
    assert d.payload_problem(nan_and_bad_token, 2) == "reward of completion 0 is nan, not a finite number"


# --- dynamic-sampling budget -------------------------------------------------------------


def test_expected_exhausted_slots() -> None:
    # 0.5**4 * 4 * 10 = 0.0625 * 40
    assert d.expected_exhausted_slots(0.5, 3, 4, 10) == pytest.approx(2.5)
    # the PR's example: p = 1/3, budget 32, 4096 slots a step, 1000 steps
    assert d.expected_exhausted_slots(1 / 3, 32, 4096, 1000) == pytest.approx(4096 * 1000 / 3**33)
    assert d.expected_exhausted_slots(0.0, 3, 4, 10) == 0.0
    assert d.expected_exhausted_slots(1.0, 3, 4, 10) == 40.0


def test_exhaustion_probability_by_hand() -> None:
    # per slot (1/2)**4 = 1/16, 40 slots: 1 - (15/16)**40
    assert d.exhaustion_probability(0.5, 3, 4, 10) == pytest.approx(1 - (15 / 16) ** 40)
    assert d.exhaustion_probability(0.2, 3, 4, 3) == pytest.approx(1 - (1 - 0.0016) ** 12)
    assert d.exhaustion_probability(1.0, 3, 4, 10) == 1.0
    assert d.exhaustion_probability(0.0, 3, 4, 10) == 0.0


def test_exhaustion_probability_of_a_healthy_run_does_not_round_to_zero() -> None:
    # per slot 0.1**33 = 1e-33: the naive 1 - (1 - 1e-33)**n is exactly 0 in floating point.
    assert 1 - (1 - 0.1**33) ** (4096 * 1000) == 0.0
    risk = d.exhaustion_probability(0.1, 32, 4096, 1000)
    assert risk > 0.0
    assert risk == pytest.approx(4096 * 1000 * 1e-33, rel=1e-9)


def test_exhaustion_probability_is_monotonic_in_p_and_budget() -> None:
    ps = [d.exhaustion_probability(p, 8, 64, 100) for p in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert ps == sorted(ps) and ps[0] < ps[-1]
    budgets = [d.exhaustion_probability(0.5, b, 64, 100) for b in (1, 4, 16, 32)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]


def test_budget_message_names_slot_budget_p_and_expected_exhaustions() -> None:
    message = d.budget_exhausted_message(step=7, slot=2, budget=3, p=0.75, num_prompts_per_step=4, max_num_steps=10)
    # 0.75**4 * 4 * 10 = 0.31640625 * 40 = 12.65625
    assert "slot (step 7, index 2)" in message
    assert "drew 4 zero-variance groups in a row" in message
    assert "grpo.dynamic_sampling_max_replacements_per_slot=3" in message
    assert "p=0.750" in message
    assert "p**(budget+1) * num_prompts_per_step * max_num_steps = 12.7 exhausted slots" in message
    assert "10 steps x 4 slots" in message


def test_budget_message_names_a_stored_budget_that_differs_from_the_config() -> None:
    message = d.budget_exhausted_message(
        step=1, slot=0, budget=1, p=0.5, num_prompts_per_step=4, max_num_steps=10, config_budget=3
    )
    assert message.startswith(
        "slot (step 1, index 0) drew 2 zero-variance groups in a row, past its stored budget of 1 "
        "(the run's config says grpo.dynamic_sampling_max_replacements_per_slot=3). "
    )
    same = d.budget_exhausted_message(
        step=1, slot=0, budget=3, p=0.5, num_prompts_per_step=4, max_num_steps=10, config_budget=3
    )
    assert same == d.budget_exhausted_message(step=1, slot=0, budget=3, p=0.5, num_prompts_per_step=4, max_num_steps=10)
    assert "past grpo.dynamic_sampling_max_replacements_per_slot=3. " in same


def test_budget_message_keeps_tiny_expectations_readable() -> None:
    message = d.budget_exhausted_message(step=0, slot=0, budget=32, p=0.1, num_prompts_per_step=4096, max_num_steps=1000)
    assert "= 4.1e-27 exhausted slots" in message


# --- rollout failures --------------------------------------------------------------------


@pytest.mark.parametrize(("try_no", "limit", "expected"), [(1, 2, True), (2, 2, False), (1, 1, False), (3, 5, True)])
def test_should_retry(try_no: int, limit: int, expected: bool) -> None:
    assert d.should_retry(try_no, limit) is expected


@pytest.mark.parametrize(
    ("try_no", "expected"), [(1, 1.5), (2, 3.0), (3, 6.0), (4, 12.0), (5, 20.0), (30, 20.0)]
)
def test_retry_backoff_doubles_up_to_the_cap(try_no: int, expected: float) -> None:
    assert d.retry_backoff(try_no, 1.5, 20.0) == expected


def test_retry_backoff_zero_base_never_waits() -> None:
    assert d.retry_backoff(5, 0.0, 60.0) == 0.0


@pytest.mark.parametrize(
    ("policy", "used", "limit", "expected"),
    [
        ("replace", 0, 1, d.AfterDrop.REPLACE),
        ("replace", 1, 1, d.AfterDrop.SHRINK),
        ("replace", 2, 3, d.AfterDrop.REPLACE),
        ("replace", 3, 3, d.AfterDrop.SHRINK),
        ("shrink", 0, 5, d.AfterDrop.SHRINK),
    ],
)
def test_after_drop(policy: str, used: int, limit: int, expected: d.AfterDrop) -> None:
    assert d.after_drop(policy, used, limit) is expected


@pytest.mark.parametrize(
    ("n", "fraction", "expected"),
    [
        (10, 0.9, 9),
        (10, 1.0, 10),
        (4, 0.5, 2),
        (3, 0.5, 2),
        (7, 0.3, 3),  # 2.1 -> 3
        (100, 0.07, 7),  # 7.000000000000001
        (1, 0.01, 1),
        (8, 0.125, 1),
    ],
)
def test_min_step_groups(n: int, fraction: float, expected: int) -> None:
    assert d.min_step_groups(n, fraction) == expected


def test_min_step_groups_rounding_is_the_epsilon() -> None:
    # 100 * 0.07 is 7.000000000000001 in floating point: a naive ceil asks for 8 groups.
    assert 100 * 0.07 > 7 and math.ceil(100 * 0.07) == 8
    assert d.min_step_groups(100, 0.07) == 7


@pytest.mark.parametrize(
    ("n", "dropped", "fraction", "expected"),
    [(10, 1, 0.9, False), (10, 2, 0.9, True), (4, 2, 0.5, False), (4, 3, 0.5, True), (4, 0, 1.0, False), (4, 1, 1.0, True)],
)
def test_step_too_short(n: int, dropped: int, fraction: float, expected: bool) -> None:
    assert d.step_too_short(n, dropped, fraction) is expected


def test_short_step_message_lists_the_three_causes() -> None:
    message = d.short_step_message(
        step=5, num_prompts_per_step=10, dropped_shrunk=2, dropped_prompts=2, min_step_batch_fraction=0.9,
        recent_errors=["attempt 9: CUDA OOM", "attempt 8: lease expired"],
    )
    lines = message.splitlines()
    assert lines[0] == (
        "step 5 can train at most 8 of 10 groups, below rollout_failure.min_step_batch_fraction=0.9 "
        "(9 groups): 2 slots were shrunk after 2 prompts were dropped. Likely causes:"
    )
    assert lines[1].startswith("  1. a failing fleet")
    assert lines[2].startswith("  2. drop budgets too large for the floor")
    assert "max_attempts_per_prompt" in lines[2] and "max_replacement_attempts" in lines[2]
    assert lines[3].startswith("  3. a spare pool too small for the drop rate")
    assert "replacement_reserve_prompts" in lines[3]
    assert lines[4] == "Recent attempt errors: attempt 9: CUDA OOM; attempt 8: lease expired"


def test_short_step_message_without_errors_has_no_error_line() -> None:
    message = d.short_step_message(
        step=0, num_prompts_per_step=4, dropped_shrunk=3, dropped_prompts=3, min_step_batch_fraction=0.5
    )
    assert len(message.splitlines()) == 4
    assert "Recent attempt errors" not in message
    assert "at most 1 of 4 groups" in message and "(2 groups)" in message


@pytest.mark.parametrize(
    ("slots", "prompts", "words"),
    [
        (1, 2, "1 slot was shrunk after 2 prompts were dropped."),
        (1, 1, "1 slot was shrunk after 1 prompt was dropped."),
        (2, 5, "2 slots were shrunk after 5 prompts were dropped."),
    ],
)
def test_short_step_message_counts_slots_and_prompts_apart(slots: int, prompts: int, words: str) -> None:
    # A slot under `replace` drops its own prompt, then its replacement, before it is shrunk.
    message = d.short_step_message(
        step=3, num_prompts_per_step=4, dropped_shrunk=slots, dropped_prompts=prompts, min_step_batch_fraction=1.0
    )
    assert message.splitlines()[0] == (
        f"step 3 can train at most {4 - slots} of 4 groups, below "
        f"rollout_failure.min_step_batch_fraction=1.0 (4 groups): {words} Likely causes:"
    )


def test_consecutive_drops_message() -> None:
    message = d.consecutive_drops_message(6, 5, "worker lost")
    assert message.startswith("6 prompts in a row were dropped")
    assert "rollout_failure.max_consecutive_dropped_prompts=5" in message
    assert "Last error: worker lost." in message
    assert "Last error: unknown." in d.consecutive_drops_message(6, 5, None)


# --- spare pool and replacement source ---------------------------------------------------


@pytest.mark.parametrize(
    ("pool", "reserve", "exhausted", "expected"),
    [(3, 4, False, True), (4, 4, False, False), (0, 1, False, True), (0, 4, True, False), (10, 4, False, False)],
)
def test_spare_refill_needed(pool: int, reserve: int, exhausted: bool, expected: bool) -> None:
    assert d.spare_refill_needed(pool, reserve, exhausted) is expected


@pytest.mark.parametrize(
    ("lender", "spare", "expected"),
    [(True, True, d.Source.BORROW), (True, False, d.Source.BORROW), (False, True, d.Source.SPARE), (False, False, d.Source.SHRINK)],
)
def test_replacement_source(lender: bool, spare: bool, expected: d.Source) -> None:
    assert d.replacement_source(lender, spare) is expected


# --- barrier and staleness ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("committed", "slots", "shrunk", "expected"),
    [(4, 4, 0, True), (3, 4, 0, False), (3, 4, 1, True), (0, 4, 4, True), (4, 4, 1, False)],
)
def test_step_is_full(committed: int, slots: int, shrunk: int, expected: bool) -> None:
    assert d.step_is_full(committed, slots, shrunk) is expected


def test_staleness() -> None:
    assert d.staleness(5, 3) == 2
    assert d.staleness(4, 4) == 0


@pytest.mark.parametrize(
    ("step", "newest", "lookahead", "expected"),
    [(0, 0, 0, True), (1, 0, 0, False), (1, 0, 1, True), (2, 0, 1, False), (3, 1, 2, True), (4, 1, 2, False)],
)
def test_admissible(step: int, newest: int, lookahead: int, expected: bool) -> None:
    assert d.admissible(step, newest, lookahead) is expected


# --- adaptive over-dispatch --------------------------------------------------------------


def test_zero_variance_estimate() -> None:
    estimate = d.ZeroVarianceEstimate(zero_variance=3, total=10)
    assert estimate.p == pytest.approx(4 / 14)  # (3 + 1) / (10 + 4)
    assert estimate.measured == pytest.approx(0.3)
    empty = d.ZeroVarianceEstimate(0, 0)
    assert empty.p == 0.25 and empty.measured is None


def test_extra_attempts_by_hand() -> None:
    # p = 0.5, z = 2, 4 slots: sqrt(m) = (1 + sqrt(1 + 8)) / 1 = 4, so m = 16
    # (16 * 0.5 - 2 * sqrt(16 * 0.25) = 8 - 4 = 4 >= 4; with 15: 7.5 - 3.87 = 3.63 < 4)
    assert d.extra_attempts(4, 0, 0.5, 2.0, cap=100) == 16
    assert d.extra_attempts(4, 3, 0.5, 2.0, cap=100) == 13
    assert d.extra_attempts(4, 3, 0.5, 2.0, cap=10) == 10
    assert d.extra_attempts(4, 20, 0.5, 2.0, cap=100) == 0


@pytest.mark.parametrize("needed", [1, 2, 3, 5, 7, 8, 10, 15, 19, 20, 28])
def test_extra_attempts_without_filtering_or_margin_is_the_shortfall(needed: int) -> None:
    # At p = 0 every attempt commits: exactly the missing ones are needed. sqrt(4k)/2 squared
    # is k + 1 ulp for these k, which a plain ceil turns into one attempt too many.
    assert d.extra_attempts(needed, 0, 0.0, 0.0, cap=100) == needed
    assert d.extra_attempts(5, 2, 0.0, 0.0, cap=100) == 3
    assert d.extra_attempts(5, 2, 0.0, 2.0, cap=100) == 3  # no variance at p = 0: no margin


def test_extra_attempts_nothing_needed() -> None:
    assert d.extra_attempts(0, 0, 0.9, 2.0, cap=100) == 0
    assert d.extra_attempts(-1, 0, 0.9, 2.0, cap=100) == 0


def test_extra_attempts_at_p_one_is_capped() -> None:
    assert d.extra_attempts(1, 0, 1.0, 2.0, cap=7) == 7


def test_safe_budget_is_the_smallest_budget_under_the_risk() -> None:
    b = d.safe_budget(0.5, 8, 100)
    assert b is not None
    assert d.exhaustion_probability(0.5, b, 8, 100) <= 0.01
    assert d.exhaustion_probability(0.5, b - 1, 8, 100) > 0.01
    # 0.5**(b+1) * 800 <= ~0.01 needs b around 16
    assert 15 <= b <= 17
    assert d.safe_budget(0.999999, 4096, 1000) is None
