"""GRPOTrainer: split-invariant steps, exact resume, versions, checkpoints, errors."""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from refill.models import rollout_codec
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


def test_mini_batch_updates_do_not_depend_on_micro_batch_split(settings, tmp_path):
    # Gradient accumulation inside a mini-batch stays exact: each update's loss is normalised
    # by its mini-batch's tokens, not by a micro-batch's, so splitting the micro-batches
    # changes nothing but summation order (settings as in the test above).
    settings.optimizer.groups_per_update = 2  # 3 groups: updates of 2 and 1 groups
    settings.optimizer.passes_per_step = 2
    settings.optimizer.eps = 1.0
    settings.optimizer.lr = 0.1
    groups = make_groups(step=0, seed=1)
    whole = GRPOTrainer(settings, tmp_path / "run")
    whole.restore(0)
    split_settings = copy.deepcopy(settings)
    split_settings.optimizer.micro_batch_tokens = 16
    split = GRPOTrainer(split_settings, tmp_path / "run")
    split.restore(0)
    m_whole = whole.train_step(0, groups)
    m_split = split.train_step(0, groups)
    assert m_whole["updates"] == m_split["updates"] == 4
    assert m_whole["mini_batches"] == m_whole["micro_batches"] == 2
    assert m_split["micro_batches"] > 2
    assert m_split["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
    assert m_split["clip_fraction"] == m_whole["clip_fraction"]
    # The later updates see moved weights: the ratio leaves 1.
    assert m_whole["ratio_mean"] != 1.0
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


def test_groups_as_the_claim_reads_them_train_as_lists_do(settings, tmp_path):
    """The claim hands the trainer numpy arrays (a payload decoded with `arrays=True`): the
    step is the one the same groups as lists make, an empty completion skipped alike."""
    settings.loss.use_importance_sampling_correction = True
    groups = make_groups(step=0, seed=5)
    groups[2].completions[1] = dataclasses.replace(groups[2].completions[1], token_ids=[], logprobs=[])
    as_arrays = []
    for group in groups:
        packed = rollout_codec.Rollout.build(group.prompt_token_ids, group.completions).pack()
        prompt, completions = rollout_codec.decode(packed, rollout_codec.texts(group.completions), arrays=True)
        assert isinstance(prompt, np.ndarray) and all(isinstance(c.token_ids, np.ndarray) for c in completions)
        as_arrays.append(dataclasses.replace(group, prompt_token_ids=prompt, completions=completions))
    metrics = []
    params = []
    for these in (groups, as_arrays):
        trainer = GRPOTrainer(settings, tmp_path / f"run-{len(metrics)}")
        trainer.restore(0)
        metrics.append(trainer.train_step(0, these))
        params.append(_params(trainer))
    assert metrics[0]["tokens"] == metrics[1]["tokens"] > 0
    assert metrics[0]["loss"] == metrics[1]["loss"]
    _assert_same_params(params[0], params[1], atol=0.0)


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


# ------------------------------------------------------------------ mini-batches, by hand


class _Logits(torch.nn.Module):
    """A policy whose next-token logits are one learnable vector, whatever the input: its
    log-probs, and so every ratio and gradient below, can be worked out by hand."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(logits))

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.bias.expand(*input_ids.shape, -1))


def _hand_trainer(settings, run_dir, logits: list[float], lr: float) -> GRPOTrainer:
    trainer = GRPOTrainer(settings, run_dir)
    trainer.restore(0)
    trainer.model = _Logits(logits)
    # Plain SGD: after an update the weights are exactly b - lr * gradient.
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=lr)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    return trainer


def _group(attempt: int, tokens: list[int], rewards: list[float], logprobs: list[float]):
    from refill.models.payload import Completion, TrainGroup

    completions = [
        Completion(token_ids=[t], logprobs=[lp], text="")
        for t, lp in zip(tokens, logprobs, strict=True)
    ]
    return TrainGroup(attempt, [1], completions, rewards, 0)


def test_the_second_update_of_a_step_clips_on_the_high_side(settings, tmp_path):
    # Vocabulary of 4, logits b = 0: pi_old is uniform, 1/4 per token, and the engine sampled
    # with these weights (log 1/4 recorded), so every importance weight is 1.
    settings.optimizer.groups_per_update = 1  # two groups: two updates in the step
    settings.optimizer.max_grad_norm = 100.0
    settings.grpo.normalize_rewards = False  # advantages +-0.5
    trainer = _hand_trainer(settings, tmp_path / "run", [0.0] * 4, lr=2.0)
    uniform = math.log(0.25)
    first = _group(1, [2, 3], [1.0, 0.0], [uniform, uniform])
    second = _group(2, [2, 1], [1.0, 0.0], [uniform, uniform])
    metrics = trainer.train_step(0, [first, second])

    # Update 1 (group 1, ratio 1): loss = -(0.5 r2 - 0.5 r3) / 2 tokens, and
    # d r_y / d b_j = delta_yj - 1/4, so the gradient is (0, 0, -1/4, +1/4) and SGD at lr 2
    # leaves b = (0, 0, 0.5, -0.5).
    # Update 2 (group 2) against the same old log-probs: Z = 2 + e^0.5 + e^-0.5 = 4.255252,
    # pi(2) = e^0.5 / Z = 0.387456 -> ratio 1.549822 > 1 + 0.28 with A = +0.5: clipped high,
    # no gradient; pi(1) = 1 / Z = 0.235004 -> ratio 0.940015 > 1 - 0.2: not clipped.
    z = 2 + math.exp(0.5) + math.exp(-0.5)
    assert z == pytest.approx(4.255252, abs=1e-6)
    r2, r1 = math.exp(0.5) / z / 0.25, 1 / z / 0.25
    assert (r2, r1) == pytest.approx((1.549822, 0.940015), abs=1e-6)
    assert metrics["updates"] == 2 and metrics["mini_batches"] == 2
    # 4 token visits (2 per update); one of them, in update 2, clipped high.
    assert metrics["clip_fraction_upper"] == pytest.approx(0.25)
    assert metrics["clip_fraction_lower"] == 0.0
    assert metrics["clip_fraction"] == pytest.approx(0.25)
    assert metrics["ratio_mean"] == pytest.approx((1 + 1 + r2 + r1) / 4, abs=1e-6)
    # Losses: update 1 is 0; update 2 is -(0.5 * 1.28 - 0.5 * r1) / 2 = -0.084996.
    assert metrics["loss"] == pytest.approx((0.0 - (0.5 * 1.28 - 0.5 * r1) / 2) / 2, abs=1e-6)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0)
    assert metrics["importance_weight_truncated_fraction"] == 0.0
    assert metrics["tokens"] == 4
    # Update 2's gradient is token 1's alone (the clipped token gives none):
    # L = -(-0.5 r1) / 2 = 0.25 r1, dL/db_j = 0.25 r1 (delta_1j - pi_j).
    pi = [1 / z, 1 / z, math.exp(0.5) / z, math.exp(-0.5) / z]
    grad = [0.25 * r1 * ((j == 1) - pi[j]) for j in range(4)]
    expected = [b - 2.0 * g for b, g in zip([0.0, 0.0, 0.5, -0.5], grad, strict=True)]
    assert trainer.model.bias.tolist() == pytest.approx(expected, abs=1e-6)
    assert trainer.version == 1


def test_one_mini_batch_of_every_group_is_the_single_update(settings, tmp_path):
    settings.optimizer.groups_per_update = 1
    settings.optimizer.passes_per_step = 2
    settings.grpo.normalize_rewards = False
    settings.optimizer.max_grad_norm = 100.0
    trainer = _hand_trainer(settings, tmp_path / "run", [0.0] * 4, lr=2.0)
    uniform = math.log(0.25)
    metrics = trainer.train_step(0, [_group(1, [2, 3], [1.0, 0.0], [uniform, uniform])])
    # One group, two passes: the second pass is update 2 on the same group, with
    # b = (0, 0, 0.5, -0.5): ratio(2) = 1.549822 (A > 0, clipped high) and
    # ratio(3) = e^-0.5 / Z / 0.25 = 0.570148 (A < 0, below 0.8: clipped low).
    assert metrics["updates"] == 2 and metrics["mini_batches"] == 1
    assert metrics["clip_fraction_upper"] == pytest.approx(0.25)
    assert metrics["clip_fraction_lower"] == pytest.approx(0.25)


def test_fresh_data_under_top_p_has_importance_weight_one(settings, tmp_path):
    # Logits (0, 3, 2, 1) at temperature 1: p = (0.032059, 0.643914, 0.236883, 0.087144).
    # top_p 0.9 keeps tokens 1, 2, 3 (token 0 follows a mass of 0.967941 >= 0.9), so the
    # engine records log(p_y / 0.967941) for what it samples with these very weights.
    settings.generation.top_p = 0.9
    settings.generation.temperature = 1.0
    settings.loss.use_importance_sampling_correction = True
    logits = [0.0, 3.0, 2.0, 1.0]
    z = sum(math.exp(v) for v in logits)
    p = [math.exp(v) / z for v in logits]
    assert p == pytest.approx([0.032059, 0.643914, 0.236883, 0.087144], abs=1e-6)
    nucleus = 1 - p[0]
    recorded = [math.log(p[2] / nucleus), math.log(p[1] / nucleus)]
    groups = [_group(1, [2, 1], [1.0, 0.0], recorded)]

    trainer = _hand_trainer(settings, tmp_path / "run", logits, lr=0.1)
    metrics = trainer.train_step(0, groups)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["importance_weight_truncated_fraction"] == 0.0

    # Scored at temperature alone (as before), every weight was short by the nucleus mass.
    settings.generation.top_p = 1.0
    biased = _hand_trainer(settings, tmp_path / "biased", logits, lr=0.1)
    metrics = biased.train_step(0, groups)
    assert metrics["importance_weight_mean"] == pytest.approx(nucleus, abs=1e-6)


def test_hf_samples_under_top_p_weigh_one_in_the_trainer(settings, tmp_path):
    # End to end with the tiny model: the hf back-end samples with the trainer's own weights
    # (version 0) at top_p 0.7 and temperature 0.8; the trainer's weights are then all 1 up
    # to float noise, where scoring at temperature alone made them the nucleus mass.
    import copy as copy_module

    from refill.models.payload import GenerationRequest, TrainGroup
    from refill.tasks.backends.hf import HFEngine

    settings.generation.top_p = 0.7
    settings.generation.temperature = 0.8
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    engine = HFEngine(copy_module.deepcopy(trainer.model), trainer.tokenizer)
    groups = []
    for i, prompt in enumerate(["1+2=", "7-3=", "4+4="]):
        out = engine.generate(
            [GenerationRequest(i, prompt, {}, 6, 0.8, 0.7, 5, seed=11 + i)]
        )[0]
        rewards = [float(k % 2) for k in range(6)]
        groups.append(TrainGroup(i, out.prompt_token_ids, out.completions, rewards, 0))
    assert all(math.isfinite(lp) for g in groups for c in g.completions for lp in c.logprobs)
    metrics = trainer.train_step(0, groups)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["importance_weight_truncated_fraction"] == 0.0


def test_the_trainer_reads_the_correction_default_from_the_schema():
    from refill.config import RunConfig

    s = read_settings(SimpleNamespace())
    assert s.loss.use_importance_sampling_correction is RunConfig().loss.use_importance_sampling_correction
    assert s.loss.use_importance_sampling_correction is True
    assert s.optimizer.groups_per_update is None and s.optimizer.passes_per_step == 1


def test_invalid_mini_batch_settings_name_the_key():
    with pytest.raises(ValueError, match="optimizer.passes_per_step=0"):
        read_settings(SimpleNamespace(optimizer=SimpleNamespace(passes_per_step=0)))
    with pytest.raises(ValueError, match="optimizer.groups_per_update=0"):
        read_settings(SimpleNamespace(optimizer=SimpleNamespace(groups_per_update=0)))


def test_a_mini_batch_larger_than_the_step_is_refused_by_the_config():
    from refill.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"optimizer.groups_per_update: \(9\) is more than "
                       r"grpo.num_prompts_per_step \(8\).*such as 4"):
        config_from_dict(
            {
                "data": {"builtin": "arith"},
                "grpo": {"num_prompts_per_step": 8},
                "optimizer": {"groups_per_update": 9},
            },
            name="t",
        )
    config = config_from_dict(
        {"data": {"builtin": "arith"}, "optimizer": {"groups_per_update": 2}}, name="t"
    )
    assert read_settings(config).optimizer.groups_per_update == 2


def test_groups_within_the_zero_variance_tolerance_do_not_move_the_weights(settings, tmp_path):
    """With dynamic sampling off the ledger trains groups it judges zero-variance (spread at most
    `grpo.zero_variance_tolerance`); the trainer gave a spread of 1e-7 advantages of +-0.09."""
    settings.loss.use_importance_sampling_correction = False
    settings.optimizer.weight_decay = 0.0  # else AdamW moves the weights with no gradient at all
    groups = [
        dataclasses.replace(g, rewards=[0.5 + (1e-7 if i == 0 else 0.0) for i in range(len(g.rewards))])
        for g in make_groups(step=0, seed=2)
    ]
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    before = _params(trainer)
    metrics = trainer.train_step(0, groups)
    assert metrics["grad_norm"] == 0.0
    _assert_same_params(before, _params(trainer), atol=0.0)
