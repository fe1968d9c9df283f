"""The ``vllm`` generation back-end: one ``vllm.LLM`` per worker process, for a GPU fleet.

vllm is imported only by ``VLLMEngine.from_config``; the rest of this module runs against any
object with ``vllm.LLM``'s call signatures, which is how the tests drive it without a GPU.

One engine call per batch: every group that ``BatchingEngine`` gathered becomes one prompt of a
single ``LLM.generate(prompts, [SamplingParams per prompt], use_tqdm=False)``, and vLLM's
scheduler batches all their sequences (continuous batching). Each prompt gets its own
``SamplingParams(n, temperature, top_p, max_tokens, seed, logprobs=0)``; vLLM fans ``n`` out into
child requests seeded ``seed + index`` (``vllm/v1/engine/parallel_sampling.py``,
``ParentRequest._get_child_sampling_params``), so a group is reproducible from its seed whatever
it was batched with. Prompts are passed as token ids (``{"prompt_token_ids": ...}``) encoded by
``encode_prompt``, exactly as the ``hf`` back-end does, so a chat template is applied once and
BOS is never doubled.

Log-probs (verified against vLLM's source, ``vllm/v1/sample/sampler.py`` and
``vllm/logprobs.py``): ``logprobs=0`` asks for the sampled token's log-prob only.
``CompletionOutput.logprobs`` is a sequence (a ``list[dict[int, Logprob]]``, or a
``FlatLogprobs`` that indexes the same way) with one ``{token_id: Logprob(logprob, rank,
decoded_token)}`` per generated position. By default those are *raw* log-probs (before
temperature and top-p); the engine is built with ``logprobs_mode="processed_logprobs"`` so they
are taken after temperature and top-k/top-p, i.e. under the distribution the token was sampled
from, the same quantity the ``hf`` back-end returns (see its docstring for why the trainer wants
that one). ``logprobs_mode`` came with vLLM PR #21398 and its processed modes were made the final
values (after top-k/top-p and temperature) by PR #22387 (August 2025); older vLLMs reject the
argument. ``CompletionOutput.token_ids`` includes the EOS token when generation stopped on it.

Weights in place (verified against ``vllm/v1/worker/gpu_model_runner.py`` and
``vllm/entrypoints/llm.py``): ``LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)``
runs a worker method on every worker (all tensor-parallel ranks). Current vLLM workers expose
``reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)``, which
reloads the model's weights layer by layer from a checkpoint directory without rebuilding the
engine or its KV cache, so ``load_weights`` calls
``collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})``.
Earlier releases' ``reload_weights()`` took no arguments and reloaded from
``model_config.model``; there the path is set first with
``collective_rpc("update_config", args=({"model_config": {"model": path}},))`` (the same two
calls as vLLM's ``examples/offline_inference/skip_loading_weights_in_engine_init.py``). Which
form a vLLM has is read from ``vllm.v1.worker.gpu_worker.Worker.reload_weights``'s signature.
Afterwards ``LLM.reset_prefix_cache()`` drops KV blocks computed with the old weights, which
prefix caching would otherwise reuse for a repeated prompt.

A model directory with only a ``config.json`` (``builtin:tiny-arith``) starts with
``load_format="dummy"`` (random weights): the trainer always publishes version 0 and
``BatchingEngine`` loads it before the first batch. A reload reads through the engine's load
config, so under ``dummy`` it would not load the published weights: current vLLM's
``reload_weights`` refuses a loader without ``get_all_weights`` (``NotImplementedError``:
"Model reloading with `dummy` format"), and older ones re-ran the dummy loader (fresh random
weights). So before the first reload the engine switches the load format with
``collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},))``, as
vLLM's ``examples/offline_inference/skip_loading_weights_in_engine_init.py`` does; the workers'
``update_config`` accepts ``load_config`` and ``model_config`` overrides.

Knobs: ``model.name_or_path``, ``generation.use_chat_template`` [false], ``run.seed`` [0]
(engine default seed; every request carries its own), and ``generation.vllm.*``:
``tensor_parallel_size`` [1], ``gpu_memory_utilization`` [0.85], ``max_model_len`` [null: the
model's], ``enforce_eager`` [false], ``dtype`` ["auto"].
"""

from __future__ import annotations

import gc
import inspect
import math
from collections.abc import Callable
from typing import Any

from refill.assets import resolve_model_path
from refill.model_loading import has_weights
from refill.models.payload import Completion, GenerationRequest
from refill.tasks.backends.base import EngineError, GenerationOutput, encode_prompt, engine_config

RELOAD_STYLES = ("weights_path", "update_config")


def detect_reload_style() -> str:
    """Which in-place reload the installed vLLM supports (see the module docstring)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError as exc:
        raise EngineError(
            "this vLLM has no V1 GPU worker (vllm.v1.worker.gpu_worker); refill needs a vLLM "
            "whose workers can reload weights in place"
        ) from exc
    reload = getattr(Worker, "reload_weights", None)
    if reload is None:
        raise EngineError("this vLLM's worker has no reload_weights; upgrade vLLM")
    params = inspect.signature(reload).parameters
    takes_path = "weights_path" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    return "weights_path" if takes_path else "update_config"


class VLLMEngine:
    """A ``vllm.LLM`` (or a stand-in with its signatures) behind the ``Engine`` interface."""

    def __init__(
        self,
        llm: Any,
        *,
        sampling_params_cls: Callable[..., Any],
        use_chat_template: bool = False,
        reload_style: str = "weights_path",
        max_model_len: int | None = None,
        tokenizer: Any = None,
        load_format: str | None = None,
    ) -> None:
        if reload_style not in RELOAD_STYLES:
            raise ValueError(f"reload_style must be one of {RELOAD_STYLES}, not {reload_style!r}")
        self.llm = llm
        self.sampling_params_cls = sampling_params_cls
        self.tokenizer = tokenizer if tokenizer is not None else llm.get_tokenizer()
        if use_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "generation.use_chat_template is true but the tokenizer has no chat template; "
                "set it to false or use a tokenizer that ships one"
            )
        self.use_chat_template = use_chat_template
        self.reload_style = reload_style
        self.max_model_len = max_model_len
        #: The load format the engine's workers reload through (None: vLLM's default, auto).
        self.load_format = load_format
        self.weight_version: int | None = None

    @classmethod
    def engine_args(cls, config: Any) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM`` for a run config."""
        config = engine_config(config)
        knobs = config.generation.vllm
        path = resolve_model_path(config.model.name_or_path)
        args: dict[str, Any] = {
            "model": path,
            "tokenizer": path,
            "dtype": knobs.dtype,
            "tensor_parallel_size": knobs.tensor_parallel_size,
            "gpu_memory_utilization": knobs.gpu_memory_utilization,
            "enforce_eager": knobs.enforce_eager,
            "seed": config.run.seed,
            "logprobs_mode": "processed_logprobs",
        }
        if knobs.max_model_len is not None:
            args["max_model_len"] = knobs.max_model_len
        if not has_weights(path):
            args["load_format"] = "dummy"
        return args

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        llm_factory: Callable[..., Any] | None = None,
        sampling_params_cls: Callable[..., Any] | None = None,
        reload_style: str | None = None,
    ) -> VLLMEngine:
        """Start the engine. The keyword hooks replace vllm's ``LLM``/``SamplingParams`` (tests)."""
        if llm_factory is None or sampling_params_cls is None:
            try:
                import vllm
            except ImportError as exc:
                raise ImportError(
                    "generation.backend is 'vllm' but vllm does not import here "
                    f"({exc}); install it on GPU workers with: pip install 'refill[vllm]'"
                ) from exc

            llm_factory = llm_factory or vllm.LLM
            sampling_params_cls = sampling_params_cls or vllm.SamplingParams
            reload_style = reload_style or detect_reload_style()
        config = engine_config(config)
        args = cls.engine_args(config)
        llm = llm_factory(**args)
        return cls(
            llm,
            sampling_params_cls=sampling_params_cls,
            use_chat_template=config.generation.use_chat_template,
            reload_style=reload_style or "weights_path",
            max_model_len=args.get("max_model_len") or _engine_max_model_len(llm),
            load_format=args.get("load_format"),
        )

    # ------------------------------------------------------------------ Engine

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        results: list[GenerationOutput | Exception | None] = [None] * len(requests)
        prompts: list[dict[str, list[int]]] = []
        params: list[Any] = []
        submitted: list[int] = []
        for i, request in enumerate(requests):
            try:
                ids = encode_prompt(self.tokenizer, request.prompt, self.use_chat_template)
                # vLLM validates every prompt before running any, and one over-long prompt would
                # fail the whole call; checking here fails only its own request.
                if self.max_model_len is not None and len(ids) >= self.max_model_len:
                    raise ValueError(
                        f"the prompt of attempt {request.attempt_id} has {len(ids)} tokens; "
                        f"generation.vllm.max_model_len is {self.max_model_len}"
                    )
                # vLLM validates its sampling parameters as they are made: a refusal fails this
                # request, not the batch.
                sampling = self.sampling_params_cls(
                    n=request.n,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    max_tokens=request.max_new_tokens,
                    seed=request.seed,
                    logprobs=0,
                )
            except Exception as exc:  # noqa: BLE001 - this request's failure, reported in its slot
                results[i] = exc
                continue
            prompts.append({"prompt_token_ids": ids})
            params.append(sampling)
            submitted.append(i)
        if submitted:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            if len(outputs) != len(submitted):
                raise EngineError(
                    f"vLLM returned {len(outputs)} outputs for {len(submitted)} prompts"
                )
            for i, output in zip(submitted, outputs, strict=True):
                try:
                    results[i] = _convert(output, requests[i])
                except EngineError as exc:
                    results[i] = exc
        return results  # type: ignore[return-value]

    def load_weights(self, version: int, path: str | None) -> None:
        if path is not None:
            if self.load_format == "dummy":
                # The dummy loader only makes random weights: reload through the real one.
                self.llm.collective_rpc(
                    "update_config", args=({"load_config": {"load_format": "auto"}},)
                )
                self.load_format = "auto"
            if self.reload_style == "weights_path":
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True}
                )
            else:
                self.llm.collective_rpc("update_config", args=({"model_config": {"model": path}},))
                self.llm.collective_rpc("reload_weights")
            self.llm.reset_prefix_cache()
        self.weight_version = version

    def close(self) -> None:
        # vLLM stops its engine process and frees the GPU when the LLM is garbage-collected
        # (a finalizer; it has no shutdown of its own): a reference cycle through it would keep
        # the memory held until the collector's next full pass, so run one now.
        self.llm = None
        gc.collect()


def _engine_max_model_len(llm: Any) -> int | None:
    """The context length vLLM chose when the config left `generation.vllm.max_model_len`
    unset (the model's own), so that an over-long prompt fails alone there too."""
    try:
        value = llm.llm_engine.model_config.max_model_len
    except AttributeError:
        return None
    return int(value) if isinstance(value, int) else None


def _convert(output: Any, request: GenerationRequest) -> GenerationOutput:
    """A ``vllm.RequestOutput`` as a ``GenerationOutput``; ``EngineError`` if it is unusable."""
    completions = sorted(output.outputs, key=lambda c: c.index)
    if len(completions) != request.n:
        raise EngineError(
            f"vLLM returned {len(completions)} completions for attempt {request.attempt_id}, "
            f"which asked for {request.n}"
        )
    converted = []
    for completion in completions:
        if completion.finish_reason not in ("stop", "length"):
            raise EngineError(
                f"vLLM ended completion {completion.index} of attempt {request.attempt_id} with "
                f"finish_reason={completion.finish_reason!r}"
            )
        token_ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise EngineError(
                f"vLLM returned no per-token log-probs for attempt {request.attempt_id}; "
                "SamplingParams.logprobs must be 0"
            )
        logprobs = []
        for position, token in enumerate(token_ids):
            entry = (
                completion.logprobs[position].get(token) if completion.logprobs[position] else None
            )
            if entry is None or not math.isfinite(entry.logprob):
                raise EngineError(
                    f"vLLM gave no finite log-prob for the sampled token {token} at position "
                    f"{position} of attempt {request.attempt_id}"
                )
            logprobs.append(float(entry.logprob))
        converted.append(
            Completion(
                token_ids=token_ids,
                logprobs=logprobs,
                text=completion.text,
                finish_reason=completion.finish_reason,
            )
        )
    return GenerationOutput(
        prompt_token_ids=[int(t) for t in output.prompt_token_ids], completions=converted
    )
