"""The GRPO/DAPO trainer: one training step per released step batch, made of one or more
optimizer updates (mini-batches, `refill.trainer.minibatches`).

Versions and steps: weight version `v` is the model after `v` training steps; version 0 is
the initial model (`prepare_initial_weights`). Steps are numbered from 0, and training step
`s` takes the trainer from version `s` to `s + 1`. So a fleet loop is

    trainer = GRPOTrainer(config, run_dir)
    trainer.restore(v)                       # 0 for a new run, the last checkpoint on resume
    for s in range(v, max_steps):
        metrics = trainer.train_step(s, groups_of_step_s)
        path = trainer.publish(s + 1)        # record path as weight version s + 1
        trainer.checkpoint(s + 1)

A group generated with version `w` and trained in step `s` is `s - w` versions stale; that
must lie in [0, async_rl.max_lookahead_versions]. Its tokens carry the truncated weight
pi_old / pi_sampling (`refill.trainer.loss`), pi_old being version `s` before the step's first
update, so several updates per step and stale groups are one decoupled PPO objective.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from refill.model_loading import (
    has_weights,
    load_model,
    load_tokenizer,
    load_weights_into,
    model_directory,
)
from refill.models.payload import TrainGroup
from refill.trainer import checkpoints
from refill.trainer.advantages import group_advantages, shape_rewards
from refill.trainer.loss import dapo_loss, raw_importance_weights
from refill.trainer.minibatches import MiniBatch, StepSums, split_into_mini_batches
from refill.trainer.sequence_batches import TrainSequence, score
from refill.trainer.settings import TrainerConfig, read_settings
from refill.trainer.weights import atomic_directory, save_model_dir, weights_dir


def lr_multiplier(step: int, settings: TrainerConfig) -> float:
    """The LR factor for training step `step` (0-based), which every update of the step uses:
    linear warm-up, then the schedule."""
    opt = settings.optimizer
    if opt.warmup_steps and step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.scheduler == "constant":
        return 1.0
    total = settings.grpo.max_num_steps or 0
    span = max(total - opt.warmup_steps, 1)
    progress = min(max(step - opt.warmup_steps, 0) / span, 1.0)
    if opt.scheduler == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class GRPOTrainer:
    """Owns the policy, its optimizer and schedule, and the run's weight/checkpoint files."""

    def __init__(self, config: Any, run_dir: str | os.PathLike[str], device: str | None = None):
        self.settings = read_settings(config)
        self.run_dir = Path(run_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.source = model_directory(self.settings.model.name_or_path)
        self.tokenizer = load_tokenizer(self.source)
        self.model: Any = None
        self.reference: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        #: Optimizer steps taken: the weight version the model holds. None until `restore`.
        self.version: int | None = None

    # -- state -------------------------------------------------------------------------------

    def restore(self, version: int) -> None:
        """Load weight version `version` and the trainer state saved with it.

        Version 0 is the initial model, made by `prepare_initial_weights` if the run does not
        have it yet, with a fresh optimizer and RNG seeded by `run.seed`; a later version needs
        its checkpoint (`checkpoint(version)` wrote it).
        """
        # Until this returns the model may hold a mix of versions; nothing may train on it.
        self.version = None
        path = weights_dir(self.run_dir, version)
        if version == 0 and not has_weights(path):
            from refill.trainer.warmstart import prepare_initial_weights

            prepare_initial_weights(self.settings, self.run_dir)
        if not has_weights(path):
            raise FileNotFoundError(
                f"weight version {version} is not published under {path.parent}; restore a "
                "version that `refill.trainer.weights.published_versions` lists"
            )
        state = checkpoints.load(self.run_dir, version) if version > 0 else None
        if state is not None and state.get("version") != version:
            raise ValueError(
                f"checkpoint v{version:06d} says it holds version {state.get('version')}; "
                "the checkpoint directory was renamed or mixed up"
            )

        if self.model is None:
            self.model = load_model(path, self.settings.model.dtype).to(self.device)
        else:
            load_weights_into(self.model, path)
        self.model.train()
        self._build_optimizer()
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            checkpoints.restore_rng(state["rng"])
        else:
            torch.manual_seed(self.settings.run.seed)
        if self.settings.loss.reference_policy_kl_penalty > 0 and self.reference is None:
            # The reference is the initial policy, frozen, whatever version we resume from.
            self.reference = load_model(weights_dir(self.run_dir, 0), self.settings.model.dtype)
            self.reference.to(self.device).eval().requires_grad_(False)
        self.version = version

    def _build_optimizer(self) -> None:
        opt = self.settings.optimizer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_multiplier(step, self.settings)
        )

    def _require_version(self, what: str) -> int:
        if self.version is None:
            raise RuntimeError(f"call restore(version) before {what}")
        return self.version

    def publish(self, version: int) -> str:
        """Write the current weights as `weights/v{version:06d}/` (atomically); its path."""
        current = self._require_version("publish")
        if version != current:
            raise ValueError(
                f"the trainer holds weight version {current}, not {version}; publish(v) "
                "must name the version the trainer is at"
            )
        final = weights_dir(self.run_dir, version)
        with atomic_directory(final) as tmp:
            save_model_dir(self.model, self.tokenizer, tmp)
        return str(final)

    def checkpoint(self, version: int) -> str:
        """Save optimizer, scheduler and RNG at `version` (publishing its weights if needed);
        only the newest `optimizer.keep_checkpoints` checkpoints are kept."""
        current = self._require_version("checkpoint")
        if version != current:
            raise ValueError(f"the trainer holds version {current}, cannot checkpoint {version}")
        if not has_weights(weights_dir(self.run_dir, version)):
            self.publish(version)
        state = {
            "version": version,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoints.capture_rng(),
        }
        path = checkpoints.save(
            self.run_dir, version, state, self.settings.optimizer.keep_checkpoints
        )
        return str(path)

    # -- training ----------------------------------------------------------------------------

    def _sequences(self, step: int, groups: list[TrainGroup]) -> list[TrainSequence]:
        s = self.settings
        lookahead = s.async_rl.max_lookahead_versions
        shaping = s.grpo.reward_shaping
        need_sampling = s.loss.use_importance_sampling_correction
        sequences: list[TrainSequence] = []
        for group in groups:
            staleness = step - group.weight_version
            if not 0 <= staleness <= lookahead:
                raise ValueError(
                    f"attempt {group.attempt_id} was generated with weight version "
                    f"{group.weight_version} and cannot train in step {step}: staleness "
                    f"{staleness} is outside [0, async_rl.max_lookahead_versions={lookahead}]"
                )
            if len(group.rewards) != len(group.completions) or not group.completions:
                raise ValueError(
                    f"attempt {group.attempt_id} has {len(group.completions)} completions and "
                    f"{len(group.rewards)} rewards; a group needs one reward per completion"
                )
            if not group.prompt_token_ids:
                raise ValueError(
                    f"attempt {group.attempt_id} has no prompt tokens; the first completion "
                    "token needs at least one token to be predicted from"
                )
            rewards = list(group.rewards)
            if shaping.enabled:
                rewards = shape_rewards(
                    rewards,
                    [len(c.token_ids) for c in group.completions],
                    max_response_length=shaping.max_response_length or s.generation.max_new_tokens,
                    buffer_length=shaping.overlong_buffer_length,
                    penalty=shaping.overlong_buffer_penalty,
                )
            advantages = group_advantages(
                rewards,
                normalize=s.grpo.normalize_rewards,
                leave_one_out=s.grpo.use_leave_one_out_baseline,
            )
            for completion, advantage in zip(group.completions, advantages, strict=True):
                if not completion.token_ids:
                    continue
                if need_sampling and len(completion.logprobs) != len(completion.token_ids):
                    raise ValueError(
                        f"attempt {group.attempt_id}: a completion has "
                        f"{len(completion.token_ids)} tokens but {len(completion.logprobs)} "
                        "sampling log-probs; importance correction needs one per token"
                    )
                sequences.append(
                    TrainSequence(
                        prompt_ids=list(group.prompt_token_ids),
                        completion_ids=list(completion.token_ids),
                        advantage=advantage,
                        sampling_logprobs=list(completion.logprobs) if need_sampling else [],
                        attempt_id=group.attempt_id,
                    )
                )
        return sequences

    def train_step(self, step: int, groups: list[TrainGroup]) -> dict[str, float]:
        """Train step `step` on `groups`: one optimizer update per mini-batch and pass (one in
        all unless `optimizer.groups_per_update` / `passes_per_step` say otherwise), every
        update clipped against the log-probs of the weights the step started from. The
        trainer moves to version `step + 1`; the LR schedule advances once."""
        current = self._require_version("train_step")
        if step != current:
            raise ValueError(
                f"the trainer holds weight version {current}, so the next step it can train is "
                f"{current}, not {step}; restore({step}) first to train step {step}"
            )
        if not groups:
            raise ValueError(f"step {step} has no groups to train on")
        started = time.perf_counter()
        s = self.settings
        sequences = self._sequences(step, groups)
        step_tokens = sum(len(seq.completion_ids) for seq in sequences)
        if step_tokens == 0:
            raise ValueError(f"step {step}: every completion is empty, nothing to train on")
        mini_batches = split_into_mini_batches(
            sequences,
            [g.attempt_id for g in groups],
            s.optimizer.groups_per_update,
            s.optimizer.micro_batch_tokens,
            self.tokenizer.pad_token_id,
        )
        sums = StepSums(step_tokens=float(step_tokens))
        self._score_proximal(mini_batches, sums)

        lr = self.scheduler.get_last_lr()[0]
        total = len(mini_batches) * s.optimizer.passes_per_step
        for _ in range(s.optimizer.passes_per_step):
            for mini_batch in mini_batches:
                self._update(step, mini_batch, sums, done=len(sums.losses), total=total)
        self.scheduler.step()
        self.version = step + 1

        staleness = [step - g.weight_version for g in groups]
        metrics = sums.metrics()
        metrics.update(
            sequences=float(len(sequences)),
            groups=float(len(groups)),
            mini_batches=float(len(mini_batches)),
            micro_batches=float(sum(len(m.micro) for m in mini_batches)),
            lr=lr,
            staleness_mean=sum(staleness) / len(staleness),
            staleness_max=float(max(staleness)),
            train_seconds=time.perf_counter() - started,
        )
        if self.reference is not None:
            metrics["kl"] = sums.kl / sums.visited
        return metrics

    def _score_proximal(self, mini_batches: list[MiniBatch], sums: StepSums) -> None:
        """Score every micro-batch once with the weights the step starts from (the proximal
        policy) and the reference, before any update; add the step's once-per-token sums."""
        s = self.settings
        temperature = s.generation.temperature
        correct = s.loss.use_importance_sampling_correction
        # The engines record log-probs after top-p as well; the weight's numerator must be
        # scored the same way, or every weight is biased by the nucleus mass.
        top_p = s.generation.top_p if correct else 1.0
        with torch.no_grad():
            for mini_batch in mini_batches:
                for batch in mini_batch.micro:
                    scored = score(self.model, batch, temperature, self.device, True, top_p)
                    mask = batch.completion_mask.to(self.device)
                    mini_batch.old.append(scored.logprobs)
                    mini_batch.old_processed.append(scored.processed)
                    ref = None
                    if self.reference is not None:
                        ref = score(self.reference, batch, temperature, self.device, False).logprobs
                    mini_batch.ref.append(ref)
                    sums.entropy += float((scored.entropy * mask).sum())
                    adv = batch.advantages.to(self.device).abs().unsqueeze(1)
                    sums.advantage_abs += float((adv * mask).sum())
                    if not correct:
                        sums.importance_weight += float(mask.sum())
                        continue
                    numerator = scored.logprobs if scored.processed is None else scored.processed
                    raw = raw_importance_weights(
                        numerator, batch.sampling_logprobs.to(self.device)
                    )
                    cap = s.loss.truncated_importance_sampling_ratio
                    kept = raw if cap is None else raw.clamp(max=cap)
                    sums.importance_weight += float((kept * mask).sum())
                    if cap is not None:
                        sums.truncated += float(((raw > cap).to(mask.dtype) * mask).sum())

    def _update(
        self, step: int, mini_batch: MiniBatch, sums: StepSums, *, done: int, total: int
    ) -> None:
        """One optimizer update on `mini_batch`, its gradient accumulated over micro-batches
        and normalised by the mini-batch's own token (or sequence) count."""
        s = self.settings
        correct = s.loss.use_importance_sampling_correction
        loss_total = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(mini_batch.micro):
            scored = score(self.model, batch, s.generation.temperature, self.device, False)
            terms = dapo_loss(
                scored.logprobs,
                mini_batch.old[i],
                batch.advantages.to(self.device),
                batch.completion_mask.to(self.device),
                eps_low=s.loss.ratio_clip_min,
                eps_high=s.loss.ratio_clip_max,
                token_level=s.loss.token_level_loss,
                step_tokens=float(mini_batch.tokens),
                step_sequences=float(len(mini_batch.sequences)),
                logp_sampling=batch.sampling_logprobs.to(self.device) if correct else None,
                truncation=s.loss.truncated_importance_sampling_ratio,
                logp_ref=mini_batch.ref[i],
                kl_coef=s.loss.reference_policy_kl_penalty,
                logp_old_processed=mini_batch.old_processed[i],
            )
            terms.loss.backward()
            loss_total += float(terms.loss.detach())
            sums.add_update_terms(terms)

        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = s.optimizer.max_grad_norm
        if max_norm:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            if done == 0:
                raise FloatingPointError(
                    f"step {step}: the gradient norm is {grad_norm}; the weights were not "
                    "updated (lower optimizer.lr, or check the rewards and log-probs of this "
                    "batch)"
                )
            # The step's earlier updates are in the weights: they are no version at all.
            self.version = None
            raise FloatingPointError(
                f"step {step}: the gradient norm of update {done + 1} of {total} is "
                f"{grad_norm}; the {done} update(s) before it were applied, so restore({step}) "
                "before training the step again (lower optimizer.lr, or check the rewards and "
                "log-probs of this batch)"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums.losses.append(loss_total)
        sums.grad_norms.append(grad_norm)
