"""The decisions of SPEC §3 as pure functions: no database, no Celery, no clock.

`refill.models.ledger` loads rows, asks these functions what to do, and writes the answer.
Keeping them pure is what lets every branch be tested exhaustively and quickly
(`tests/unit/test_decisions.py`), and what lets the virtual-time benchmark drive the
production scheduling code.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from refill.models.payload import ResultMessage
from refill.models.rollout_codec import MAX_TOKEN_ID, Rollout

# --- the zero-variance filter ------------------------------------------------------------


def reward_spread(rewards: Sequence[float]) -> float:
    return max(rewards) - min(rewards) if rewards else 0.0


def is_zero_variance(rewards: Sequence[float], tolerance: float = 0.0) -> bool:
    """A group whose raw rewards are all equal (within `tolerance`) carries no GRPO signal:
    every advantage would be zero. Judged on the raw reward, before any shaping."""
    return reward_spread(rewards) <= tolerance


# --- payload checks (SPEC §3.2) ----------------------------------------------------------


def payload_problem(
    result: ResultMessage, group_size: int, vocab_size: int | None = None
) -> str | None:
    """Why a finished generation cannot be used, or None when it can."""
    return checked_payload(result, group_size, vocab_size)[0]


#: Engines report the log-prob of a certain token as a tiny positive from rounding.
LOGPROB_CEILING = 1e-3


def checked_payload(
    result: ResultMessage, group_size: int, vocab_size: int | None = None
) -> tuple[str | None, Rollout | None]:
    """`(problem, None)` for a result that cannot be used, `(None, rollout)` for one that
    can, with its token ids and log-probs as the arrays the ledger stores."""
    if len(result.completions) != group_size:
        return f"group has {len(result.completions)} completions, the run expects {group_size}", None
    if len(result.rewards) != group_size:
        return f"group has {len(result.rewards)} rewards for {group_size} completions", None
    for i, reward in enumerate(result.rewards):
        if not math.isfinite(reward):
            return f"reward of completion {i} is {reward}, not a finite number", None
    if not result.prompt_token_ids:
        return "prompt_token_ids is empty", None
    for i, completion in enumerate(result.completions):
        if len(completion.logprobs) != len(completion.token_ids):
            return f"completion {i} has {len(completion.token_ids)} token ids but {len(completion.logprobs)} log-probs", None
    # The common case in array operations (checked once per result on the consumer's serial
    # path); anything the arrays refuse goes through the loops below, which name the problem.
    rollout = Rollout.checked(result.prompt_token_ids, result.completions)
    if (
        rollout is not None
        and (vocab_size is None or rollout.max_token_id() < vocab_size)
        and rollout.logprobs_within(LOGPROB_CEILING)
    ):
        return None, rollout
    for where, ids in [("prompt", result.prompt_token_ids)] + [
        (f"completion {i}", c.token_ids) for i, c in enumerate(result.completions)
    ]:
        for token in _python_values(ids):
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                return f"{where} has token id {token!r}; token ids are non-negative integers", None
            if vocab_size is not None and token >= vocab_size:
                return f"{where} has token id {token}, outside the vocabulary of {vocab_size}", None
            if token > MAX_TOKEN_ID:
                return f"{where} has token id {token}, above the largest the ledger stores ({MAX_TOKEN_ID})", None
    for i, completion in enumerate(result.completions):
        for logprob in _python_values(completion.logprobs):
            if not _finite_number(logprob) or logprob > LOGPROB_CEILING:
                return f"completion {i} has log-prob {logprob!r}; log-probs are finite and <= 0", None
    # Unreachable while the two paths agree; a data failure of this attempt, rather than an
    # exception that would fail every result of the consumer's batch, if they ever do not.
    return "its token ids or log-probs cannot be stored (the ledger's payload checks disagree: a bug)", None  # pragma: no cover


def _python_values(values: Sequence[object]) -> Sequence[object]:
    # A numpy array's items are numpy scalars, which the checks above would call "not an
    # int"; its `tolist` gives the Python numbers they mean.
    tolist = getattr(values, "tolist", None)
    return values if type(values) is list or tolist is None else tolist()


def _finite_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past the float range
        return False


# --- dynamic-sampling budget (SPEC §3.3) -------------------------------------------------


def expected_exhausted_slots(p: float, budget: int, num_prompts_per_step: int, max_num_steps: int) -> float:
    """Expected number of slots in a run whose zero-variance draws exceed the budget.

    A slot exhausts its budget when `budget + 1` draws in a row are zero-variance, which has
    probability p**(budget+1); every slot of every step takes that draw.
    """
    return p ** (budget + 1) * num_prompts_per_step * max_num_steps


def exhaustion_probability(p: float, budget: int, num_prompts_per_step: int, max_num_steps: int) -> float:
    """Probability that at least one slot of the run exhausts its budget (the run then fails)."""
    per_slot = p ** (budget + 1)
    slots = num_prompts_per_step * max_num_steps
    # log1p keeps the tiny per-slot probabilities of a healthy run from rounding to zero.
    return -math.expm1(slots * math.log1p(-per_slot)) if per_slot < 1 else 1.0


def safe_budget(p: float, num_prompts_per_step: int, max_num_steps: int, risk: float = 0.01) -> int | None:
    """The smallest per-slot budget whose exhaustion probability over the run is at most `risk`
    (None when even 1024 replacements per slot would not do)."""
    for budget in range(1, 1025):
        if exhaustion_probability(p, budget, num_prompts_per_step, max_num_steps) <= risk:
            return budget
    return None


def budget_exhausted_message(
    *,
    step: int,
    slot: int,
    budget: int,
    p: float,
    num_prompts_per_step: int,
    max_num_steps: int,
    config_budget: int | None = None,
) -> str:
    """`budget` is the slot's stored one; `config_budget`, the run's config's when the slot's
    was changed in the ledger, so that the message names the budget that decided."""
    expected = expected_exhausted_slots(p, budget, num_prompts_per_step, max_num_steps)
    past = f"grpo.dynamic_sampling_max_replacements_per_slot={budget}"
    if config_budget is not None and config_budget != budget:
        past = (
            f"its stored budget of {budget} (the run's config says "
            f"grpo.dynamic_sampling_max_replacements_per_slot={config_budget})"
        )
    return (
        f"slot (step {step}, index {slot}) drew {budget + 1} zero-variance groups in a row, past "
        f"{past}. The measured zero-variance "
        f"fraction is p={p:.3f}; at that rate a run of {max_num_steps} steps x "
        f"{num_prompts_per_step} slots expects p**(budget+1) * num_prompts_per_step * "
        f"max_num_steps = {expected:.3g} exhausted slots. Raise the budget so that this "
        f"expectation is well below 1, or make the task less uniform for the model (p is the "
        f"share of prompts it always or never solves)."
    )


# --- rollout failures (SPEC §3.6) --------------------------------------------------------


class AfterDrop(enum.StrEnum):
    REPLACE = "replace"
    SHRINK = "shrink"


def should_retry(try_no: int, max_attempts_per_prompt: int) -> bool:
    """An infra failure is retried on the same prompt until it has had its attempts."""
    return try_no < max_attempts_per_prompt


def retry_backoff(try_no: int, base_seconds: float, max_seconds: float) -> float:
    """Exponential back-off before try `try_no + 1`."""
    return min(base_seconds * 2 ** (try_no - 1), max_seconds)


def after_drop(on_dropped_prompt: str, drop_replacements: int, drop_budget: int) -> AfterDrop:
    """Replace a dropped prompt while the slot's stored drop budget lasts (its
    `rollout_failure.max_replacement_attempts` under `replace`), else shrink the slot."""
    if on_dropped_prompt == "replace" and drop_replacements < drop_budget:
        return AfterDrop.REPLACE
    return AfterDrop.SHRINK


def min_step_groups(num_prompts_per_step: int, min_step_batch_fraction: float) -> int:
    # The epsilon keeps 0.9 * 10 = 9.000000000000002 from becoming 10.
    return math.ceil(num_prompts_per_step * min_step_batch_fraction - 1e-9)


def step_too_short(num_prompts_per_step: int, dropped_shrunk: int, min_step_batch_fraction: float) -> bool:
    """Shrinks caused by dropped prompts count against the floor; the end of the data does not."""
    return num_prompts_per_step - dropped_shrunk < min_step_groups(
        num_prompts_per_step, min_step_batch_fraction
    )


def short_step_message(
    *,
    step: int,
    num_prompts_per_step: int,
    dropped_shrunk: int,
    dropped_prompts: int,
    min_step_batch_fraction: float,
    recent_errors: Sequence[str] = (),
) -> str:
    """Why a step fell below its floor: `dropped_shrunk` slots were shrunk after dropping
    `dropped_prompts` prompts between them (a slot drops its own prompt, then each
    replacement, before it is shrunk)."""
    floor = min_step_groups(num_prompts_per_step, min_step_batch_fraction)
    lines = [
        f"step {step} can train at most {num_prompts_per_step - dropped_shrunk} of "
        f"{num_prompts_per_step} groups, below rollout_failure.min_step_batch_fraction="
        f"{min_step_batch_fraction} ({floor} groups): {_counted(dropped_shrunk, 'slot')} "
        f"{_were(dropped_shrunk)} shrunk after {_counted(dropped_prompts, 'prompt')} "
        f"{_were(dropped_prompts)} dropped. Likely causes:",
        "  1. a failing fleet: generation workers crash, time out or lose their leases "
        "(see `refill slots RUN --step S --status shrunk` and the attempts' errors);",
        "  2. drop budgets too large for the floor: rollout_failure.max_attempts_per_prompt / "
        "max_replacement_attempts let one slot consume failures that should have failed fast, "
        "or on_dropped_prompt=shrink with min_step_batch_fraction close to 1;",
        "  3. a spare pool too small for the drop rate: raise "
        "rollout_failure.replacement_reserve_prompts (at least num_prompts_per_step).",
    ]
    if recent_errors:
        lines.append("Recent attempt errors: " + "; ".join(recent_errors))
    return "\n".join(lines)


def _counted(n: int, noun: str) -> str:
    """`n` and the noun in the number it takes: 1 slot, 2 slots."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _were(n: int) -> str:
    return "was" if n == 1 else "were"


def consecutive_drops_message(count: int, limit: int, last_error: str | None) -> str:
    return (
        f"{count} prompts in a row were dropped after exhausting their retries, past "
        f"rollout_failure.max_consecutive_dropped_prompts={limit}: the generation fleet is "
        f"failing rather than a few prompts. Last error: {last_error or 'unknown'}. Fix the "
        "workers (see `refill workers` and `refill slot`), then `refill run resume RUN`."
    )


# --- spare pool (SPEC §3.4) --------------------------------------------------------------


def spare_refill_needed(pool_size: int, reserve: int, loader_exhausted: bool) -> bool:
    """The pool is topped up by one data-loader batch whenever it is below the low-water mark."""
    return not loader_exhausted and pool_size < reserve


class Source(enum.StrEnum):
    BORROW = "borrow"
    SPARE = "spare"
    SHRINK = "shrink"


def replacement_source(lender_available: bool, spare_available: bool) -> Source:
    """Borrowing fills the earlier step now; a spare prompt fills it after one generation; with
    neither, the data has ended and the slot shrinks."""
    if lender_available:
        return Source.BORROW
    if spare_available:
        return Source.SPARE
    return Source.SHRINK


# --- barrier (SPEC §3.5) -----------------------------------------------------------------


def step_is_full(committed: int, num_slots: int, shrunk: int) -> bool:
    return committed == num_slots - shrunk


def staleness(step: int, weight_version: int) -> int:
    return step - weight_version


def admissible(step: int, newest_version: int, max_lookahead_versions: int) -> bool:
    """Generation for `step` may start once the weights are at most `max_lookahead_versions`
    behind it."""
    return step - newest_version <= max_lookahead_versions


# --- adaptive over-dispatch (issue 7) ----------------------------------------------------


@dataclass(frozen=True)
class ZeroVarianceEstimate:
    """Beta-posterior estimate of the zero-variance fraction p from the groups seen so far."""

    zero_variance: int
    total: int
    prior_zero_variance: float = 1.0
    prior_total: float = 4.0

    @property
    def p(self) -> float:
        return (self.zero_variance + self.prior_zero_variance) / (self.total + self.prior_total)

    @property
    def measured(self) -> float | None:
        return self.zero_variance / self.total if self.total else None


def extra_attempts(slots_needed: int, live_attempts: int, p: float, safety_sigmas: float, cap: int) -> int:
    """How many attempts to add so that the live ones are expected to commit `slots_needed`
    non-zero-variance groups, with `safety_sigmas` standard deviations of margin.

    With m live attempts the committed count is Binomial(m, 1 - p); we want the smallest m with
    m(1-p) - z*sqrt(m p (1-p)) >= slots_needed, solved as a quadratic in sqrt(m).
    """
    if slots_needed <= 0:
        return 0
    q = max(1e-6, 1.0 - p)
    z = safety_sigmas
    b = z * math.sqrt(p * q)
    root = (b + math.sqrt(b * b + 4 * q * slots_needed)) / (2 * q)
    # The epsilon keeps an exact answer (sqrt(4 * 5) / 2 squared is 5.000000000000001) from
    # rounding up to one attempt too many, as in min_step_groups.
    wanted = math.ceil(root * root - 1e-9)
    return max(0, min(cap, wanted - live_attempts))


# --- pre-rollout skipping (issue 15; GRESO, arXiv 2506.02177) ------------------------------


class GroupKind(enum.StrEnum):
    SOLVED = "solved"  # zero-variance, every completion rewarded (GRESO's "easy")
    FAILED = "failed"  # zero-variance, none rewarded ("hard")
    MIXED = "mixed"  # rewards with spread: a useful group


def group_kind(zero_variance: bool, reward_mean: float) -> GroupKind:
    """A scored group's kind. Its rewards are all equal when it is zero-variance; refill's
    reward functions give a failure 0 and a success more, so that reward above 0 is all
    solved. (The `prompt_history` view says the same in SQL.)"""
    if not zero_variance:
        return GroupKind.MIXED
    return GroupKind.SOLVED if reward_mean > 0 else GroupKind.FAILED


def zero_variance_streak(kinds_newest_first: Iterable[GroupKind | str]) -> tuple[GroupKind | None, int]:
    """`(kind, k)`: the prompt's last `k` scored groups were all zero-variance of `kind` (all
    solved, or all failed: a change of kind ends the streak); `(None, 0)` when its last group
    had spread or it has none."""
    kind: GroupKind | None = None
    streak = 0
    for each in kinds_newest_first:
        each = GroupKind(each)
        if kind is None:
            if each is GroupKind.MIXED:
                return None, 0
            kind = each
        elif each is not kind:
            break
        streak += 1
    return kind, streak


def skip_probability(streak: int, exploration_rate: float, min_exploration: float) -> float:
    """GRESO's skip probability of a prompt whose last `streak` groups were zero-variance:
    it is generated with probability `exploration_rate ** streak`, never below
    `min_exploration`, so no prompt is skipped for good."""
    if streak <= 0:
        return 0.0
    if not 0 < exploration_rate <= 1 or not 0 < min_exploration <= 1:
        raise ValueError(
            f"exploration rates are probabilities in (0, 1]; got exploration_rate="
            f"{exploration_rate}, min_exploration={min_exploration}"
        )
    return 1.0 - max(exploration_rate**streak, min_exploration)


def saturating_streak(exploration_rates: Iterable[float], min_exploration: float) -> int | None:
    """The shortest streak whose skip probability has reached its ceiling, `1 -
    min_exploration`, under each of these rates: a longer streak skips with the same
    probability, so a prompt's history need be read no further back. None when a rate is 1 (its
    probability never moves: the whole streak counts)."""
    longest = 1
    for rate in exploration_rates:
        if rate >= 1:
            return None
        k = max(1, math.ceil(math.log(min_exploration) / math.log(rate)))
        # Exactly as `skip_probability` computes it (a logarithm can land a step either side).
        while k > 1 and rate ** (k - 1) <= min_exploration:
            k -= 1
        while rate**k > min_exploration:
            k += 1
        longest = max(longest, k)
    return longest


def skipped(uniform: float, probability: float) -> bool:
    """The draw: `uniform` is the prompt's seeded uniform in [0, 1) for this epoch."""
    return uniform < probability


def adapted_exploration_rate(
    rate: float, share: float, target: float, step: float, lowest: float, highest: float
) -> float:
    """GRESO's adaptation, once per training step and per kind: a kind whose share of the
    step's generated groups reached its target is explored less (more of it skipped), one
    below it more, by `step`, within [lowest, highest]."""
    if share >= target:
        return max(rate - step, lowest)
    return min(rate + step, highest)
