"""The ``hf`` generation back-end: a transformers causal LM, on CPU or GPU.

Groups that arrive together are generated in one batched decode: every completion of every
group is a row of one left-padded batch, prefilled once and decoded step by step with a KV
cache. The sampling loop is written here rather than delegated to ``model.generate`` because
``generate`` takes one temperature, one top-p and one global RNG per call, while a batch mixes
requests with their own parameters and seeds. Here each row has its own temperature, top-p,
length limit and ``torch.Generator`` (seeded from the request seed and the completion index), and
draws its uniforms before the loop. A group's samples therefore do not depend on which other
groups shared its batch (up to floating-point differences of batched matmuls, which could flip a
token only when a uniform falls within rounding error of a bucket edge: in float32 none did in a
review's 48 groups; in bfloat16, whose rounding is 65,000 times coarser, 8 of 48 differed).

Log-probs: each returned log-prob is ``log q(token)`` where ``q`` is the distribution the token
was actually drawn from: logits divided by the temperature, restricted to the top-p nucleus, and
renormalised (``refill.sampling.processed_logprobs``, which the trainer scores with too). That is the behaviour policy of the sample, which is what
the trainer's importance correction needs; the raw-logit (temperature 1) log-prob would describe a
policy that never produced the sample. Temperature 0 is greedy decoding, a point mass: log-prob
0. vLLM returns the same quantity with ``logprobs_mode="processed_logprobs"``.

Completions stop at the first end-of-sequence token, which is kept (with its log-prob, so the
model learns to stop) and ends the completion with ``finish_reason="stop"``; otherwise it ends
at ``max_new_tokens`` with ``"length"``. Padding never appears in a completion.

Weights: the model is loaded by the loaders the trainer uses too (``refill.model_loading``),
so a config-only directory (``builtin:tiny-arith``) gets the same seeded init as in the trainer,
and ``load_weights(version, path)`` copies a published version into the existing model with
``refill.model_loading.load_weights_into`` (same tensors, same device, no reallocation).

Knobs (defaults in ``refill.config.schema``): ``model.name_or_path`` (``builtin:NAME`` or a
local directory; never downloaded), ``model.dtype``, ``model.warm_start.seed`` (the init of a
config-only model), ``generation.use_chat_template``, ``generation.hf.device`` ("auto": cuda
when available, else cpu).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refill.model_loading import load_model, load_tokenizer, load_weights_into, model_directory
from refill.models.payload import Completion, GenerationRequest
from refill.sampling import inverse_cdf_sample, processed_logprobs
from refill.tasks.backends.base import (
    GenerationOutput,
    encode_prompt,
    engine_config,
    eos_token_ids,
    stable_seed,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class _Row:
    request_index: int
    prompt_ids: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


class HFEngine:
    """A transformers model behind the ``Engine`` interface."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        use_chat_template: bool = False,
    ) -> None:
        if use_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "generation.use_chat_template is true but the tokenizer has no chat template; "
                "set it to false or use a tokenizer that ships one"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.device = next(model.parameters()).device
        self.eos_ids = sorted(
            eos_token_ids(tokenizer, getattr(model, "generation_config", None), model.config)
        )
        if not self.eos_ids:
            raise ValueError("neither the tokenizer nor the model config names an eos token")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache` (the old name is deprecated).
        self._cache_name = "cache" if "cache" in params else "past_key_values"
        self._trim_logits = "logits_to_keep" in params
        self.weight_version: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> HFEngine:
        # The loaders the trainer uses too, so that engine and trainer read a model directory
        # the same way (a config-only directory such as builtin:tiny-arith gets the same seeded
        # init).
        config = engine_config(config)
        source = model_directory(config.model.name_or_path)
        device = _device(config.generation.hf.device)
        model = load_model(source, config.model.dtype, seed=config.model.warm_start.seed)
        return cls(
            model.to(device),
            load_tokenizer(source),
            use_chat_template=config.generation.use_chat_template,
        )

    # ------------------------------------------------------------------ Engine

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        results: list[GenerationOutput | Exception | None] = [None] * len(requests)
        prompts: dict[int, list[int]] = {}
        rows: list[_Row] = []
        for i, request in enumerate(requests):
            try:
                prompts[i] = encode_prompt(self.tokenizer, request.prompt, self.use_chat_template)
            except Exception as exc:  # noqa: BLE001 - this request's failure, reported in its slot
                results[i] = exc
                continue
            for j in range(request.n):
                rows.append(
                    _Row(
                        request_index=i,
                        prompt_ids=prompts[i],
                        temperature=request.temperature,
                        top_p=request.top_p,
                        max_new_tokens=request.max_new_tokens,
                        seed=stable_seed(request.seed, j),
                    )
                )
        completions: dict[int, list[Completion]] = {i: [] for i in prompts}
        if rows:
            for row, completion in zip(rows, self._sample(rows), strict=True):
                completions[row.request_index].append(completion)
        for i, ids in prompts.items():
            results[i] = GenerationOutput(prompt_token_ids=ids, completions=completions[i])
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _sample(self, rows: list[_Row]) -> list[Completion]:
        device = self.device
        batch = len(rows)
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            attention[b, width - len(row.prompt_ids) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        input_ids, attention, positions = (
            input_ids.to(device),
            attention.to(device),
            positions.to(device),
        )

        steps = max(r.max_new_tokens for r in rows)
        limits = torch.tensor([r.max_new_tokens for r in rows], device=device)
        temperature = torch.tensor(
            [r.temperature for r in rows], dtype=torch.float32, device=device
        )
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
        greedy = temperature == 0
        # Drawn on the CPU from per-row generators, so a row's randomness depends only on its own
        # seed: not on the device, nor on the rows batched with it.
        uniforms = torch.stack(
            [torch.rand(steps, generator=torch.Generator().manual_seed(r.seed)) for r in rows]
        ).to(device)
        eos = torch.tensor(self.eos_ids, device=device)

        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        sampled: list[torch.Tensor] = []
        sampled_logp: list[torch.Tensor] = []
        cache = None
        step_ids, step_positions = input_ids, positions
        for step in range(steps):
            kwargs: dict[str, Any] = {self._cache_name: cache}
            if self._trim_logits:
                kwargs["logits_to_keep"] = 1
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                use_cache=True,
                **kwargs,
            )
            cache = getattr(out, self._cache_name)
            logp = processed_logprobs(out.logits[:, -1, :], temperature, top_p)
            token = inverse_cdf_sample(logp, uniforms[:, step])
            token = torch.where(greedy, logp.argmax(dim=-1), token)
            token_logp = torch.where(
                greedy, torch.zeros_like(temperature), logp.gather(-1, token[:, None]).squeeze(-1)
            )
            token = torch.where(finished, torch.full_like(token, self.pad_id), token)
            sampled.append(token)
            sampled_logp.append(token_logp)
            finished |= torch.isin(token, eos) | (limits <= step + 1)
            if bool(finished.all()):
                break
            step_ids = token[:, None]
            step_positions = step_positions[:, -1:] + 1
            attention = torch.cat(
                [attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=-1
            )

        tokens = torch.stack(sampled, dim=1).tolist()
        logps = torch.stack(sampled_logp, dim=1).tolist()
        eos_set = set(self.eos_ids)
        completions = []
        for b, row in enumerate(rows):
            ids: list[int] = []
            lps: list[float] = []
            reason = "length"
            for t in range(min(row.max_new_tokens, len(tokens[b]))):
                ids.append(int(tokens[b][t]))
                lps.append(float(logps[b][t]))
                if ids[-1] in eos_set:
                    reason = "stop"
                    break
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(
                Completion(token_ids=ids, logprobs=lps, text=text, finish_reason=reason)
            )
        return completions

    def load_weights(self, version: int, path: str | None) -> None:
        """Load a published weight directory into the model in place (``None``: keep weights)."""
        if path is not None:
            load_weights_into(self.model, path)
            self.model.eval()
        self.weight_version = version

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
