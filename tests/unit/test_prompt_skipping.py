"""Issue 15's pure parts: GRESO's decisions, the seeded uniforms, the skip settings read from
the schema, the sim back-end's learning option, `data.prompt_id_field`, and item 7 (float
noise judged as no spread by default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refill.config import RunConfig, from_snapshot
from refill.config.schema import PromptSkippingConfig
from refill.models import decisions
from refill.models.dataloader import epoch_uniforms
from refill.models.dataset import DatasetError, load_dataset
from refill.models.decisions import GroupKind
from refill.models.payload import GenerationRequest
from refill.models.skipping import SkipSettings
from refill.tasks.backends.sim import Learning, SimEngine

S, F, M = GroupKind.SOLVED, GroupKind.FAILED, GroupKind.MIXED


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        ([], (None, 0)),
        ([M, S, S], (None, 0)),
        ([S], (S, 1)),
        ([S, S, S, M, S], (S, 3)),
        ([F, F, S, S], (F, 2)),  # all-solved and all-failed apart
        (["failed", "failed"], (F, 2)),
    ],
)
def test_zero_variance_streak(kinds: list, expected: tuple) -> None:  # type: ignore[type-arg]
    assert decisions.zero_variance_streak(kinds) == expected


def test_group_kind() -> None:
    assert decisions.group_kind(True, 1.0) is S
    assert decisions.group_kind(True, 0.0) is F
    assert decisions.group_kind(True, -1.0) is F
    assert decisions.group_kind(False, 0.5) is M


def test_skip_probability_grows_with_the_streak_and_keeps_every_prompt_a_chance() -> None:
    assert decisions.skip_probability(0, 0.5, 0.01) == 0.0
    probabilities = [decisions.skip_probability(k, 0.5, 0.01) for k in range(1, 12)]
    assert probabilities[:3] == [0.5, 0.75, 0.875]
    assert probabilities == sorted(probabilities)
    assert max(probabilities) == pytest.approx(0.99)  # never above 1 - min_exploration
    assert decisions.skip_probability(1, 1.0, 0.01) == 0.0  # a rate of 1 never skips
    with pytest.raises(ValueError, match="exploration rates are probabilities"):
        decisions.skip_probability(1, 0.0, 0.01)
    assert decisions.skipped(0.2, 0.5) and not decisions.skipped(0.5, 0.5)


@pytest.mark.parametrize("min_exploration", [0.01, 0.2, 0.25, 0.3, 1.0])
def test_the_saturating_streak_is_the_shortest_whose_probability_no_longer_moves(min_exploration) -> None:
    """A longer streak skips with the same probability under every rate given (0.5 ** 2 is
    exactly 0.25: the boundary counts as reached), and a shorter one does not under some rate."""
    rates = (0.5, 0.05, 0.95)
    k = decisions.saturating_streak(rates, min_exploration)
    assert k is not None and k >= 1
    for rate in rates:
        ceiling = decisions.skip_probability(k, rate, min_exploration)
        assert all(decisions.skip_probability(k + j, rate, min_exploration) == ceiling for j in range(1, 400))
    if k > 1:
        assert any(
            decisions.skip_probability(k - 1, rate, min_exploration) != decisions.skip_probability(k, rate, min_exploration)
            for rate in rates
        )
    assert decisions.saturating_streak([0.5], 0.25) == 2
    assert decisions.saturating_streak([0.5, 1.0], 0.01) is None  # a rate of 1: no streak saturates


def test_adapted_exploration_rate_follows_greso() -> None:
    assert decisions.adapted_exploration_rate(0.5, 0.3, 0.25, 0.01, 0.05, 0.95) == pytest.approx(0.49)
    assert decisions.adapted_exploration_rate(0.5, 0.25, 0.25, 0.01, 0.05, 0.95) == pytest.approx(0.49)
    assert decisions.adapted_exploration_rate(0.5, 0.1, 0.25, 0.01, 0.05, 0.95) == pytest.approx(0.51)
    assert decisions.adapted_exploration_rate(0.05, 0.9, 0.25, 0.01, 0.05, 0.95) == 0.05
    assert decisions.adapted_exploration_rate(0.95, 0.0, 0.25, 0.01, 0.05, 0.95) == 0.95


def test_epoch_uniforms_are_seeded_by_run_and_epoch() -> None:
    first = epoch_uniforms(100, 7, 1)
    epoch_uniforms.cache_clear()
    assert epoch_uniforms(100, 7, 1) == first  # a restarted process draws the same
    assert epoch_uniforms(100, 7, 2) != first and epoch_uniforms(100, 8, 1) != first
    assert all(0.0 <= u < 1.0 for u in first)


def test_skip_settings_hold_the_schema_s_defaults() -> None:
    settings = SkipSettings.from_config({})
    knobs = PromptSkippingConfig()
    assert settings == SkipSettings(
        enabled=False,
        exploration_rate=knobs.exploration_rate,
        min_exploration=knobs.min_exploration,
        rate_step=knobs.exploration_rate_step,
        rate_min=knobs.exploration_rate_min,
        rate_max=knobs.exploration_rate_max,
        target_zero_variance=knobs.target_zero_variance,
        target_solved_fraction=knobs.target_solved_fraction,
    )
    # GRESO's numbers: p_easy = p_hard = 0.5 at first, +-0.01 within [0.05, 0.95], a 25%
    # target split 1/3 easy : 2/3 hard, and a floor of 0.01 on a prompt's chance.
    assert (knobs.exploration_rate, knobs.exploration_rate_step, knobs.min_exploration) == (0.5, 0.01, 0.01)
    assert settings.target(S) == pytest.approx(0.25 / 3) and settings.target(F) == pytest.approx(0.5 / 3)


def test_exploration_rate_outside_its_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="exploration_rate=0.01 must lie within exploration_rate_min=0.05"):
        from_snapshot({"data": {"prompt_skipping": {"exploration_rate": 0.01}}})


def test_floating_point_noise_is_no_spread_by_default() -> None:
    """Item 7: [0.1 + 0.2, 0.3, 0.3, 0.3] spreads 5.6e-17, which is rounding, not signal."""
    noisy = [0.1 + 0.2, 0.3, 0.3, 0.3]
    assert decisions.reward_spread(noisy) == pytest.approx(5.55e-17, rel=0.01)
    default = RunConfig().grpo.zero_variance_tolerance
    assert decisions.is_zero_variance(noisy, default)
    assert not decisions.is_zero_variance([0.0, 0.0, 0.0, 1e-3], default)  # a real spread
    assert not decisions.is_zero_variance(noisy, 0.0)  # exact equality, when asked for


def _request(prompt: str, attempt: int) -> GenerationRequest:
    return GenerationRequest(
        attempt_id=attempt, prompt=prompt, row={}, n=16, seed=attempt, temperature=1.0, top_p=1.0, max_new_tokens=2
    )


def test_the_sim_model_learns_a_share_of_its_prompts() -> None:
    fixed = SimEngine(seed=3, solve_rate_alpha=0.3, solve_rate_beta=0.3)
    learning = SimEngine(seed=3, solve_rate_alpha=0.3, solve_rate_beta=0.3, learning=Learning(0.5, 0.2))
    prompts = [f"p{i}" for i in range(200)]
    learns = [learning.learning.learns(3, p) for p in prompts]  # type: ignore[union-attr]
    assert 0.35 < sum(learns) / len(prompts) < 0.65
    learning.load_weights(10, None)
    fixed.load_weights(10, None)
    for prompt, learned in zip(prompts, learns, strict=True):
        before, after = fixed.solve_rate(_request(prompt, 1)), learning.solve_rate(_request(prompt, 1))
        if learned:
            assert after == pytest.approx(1 - (1 - before) * 0.8**10)
        else:
            assert after == before
    assert Learning(0.5, 0.2).moved(0.3, 0) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="generation.sim.learning.rate"):
        Learning(0.5, 1.5)


def test_the_sim_learning_option_comes_from_the_config() -> None:
    engine = SimEngine.from_config(from_snapshot({"generation": {"backend": "sim", "sim": {"learning": {"share": 0.25}}}}))
    assert engine.learning == Learning(0.25, 0.05)
    assert SimEngine.from_config(from_snapshot({"generation": {"backend": "sim"}})).learning is None


def _jsonl(tmp_path: Path, rows: list) -> RunConfig:  # type: ignore[type-arg]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return from_snapshot({"data": {"train_path": str(path), "prompt_id_field": "id"}})


def test_prompt_id_field_names_each_row(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "id": "q1"}, {"prompt": "b", "id": 2}]
    assert load_dataset(_jsonl(tmp_path, rows)) == rows


def test_prompt_id_field_refuses_missing_wrong_and_repeated_ids(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "id": 1}, {"prompt": "b"}, {"prompt": "c", "id": True}, {"prompt": "d", "id": "1"}]
    with pytest.raises(DatasetError) as caught:
        load_dataset(_jsonl(tmp_path, rows))
    message = str(caught.value)
    assert "line 2: has no 'id' field (data.prompt_id_field" in message
    assert "line 3: field 'id' (data.prompt_id_field) is a JSON boolean" in message
    assert "line 4: has the id '1' (data.prompt_id_field) of line 1; ids must be distinct" in message


def test_the_epoch_orders_a_process_keeps_are_bounded_whatever_the_epochs_it_meets() -> None:
    """A long run cycles its data set epoch after epoch; the loader keeps each epoch's order and
    uniforms (the whole data set's), so what it keeps must not grow with the epochs: it held
    32 epochs as tuples of Python objects, 25 MiB for 20,000 prompts (bench scale's memory
    growth over a million attempts). Each is the seeded sequence, read-only."""
    import gc
    import tracemalloc

    import numpy as np

    from refill.models.dataloader import EPOCH_ORDERS_KEPT, epoch_order

    prompts = 20_000
    epoch_order.cache_clear()
    epoch_uniforms.cache_clear()
    gc.collect()
    tracemalloc.start()
    try:
        for epoch in range(40):
            order, uniforms = epoch_order(prompts, 7, epoch, True), epoch_uniforms(prompts, 7, epoch)
            assert list(order[:5]) == [int(i) for i in np.random.default_rng([7, epoch]).permutation(prompts)[:5]]
            assert isinstance(order[0], int) and isinstance(uniforms[0], float)
        del order, uniforms
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Machine integers and doubles: 12 bytes a place an epoch, for the epochs kept.
    assert held <= EPOCH_ORDERS_KEPT * prompts * 12 * 1.1, held
    assert epoch_order.cache_info().currsize == epoch_uniforms.cache_info().currsize == EPOCH_ORDERS_KEPT
    assert list(epoch_order(5, 7, 0, False)) == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError):
        epoch_order(prompts, 7, 39, True)[0] = 1  # type: ignore[index]
