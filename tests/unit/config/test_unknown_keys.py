"""Unknown keys are errors that suggest the nearest name, or say where refill keeps the key."""

from __future__ import annotations

import pytest

from .helpers import problem_at


def test_typo_suggests_nearest_key() -> None:
    p = problem_at("grpo.num_prompt_per_step", {"grpo": {"num_prompt_per_step": 16}})
    assert p.message == "unknown key"
    assert "did you mean grpo.num_prompts_per_step?" in p.fix


def test_nested_typo_suggests_nearest_key() -> None:
    p = problem_at("generation.sim.latency.mean_second",
                   {"generation": {"sim": {"latency": {"mean_second": 1}}}})
    assert "generation.sim.latency.mean_seconds" in p.fix


def test_top_level_typo_suggests_section() -> None:
    p = problem_at("rollout_failures", {"rollout_failures": {}})
    assert "did you mean rollout_failure?" in p.fix


def test_nemo_rl_rollout_failure_block_says_where_refill_keeps_it() -> None:
    p = problem_at("async_rl.rollout_failure",
                   {"async_rl": {"rollout_failure": {"max_replacement_attempts": 16}}})
    assert "top-level" in p.message
    assert "rollout_failure.<key>" in p.fix


def test_nemo_rl_sampler_lookahead_says_where_refill_keeps_it() -> None:
    p = problem_at("async_rl.sampler.max_lookahead_versions",
                   {"async_rl": {"sampler": {"name": "in_order", "max_lookahead_versions": 1}}})
    assert "async_rl.max_lookahead_versions" in p.fix


def test_key_that_exists_in_another_section_is_pointed_there() -> None:
    p = problem_at("grpo.max_replacement_attempts", {"grpo": {"max_replacement_attempts": 4}})
    assert "rollout_failure.max_replacement_attempts" in p.fix


def test_unrelated_key_lists_the_valid_keys() -> None:
    p = problem_at("loss.zzz", {"loss": {"zzz": 1}})
    assert "ratio_clip_min" in p.fix


@pytest.mark.parametrize("section", ["policy", "cluster", "loss_fn", "checkpointing"])
def test_nemo_rl_sections_get_a_hint(section: str) -> None:
    p = problem_at(section, {section: {}})
    assert p.message.startswith("unknown key; ")
    assert p.fix
