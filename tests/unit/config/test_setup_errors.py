"""SPEC §5 setup errors and the type/range checks: each names its key and a fix."""

from __future__ import annotations

import pytest

from refill.config import ConfigError, config_from_dict

from .helpers import build, problem_at, problems

SAMPLERS = "tests.unit.config.sampler_fixtures"


def test_minimal_config_fills_every_default() -> None:
    cfg = build()
    assert cfg.grpo.num_prompts_per_step == 8
    assert cfg.grpo.dynamic_sampling_max_replacements_per_slot == 32
    assert cfg.loss.ratio_clip_max == 0.28
    assert cfg.infra.max_result_bytes == 64 * 1024 * 1024
    assert cfg.async_rl.sampler.name == "in_order"


def test_reserve_resolves_to_num_prompts_per_step() -> None:
    cfg = build({"grpo": {"num_prompts_per_step": 24}})
    assert cfg.rollout_failure.replacement_reserve_prompts == 24
    assert cfg.snapshot()["rollout_failure"]["replacement_reserve_prompts"] == 24


def test_dynamic_sampling_needs_two_generations() -> None:
    p = problem_at("grpo.num_generations_per_prompt", {"grpo": {"num_generations_per_prompt": 1}})
    assert "use_dynamic_sampling" in p.message
    assert "2 or more" in p.fix
    # Without dynamic sampling a single generation is legal (if useless; that is a warning).
    build({"grpo": {"num_generations_per_prompt": 1, "use_dynamic_sampling": False}})


@pytest.mark.parametrize("budget", [0, -3])
def test_filter_budget_must_be_positive(budget: int) -> None:
    p = problem_at("grpo.dynamic_sampling_max_replacements_per_slot",
                   {"grpo": {"dynamic_sampling_max_replacements_per_slot": budget}})
    assert "at least 1" in p.message and "at least 1" in p.fix


def test_replacement_attempts_under_replace() -> None:
    p = problem_at("rollout_failure.max_replacement_attempts",
                   {"rollout_failure": {"max_replacement_attempts": 0}})
    assert "replace" in p.message
    assert "shrink" in p.fix
    cfg = build({"rollout_failure": {"max_replacement_attempts": 0, "on_dropped_prompt": "shrink"}})
    assert cfg.rollout_failure.max_replacement_attempts == 0


@pytest.mark.parametrize("on_drop", ["replace", "shrink"])
def test_reserve_zero_with_dynamic_sampling_is_rejected_under_both_policies(on_drop: str) -> None:
    # Filtering draws on the spare pool whatever on_dropped_prompt says (the PR's review found
    # the guard under "replace" only, leaving "shrink" runs to shrink every filtered step).
    p = problem_at("rollout_failure.replacement_reserve_prompts",
                   {"rollout_failure": {"replacement_reserve_prompts": 0, "on_dropped_prompt": on_drop}})
    assert "use_dynamic_sampling" in p.message
    assert "num_prompts_per_step" in p.fix


def test_reserve_zero_without_dynamic_sampling_is_accepted() -> None:
    cfg = build({"grpo": {"use_dynamic_sampling": False},
                 "rollout_failure": {"replacement_reserve_prompts": 0, "on_dropped_prompt": "shrink"}})
    assert cfg.rollout_failure.replacement_reserve_prompts == 0


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01, 2])
def test_min_step_batch_fraction_outside_zero_one(fraction: float) -> None:
    p = problem_at("rollout_failure.min_step_batch_fraction",
                   {"rollout_failure": {"min_step_batch_fraction": fraction}})
    assert "(0, 1]" in p.fix


def test_min_step_batch_fraction_one_is_accepted() -> None:
    assert build({"rollout_failure": {"min_step_batch_fraction": 1.0}}).rollout_failure.min_step_batch_fraction == 1.0


def test_negative_lookahead() -> None:
    p = problem_at("async_rl.max_lookahead_versions", {"async_rl": {"max_lookahead_versions": -1}})
    assert "at least 0" in p.message


def test_windowed_staleness_beyond_lookahead() -> None:
    p = problem_at("async_rl.sampler.max_staleness_versions",
                   {"async_rl": {"max_lookahead_versions": 1,
                                 "sampler": {"name": "windowed", "max_staleness_versions": 2}}})
    assert "max_lookahead_versions" in p.message
    build({"async_rl": {"max_lookahead_versions": 2,
                        "sampler": {"name": "windowed", "max_staleness_versions": 2}}})


def test_custom_sampler_without_import_path() -> None:
    p = problem_at("async_rl.sampler.import_path", {"async_rl": {"sampler": {"name": "custom"}}})
    assert "required" in p.message


@pytest.mark.parametrize(
    ("import_path", "expected"),
    [
        ("no_such_module_xyz:Sampler", "cannot be found"),
        (f"{SAMPLERS}:Missing", "has no attribute"),
        (f"{SAMPLERS}:PlaceOnly", "lender"),
        (f"{SAMPLERS}:not_a_sampler", "place"),
        (f"{SAMPLERS}:NeedsArguments", "TypeError"),
        ("tests.unit.config.broken_module:Sampler", "boom at import"),
        (f"{SAMPLERS}.GoodSampler", "module:Name"),
    ],
)
def test_custom_sampler_that_cannot_assign_steps(import_path: str, expected: str) -> None:
    p = problem_at("async_rl.sampler.import_path",
                   {"async_rl": {"sampler": {"name": "custom", "import_path": import_path}}})
    assert expected in p.message


def test_custom_sampler_with_place_and_lender_is_accepted() -> None:
    cfg = build({"async_rl": {"sampler": {"name": "custom", "import_path": f"{SAMPLERS}:GoodSampler"}}})
    assert cfg.async_rl.sampler.import_path.endswith("GoodSampler")


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("generation", "top_p", 0, "greater than 0"),
        ("generation", "top_p", 1.5, "at most 1"),
        ("generation", "temperature", 0, "greater than 0"),
        ("generation", "max_new_tokens", 0, "at least 1"),
        ("grpo", "num_prompts_per_step", 0, "at least 1"),
        ("grpo", "max_num_steps", -1, "at least 1"),
        ("loss", "ratio_clip_min", -0.1, "at least 0"),
        ("loss", "ratio_clip_max", -0.1, "at least 0"),
        ("loss", "ratio_clip_min", 1.0, "less than 1"),
        ("optimizer", "lr", 0, "greater than 0"),
        ("optimizer", "betas", [0.9, 1.0], "[0, 1)"),
        ("optimizer", "betas", [0.9], "pair"),
        ("grpo", "num_prompts_per_step", True, "whole number"),
        ("grpo", "num_prompts_per_step", 8.5, "whole number"),
        ("grpo", "use_dynamic_sampling", "yes please", "true or false"),
        ("generation", "backend", "vlm", "'vllm'"),
        ("infra", "database_url", "mysql://db/x", "PostgreSQL or SQLite"),
        ("infra", "broker_url", "kafka://h:9092", "broker URL"),
    ],
)
def test_types_and_ranges(section: str, key: str, value: object, expected: str) -> None:
    p = problem_at(f"{section}.{key}", {section: {key: value}})
    assert expected in str(p)
    assert ". Fix: " in str(p)


def test_heartbeat_must_be_shorter_than_lease() -> None:
    p = problem_at("generation.heartbeat_seconds",
                   {"generation": {"heartbeat_seconds": 30, "lease_seconds": 30}})
    assert "lease" in p.message


def test_unreachable_simulated_zero_variance_fraction() -> None:
    # With n = 2 even the most spread solve rates give all-equal pairs half the time.
    p = problem_at("generation.sim.zero_variance_fraction",
                   {"generation": {"backend": "sim", "sim": {"zero_variance_fraction": 0.4}},
                    "grpo": {"num_generations_per_prompt": 2}})
    assert "0.5" in p.message


def test_data_needs_exactly_one_source() -> None:
    assert "neither" in problem_at("data", {"data": {"builtin": None}}).message
    assert "both" in problem_at("data", {"data": {"train_path": "x.jsonl"}}).message


def test_positional_template_field_is_rejected() -> None:
    p = problem_at("data.prompt_template", {"data": {"prompt_template": "Q: {}"}})
    assert "positional" in p.message


def test_unbalanced_template_brace_suggests_doubling() -> None:
    p = problem_at("data.prompt_template", {"data": {"prompt_template": "{prompt} \\boxed{}"}})
    assert "{{" in p.fix


def test_reward_function_needs_module_colon_function() -> None:
    p = problem_at("reward.function", {"reward": {"function": "refill.rewards.arith.exact_match"}})
    assert "module:function" in p.message


def test_every_problem_is_reported_not_only_the_first() -> None:
    found = problems({
        "grpo": {"num_prompt_per_step": 4, "num_generations_per_prompt": 1},
        "rollout_failure": {"min_step_batch_fraction": 0, "max_replacement_attempts": 0},
        "async_rl": {"max_lookahead_versions": -2},
        "generation": {"top_p": 2},
    })
    paths = {p.path for p in found}
    # A bad key in a section does not hide the cross-field checks on that section's good keys.
    assert {
        "grpo.num_prompt_per_step",
        "grpo.num_generations_per_prompt",
        "rollout_failure.min_step_batch_fraction",
        "rollout_failure.max_replacement_attempts",
        "async_rl.max_lookahead_versions",
        "generation.top_p",
    } <= paths


def test_check_reading_a_bad_key_is_skipped_rather_than_run_on_a_default() -> None:
    # max_lookahead_versions is bad, so the windowed check must not compare against its default.
    found = problems({"async_rl": {"max_lookahead_versions": "two",
                                   "sampler": {"name": "windowed", "max_staleness_versions": 2}}})
    assert [p.path for p in found] == ["async_rl.max_lookahead_versions"]


def test_problem_renders_as_path_message_fix() -> None:
    p = problem_at("grpo.dynamic_sampling_max_replacements_per_slot",
                   {"grpo": {"dynamic_sampling_max_replacements_per_slot": 0}})
    text = str(p)
    assert text.startswith("grpo.dynamic_sampling_max_replacements_per_slot: ")
    assert ". Fix: " in text


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as caught:
        config_from_dict(["grpo"], environ={})
    assert "mapping" in caught.value.problems[0].message


def test_tail_fraction_is_a_fraction_of_the_step() -> None:
    assert build({"async_rl": {"over_dispatch": {"tail_fraction": 0.05}}}).async_rl.over_dispatch.tail_fraction == 0.05
    p = problem_at("async_rl.over_dispatch.tail_fraction", {"async_rl": {"over_dispatch": {"tail_fraction": 1.5}}})
    assert str(p).startswith("async_rl.over_dispatch.tail_fraction: ")


def test_a_temperature_vllm_would_not_sample_at_is_refused_for_vllm_only() -> None:
    """vLLM refuses a temperature above 2 (0.32 on) and samples below 0.01 at 0.01, where the
    trainer scores at the configured one: every group of the run failed, or trained on skewed
    importance weights."""
    for temperature in (2.5, 0.005):
        p = problem_at("generation.temperature", {"generation": {"backend": "vllm", "temperature": temperature}})
        assert f"({temperature}) is outside [0.01, 2.0]" in p.message and "within [0.01, 2.0]" in p.fix
    assert build({"generation": {"backend": "vllm", "temperature": 2.0}}).generation.temperature == 2.0
    assert build({"generation": {"backend": "hf", "temperature": 2.5}}).generation.temperature == 2.5
