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

import contextlib
import math
import os
import time
from collections.abc import Callable
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
from refill.models.payload import TrainGroup, as_list
from refill.trainer import checkpoints, sharding
from refill.trainer.advantages import group_advantages, shape_rewards
from refill.trainer.distributed import World, agreed, peak_memory_bytes, reset_peak_memory
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
    """Owns the policy, its optimizer and schedule, and the run's weight/checkpoint files.

    With a `world` (`refill.trainer.distributed`), this is one rank of a trainer of several:
    every rank makes the same calls in the same order, the policy is sharded with FSDP2
    (`refill.trainer.sharding`), each rank trains on its share of every update, and rank 0
    alone writes what one writer must (the published weights, the checkpoint's own files).
    """

    def __init__(
        self,
        config: Any,
        run_dir: str | os.PathLike[str],
        device: str | None = None,
        world: World | None = None,
    ):
        self.settings = read_settings(config)
        self.run_dir = Path(run_dir)
        self.world = world
        if world is not None:
            self.device = world.device
        else:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.source = model_directory(self.settings.model.name_or_path)
        self.tokenizer = load_tokenizer(self.source)
        self.model: Any = None
        self.reference: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        #: Optimizer steps taken: the weight version the model holds. None until `restore`.
        self.version: int | None = None

    @property
    def rank(self) -> int:
        return self.world.rank if self.world is not None else 0

    @property
    def ranks(self) -> int:
        return self.world.size if self.world is not None else 1

    def _lockstep(self, what: str) -> Any:
        return self.world.lockstep(what) if self.world is not None else contextlib.nullcontext()

    def _check(self, problem: Callable[[], BaseException | None]) -> None:
        """Raise what `problem()` finds, on every rank alike: rank 0 looks (at the files every
        rank shares) and tells the others, so that no rank goes on into a collective alone."""
        found = problem() if self.world is None or self.world.leader else None
        if self.world is not None:
            found = self.world.broadcast(found)
        if found is not None:
            raise agreed(found)

    def _on_leader(self, action: Callable[[], Any], what: str) -> None:
        """Run `action` on rank 0 alone (every rank if there is no world); its failure is
        every rank's."""
        if self.world is None:
            action()
            return
        error: BaseException | None = None
        if self.world.leader:
            try:
                action()
            except Exception as caught:  # noqa: BLE001 - World.agree raises it on every rank
                error = caught
        self.world.agree(error, what)

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
        if version == 0:
            from refill.trainer.warmstart import prepare_initial_weights

            def prepare() -> None:
                if not has_weights(path):
                    prepare_initial_weights(self.settings, self.run_dir)

            self._on_leader(prepare, "preparing weight version 0")

        def not_there() -> BaseException | None:
            if not has_weights(path):
                return FileNotFoundError(
                    f"weight version {version} is not published under {path.parent}; restore a "
                    "version that `refill.trainer.weights.published_versions` lists"
                )
            if version > 0 and not checkpoints.exists(self.run_dir, version):
                return checkpoints.missing(self.run_dir, version)
            return None

        self._check(not_there)
        if self.world is not None:
            if self.model is None or version == 0:
                # A sharded model is (re)built from rank 0's copy; a later version's weights
                # come from its checkpoint below.
                self.model = None
                self.model = sharding.build(path, self.settings, self.world)
        elif self.model is None:
            self.model = load_model(path, self.settings.model.dtype).to(self.device)
        else:
            load_weights_into(self.model, path)
        self.model.train()
        self._build_optimizer()
        if version > 0:
            with self._lockstep(f"loading checkpoint v{version}"):
                state = checkpoints.load(
                    self.run_dir,
                    version,
                    model=self.model,
                    optimizer=self.optimizer,
                    scheduler=self.scheduler,
                    world=self.world,
                )
            checkpoints.restore_rng(state["rng"])
        else:
            torch.manual_seed(self.settings.run.seed)
        if self.settings.loss.reference_policy_kl_penalty > 0 and self.reference is None:
            # The reference is the initial policy, frozen, whatever version we resume from.
            initial = weights_dir(self.run_dir, 0)
            if self.world is not None:
                self.reference = sharding.build(initial, self.settings, self.world, trainable=False)
            else:
                self.reference = load_model(initial, self.settings.model.dtype)
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
        # The version checks here and below see the same version on every rank (rank 0's,
        # sent with each order), so every rank refuses alike.
        if self.version is None:
            raise agreed(RuntimeError(f"call restore(version) before {what}"))
        return self.version

    def publish(self, version: int) -> str:
        """Write the current weights as `weights/v{version:06d}/` (atomically, in `model.dtype`;
        by rank 0 alone under a world); its path."""
        current = self._require_version("publish")
        if version != current:
            raise agreed(
                ValueError(
                    f"the trainer holds weight version {current}, not {version}; publish(v) "
                    "must name the version the trainer is at"
                )
            )
        final = weights_dir(self.run_dir, version)
        state = None
        if self.world is not None:
            state = sharding.gather_full(self.model, self.world, self.settings.model.dtype)

        def write() -> None:
            with atomic_directory(final) as tmp:
                save_model_dir(self.model, self.tokenizer, tmp, state_dict=state)

        self._on_leader(write, f"publishing weight version {version}")
        return str(final)

    def checkpoint(self, version: int) -> str:
        """Save model, optimizer, scheduler and RNG at `version` (publishing its weights if
        needed); only the newest `optimizer.keep_checkpoints` checkpoints are kept."""
        current = self._require_version("checkpoint")
        if version != current:
            raise agreed(
                ValueError(f"the trainer holds version {current}, cannot checkpoint {version}")
            )
        rng = checkpoints.capture_rng()
        unpublished = not has_weights(weights_dir(self.run_dir, version))
        if self.world is not None:
            unpublished = self.world.broadcast(unpublished)
        if unpublished:
            self.publish(version)
        path = checkpoints.save(
            self.run_dir,
            version,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            rng=rng,
            keep=self.settings.optimizer.keep_checkpoints,
            world=self.world,
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
            if len(group.prompt_token_ids) == 0:
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
                tolerance=s.grpo.zero_variance_tolerance,
            )
            for completion, advantage in zip(group.completions, advantages, strict=True):
                if len(completion.token_ids) == 0:
                    continue
                if need_sampling and len(completion.logprobs) != len(completion.token_ids):
                    raise ValueError(
                        f"attempt {group.attempt_id}: a completion has "
                        f"{len(completion.token_ids)} tokens but {len(completion.logprobs)} "
                        "sampling log-probs; importance correction needs one per token"
                    )
                sequences.append(
                    TrainSequence(
                        prompt_ids=as_list(group.prompt_token_ids),
                        completion_ids=as_list(completion.token_ids),
                        advantage=advantage,
                        sampling_logprobs=as_list(completion.logprobs) if need_sampling else [],
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
        started = time.perf_counter()
        s = self.settings
        try:
            if step != current:
                raise ValueError(
                    f"the trainer holds weight version {current}, so the next step it can train "
                    f"is {current}, not {step}; restore({step}) first to train step {step}"
                )
            if not groups:
                raise ValueError(f"step {step} has no groups to train on")
            sequences = self._sequences(step, groups)
            step_tokens = sum(len(seq.completion_ids) for seq in sequences)
            if step_tokens == 0:
                raise ValueError(f"step {step}: every completion is empty, nothing to train on")
        except ValueError as error:
            raise agreed(error) from None  # every rank checks the same groups alike
        mini_batches = split_into_mini_batches(
            sequences,
            [g.attempt_id for g in groups],
            s.optimizer.groups_per_update,
            s.optimizer.micro_batch_tokens,
            self.tokenizer.pad_token_id,
            rank=self.rank,
            ranks=self.ranks,
        )
        sums = StepSums(step_tokens=float(step_tokens))
        reset_peak_memory(self.device)
        lr = self.scheduler.get_last_lr()[0]
        total = len(mini_batches) * s.optimizer.passes_per_step
        with self._lockstep(f"training step {step}"):
            self._agree_on_normalisers(step, mini_batches)
            self._score_proximal(mini_batches, sums)
            for _ in range(s.optimizer.passes_per_step):
                for mini_batch in mini_batches:
                    self._update(step, mini_batch, sums, done=len(sums.losses), total=total)
            micro_batches = float(sum(1 for m in mini_batches for b in m.micro if b.tokens))
            if self.world is not None:
                micro_batches = self._sum_over_ranks(sums, micro_batches)
        self.scheduler.step()
        self.version = step + 1

        staleness = [step - g.weight_version for g in groups]
        metrics = sums.metrics()
        metrics.update(
            sequences=float(len(sequences)),
            groups=float(len(groups)),
            mini_batches=float(len(mini_batches)),
            micro_batches=micro_batches,
            lr=lr,
            staleness_mean=sum(staleness) / len(staleness),
            staleness_max=float(max(staleness)),
            train_seconds=time.perf_counter() - started,
        )
        if self.reference is not None:
            metrics["kl"] = sums.kl / sums.visited
        metrics.update(self._rank_figures(time.perf_counter() - started))
        return metrics

    def _agree_on_normalisers(self, step: int, mini_batches: list[MiniBatch]) -> None:
        """Each update's loss is divided by its token (and sequence) count over all ranks: the
        ranks add up their shares' counts, which must come to the planned totals (every rank
        planned the same split from the same groups)."""
        if self.world is None:
            return
        local = [float(x) for m in mini_batches for x in (m.tokens, len(m.sequences))]
        summed = self.world.sum(local)
        planned = [float(x) for m in mini_batches for x in (m.total_tokens, m.total_sequences)]
        if summed != planned:
            raise RuntimeError(
                f"step {step}: the ranks' shares add up to {summed} tokens and sequences per "
                f"update, not the planned {planned}: the ranks did not plan the same step"
            )

    def _sum_over_ranks(self, sums: StepSums, micro_batches: float) -> float:
        """Turn this rank's token sums into the step's (the gradient norms are global already:
        FSDP's norm is over the whole sharded gradient). Returns the step's micro-batches."""
        fields = (
            "entropy",
            "advantage_abs",
            "importance_weight",
            "truncated",
            "visited",
            "clipped_low",
            "clipped_high",
            "ratio",
            "kl",
        )
        values = [getattr(sums, f) for f in fields] + list(sums.losses) + [micro_batches]
        totals = self.world.sum(values)
        for name, value in zip(fields, totals, strict=False):
            setattr(sums, name, value)
        sums.losses = totals[len(fields) : len(fields) + len(sums.losses)]
        return totals[-1]

    def _rank_figures(self, seconds: float) -> dict[str, float]:
        """Each rank's step time and peak memory (`rank{r}_step_seconds`,
        `rank{r}_peak_memory_bytes`) and the number of ranks."""
        mine = (seconds, peak_memory_bytes(self.device))
        every = self.world.gather(mine) if self.world is not None else [mine]
        figures = {"ranks": float(len(every))}
        for rank, (took, peak) in enumerate(every):
            figures[f"rank{rank}_step_seconds"] = float(took)
            figures[f"rank{rank}_peak_memory_bytes"] = float(peak)
        return figures

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
                step_tokens=float(mini_batch.total_tokens),
                step_sequences=float(mini_batch.total_sequences),
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
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        # Over sharded gradients the norm is a DTensor: the whole gradient's, once gathered.
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(grad_norm):
            # The norm is the whole gradient's on every rank, so every rank stops here alike.
            self.optimizer.zero_grad(set_to_none=True)
            advice = "lower optimizer.lr, or check the rewards and log-probs of this batch"
            if done == 0:
                raise agreed(
                    FloatingPointError(
                        f"step {step}: the gradient norm is {grad_norm}; the weights were not "
                        f"updated ({advice})"
                    )
                )
            # The step's earlier updates are in the weights: they are no version at all.
            self.version = None
            raise agreed(
                FloatingPointError(
                    f"step {step}: the gradient norm of update {done + 1} of {total} is "
                    f"{grad_norm}; the {done} update(s) before it were applied, so "
                    f"restore({step}) before training the step again ({advice})"
                )
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums.losses.append(loss_total)
        sums.grad_norms.append(grad_norm)
