"""GRPOTrainer: split-invariant steps, exact resume, versions, checkpoints, errors."""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from refill.trainer.grpo import GRPOTrainer, lr_multiplier
from refill.trainer.settings import read_settings
from refill.trainer.weights import checkpoint_versions, published_versions, weights_dir

from .conftest import make_groups


def _params(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def _assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol=1e-6):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"parameters differ by up to {worst}"


@pytest.mark.parametrize("token_level", [True, False])
def test_step_does_not_depend_on_micro_batch_split(settings, tmp_path, token_level):
    settings.loss.token_level_loss = token_level
    settings.loss.use_importance_sampling_correction = True
    # Adam's first step is about lr * sign(g): a weight whose gradient is float noise (its
    # micro-batch contributions cancel) moves by up to lr one way or the other depending on
    # the summation order, which the split changes (seen: 5e-6 apart on one CPU, 0 on
    # another). With eps above the gradients' scale the step is lr * g / eps, linear in the
    # gradient, so the parameters show any difference in the gradient itself, a wrong scale
    # included, and float noise stays at noise level (a few float32 ulps of the weights);
    # the large lr makes the step large against those ulps.
    settings.optimizer.eps = 1.0
    settings.optimizer.lr = 0.1
    groups = make_groups(step=0, seed=1)
    whole = GRPOTrainer(settings, tmp_path / "run")
    whole.restore(0)
    split_settings = copy.deepcopy(settings)
    split_settings.optimizer.micro_batch_tokens = 16  # a few sequences per micro-batch
    split = GRPOTrainer(split_settings, tmp_path / "run")
    split.restore(0)

    before = _params(whole)
    m_whole = whole.train_step(0, groups)
    m_split = split.train_step(0, groups)
    moved = max((p - before[k]).abs().max().item() for k, p in _params(whole).items())
    # Large enough that a gradient off by a tenth of a percent would move a weight by more
    # than the tolerance below.
    assert moved > 1e-3

    assert m_whole["micro_batches"] == 1
    assert m_split["micro_batches"] >= 4
    assert m_split["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-5)
    assert m_split["tokens"] == m_whole["tokens"]
    _assert_same_params(_params(whole), _params(split))


def test_step_moves_the_weights_and_reports_metrics(settings, tmp_path):
    # The schema's default turns the correction on; off, every importance weight is 1.
    settings.loss.use_importance_sampling_correction = False
    groups = make_groups(step=0, seed=2)
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    before = _params(trainer)
    metrics = trainer.train_step(0, groups)
    after = _params(trainer)
    assert trainer.version == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)
    expected_tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    assert metrics["tokens"] == expected_tokens
    # One optimizer step per batch: the old policy is the current one, so nothing is clipped.
    assert metrics["clip_fraction"] == 0.0
    assert metrics["importance_weight_mean"] == 1.0  # correction off in this config
    assert metrics["entropy"] > 0
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    # Warm-up of 2 optimizer steps: the first step runs at half the rate.
    assert metrics["lr"] == pytest.approx(settings.optimizer.lr / 2)
    assert "kl" not in metrics


def test_importance_weights_are_truncated(settings, tmp_path):
    settings.loss.use_importance_sampling_correction = True
    settings.loss.truncated_importance_sampling_ratio = 2.0
    groups = make_groups(step=0, seed=3)
    for g in groups:
        for c in g.completions:
            # The engine claims it sampled these at probability e^-50: pi_old / pi_sampling
            # is astronomically large, so every weight hits the cap.
            c.logprobs = [-50.0] * len(c.token_ids)
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    assert trainer.train_step(0, groups)["importance_weight_mean"] == pytest.approx(2.0)

    for g in groups:
        for c in g.completions:
            c.logprobs = [0.0] * len(c.token_ids)  # probability 1: weight = pi_old < 1
    groups = [dataclasses.replace(g, weight_version=1) for g in groups]
    assert trainer.train_step(1, groups)["importance_weight_mean"] < 0.5


def test_kl_to_the_initial_policy(settings, tmp_path):
    settings.loss.reference_policy_kl_penalty = 0.1
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    first = trainer.train_step(0, make_groups(0, seed=4))
    second = trainer.train_step(1, make_groups(1, seed=5))
    # At version 0 the policy is the reference: k3 is exactly 0. After a step it is not.
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl"] > 0


def test_resume_continues_exactly(settings, tmp_path):
    batches = [make_groups(step, seed=10 + step) for step in range(3)]

    straight = GRPOTrainer(settings, tmp_path / "straight")
    straight.restore(0)
    for step, groups in enumerate(batches):
        straight.train_step(step, groups)

    interrupted = GRPOTrainer(settings, tmp_path / "resumed")
    interrupted.restore(0)
    for step in range(2):
        interrupted.train_step(step, batches[step])
    interrupted.publish(2)
    interrupted.checkpoint(2)
    del interrupted

    resumed = GRPOTrainer(settings, tmp_path / "resumed")
    resumed.restore(2)
    assert resumed.version == 2
    resumed.train_step(2, batches[2])

    _assert_same_params(_params(straight), _params(resumed), atol=1e-6)
    a, b = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert a["param_groups"][0]["lr"] == b["param_groups"][0]["lr"]
    for index, state in a["state"].items():
        assert int(state["step"]) == int(b["state"][index]["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(state[key], b["state"][index][key], atol=1e-6)
    assert (
        straight.scheduler.state_dict()["last_epoch"]
        == resumed.scheduler.state_dict()["last_epoch"]
    )


def test_restore_brings_back_the_rng_state(settings, tmp_path):
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    trainer.train_step(0, make_groups(0, seed=6))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trainer.checkpoint(1)
    torch.manual_seed(999)
    trainer.restore(1)
    assert torch.equal(torch.rand(3), expected)


def test_versions_must_follow_steps(settings, tmp_path):
    trainer = GRPOTrainer(settings, tmp_path / "run")
    with pytest.raises(RuntimeError, match="restore"):
        trainer.train_step(0, make_groups(0, seed=7))
    trainer.restore(0)
    with pytest.raises(ValueError, match="restore\\(3\\) first"):
        trainer.train_step(3, make_groups(3, seed=7))
    with pytest.raises(ValueError, match="holds weight version 0"):
        trainer.publish(1)
    with pytest.raises(FileNotFoundError, match="weight version 4 is not published"):
        trainer.restore(4)
    # Weights on disk but no checkpoint: restore says which checkpoints exist.
    shutil.copytree(weights_dir(trainer.run_dir, 0), weights_dir(trainer.run_dir, 4))
    with pytest.raises(FileNotFoundError, match=r"no trainer checkpoint for version 4 .*none"):
        trainer.restore(4)


def test_too_stale_or_future_groups_are_refused(settings, tmp_path):
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    trainer.train_step(0, make_groups(0, seed=8))
    trainer.train_step(1, make_groups(0, seed=9))  # staleness 1 == max_lookahead_versions
    stale = make_groups(0, seed=10)  # staleness 2
    with pytest.raises(ValueError, match=r"attempt 0 .*staleness 2"):
        trainer.train_step(2, stale)
    future = make_groups(5, seed=11)
    with pytest.raises(ValueError, match="staleness -3"):
        trainer.train_step(2, future)
    assert trainer.version == 2  # refused steps change nothing


def test_bad_group_shapes_are_named(settings, tmp_path):
    settings.loss.use_importance_sampling_correction = True
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    groups = make_groups(0, seed=12)
    groups[1].completions[0].logprobs = []
    with pytest.raises(ValueError, match=f"attempt {groups[1].attempt_id}.*sampling log-probs"):
        trainer.train_step(0, groups)
    groups = make_groups(0, seed=12)
    groups[0].rewards = groups[0].rewards[:-1]
    with pytest.raises(ValueError, match="one reward per completion"):
        trainer.train_step(0, groups)


def test_checkpoints_keep_the_newest(settings, tmp_path):
    settings.optimizer.keep_checkpoints = 2
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    for step in range(4):
        trainer.train_step(step, make_groups(step, seed=20 + step))
        trainer.checkpoint(step + 1)  # publishes the weights it needs
    assert checkpoint_versions(tmp_path / "run") == [3, 4]
    assert published_versions(tmp_path / "run") == [0, 1, 2, 3, 4]


def test_lr_schedule_counts_optimizer_steps():
    s = read_settings(
        SimpleNamespace(
            optimizer=SimpleNamespace(warmup_steps=4, scheduler="cosine"),
            grpo=SimpleNamespace(max_num_steps=14),
        )
    )
    assert [lr_multiplier(k, s) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, s) == pytest.approx(1.0)
    assert lr_multiplier(9, s) == pytest.approx(0.5)
    assert lr_multiplier(14, s) == pytest.approx(0.0)
    s.optimizer.scheduler = "linear"
    assert lr_multiplier(9, s) == pytest.approx(0.5)
    assert lr_multiplier(11, s) == pytest.approx(0.3)


def test_settings_come_from_the_run_config():
    from refill.config import RunConfig

    config = RunConfig.model_validate(
        {
            "loss": {"ratio_clip_max": 0.3, "truncated_importance_sampling_ratio": None},
            "optimizer": {"lr": 2e-4, "betas": [0.9, 0.95], "keep_checkpoints": 5},
            "model": {"warm_start": {"enabled": True, "steps": 7}},
        }
    )
    s = read_settings(config)
    assert s.loss.ratio_clip_max == 0.3
    assert s.loss.truncated_importance_sampling_ratio is None
    assert s.optimizer.betas == (0.9, 0.95)
    assert s.optimizer.keep_checkpoints == 5
    assert s.model.warm_start.enabled is True and s.model.warm_start.steps == 7
    assert s.generation.max_new_tokens == config.generation.max_new_tokens


def test_invalid_settings_name_the_key():
    with pytest.raises(ValueError, match=r"optimizer.scheduler='cosine' decays .*max_num_steps"):
        read_settings(
            SimpleNamespace(
                optimizer=SimpleNamespace(scheduler="cosine"),
                grpo=SimpleNamespace(max_num_steps=None),
            )
        )
    with pytest.raises(ValueError, match="overlong_buffer_length=0"):
        read_settings(
            SimpleNamespace(grpo=SimpleNamespace(reward_shaping=SimpleNamespace(enabled=True)))
        )
