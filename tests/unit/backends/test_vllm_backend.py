"""The vllm back-end against a stand-in engine with vLLM's call signatures and output shapes.

The stand-in mirrors vllm.LLM (generate, get_tokenizer, collective_rpc, reset_prefix_cache),
vllm.SamplingParams, and the RequestOutput / CompletionOutput / Logprob shapes of
vllm/outputs.py and vllm/logprobs.py. The real engine is tested at the bottom, skipped unless
vllm imports and CUDA is available.
"""

from __future__ import annotations

import importlib.util
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from refill.assets import tiny_arith_path
from refill.models.payload import GenerationRequest
from refill.tasks.backends.base import EngineError, GenerationOutput, stable_seed
from refill.tasks.backends.engine_batching import BatchingEngine
from refill.tasks.backends.vllm import VLLMEngine

EOS = 2


# ---------------------------------------------------------------------------- the stand-in


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True


class FlatLogprobs(Sequence):
    """Like vllm.logprobs.FlatLogprobs: flat lists, indexed as one dict per position."""

    def __init__(self, positions: list[dict[int, Logprob]]):
        self.token_ids = [t for p in positions for t in p]
        self.logprobs = [lp.logprob for p in positions for lp in p.values()]

    def __len__(self):
        return len(self.token_ids)

    def __getitem__(self, i):
        return {self.token_ids[i]: Logprob(self.logprobs[i], rank=1)}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    logprobs: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # vLLM 0.32's own check as the object is made (vllm/sampling_params.py, _verify_args).
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")


class ModelConfig(SimpleNamespace):
    """`LLM.llm_engine.model_config`: what vLLM resolved, the context length among it."""


def _tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_arith_path()), local_files_only=True)


class FakeLLM:
    def __init__(self, tensor_parallel_size: int = 1, **engine_args: Any):
        self.engine_args = {"tensor_parallel_size": tensor_parallel_size, **engine_args}
        self.tensor_parallel_size = tensor_parallel_size
        self.tokenizer = _tokenizer()
        self.generate_calls: list[tuple[list, list]] = []
        self.rpcs: list[tuple[str, tuple, dict]] = []
        self.prefix_resets = 0
        self.model = engine_args.get("model", "base")
        # vLLM takes the model's own context length when max_model_len is not given.
        self.llm_engine = SimpleNamespace(model_config=ModelConfig(max_model_len=engine_args.get("max_model_len", 32)))
        self.load_format = engine_args.get("load_format", "auto")
        # vLLM's dummy loader starts from random weights.
        self.weights = "random-0" if self.load_format == "dummy" else "base"
        self.dummy_inits = 0
        self.finish_override: dict[int, str] = {}
        self.flat = False
        self.drop_logprobs = False
        self._lock = threading.Lock()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None
    ):
        assert self._lock.acquire(blocking=False), "vllm.LLM is not re-entrant"
        try:
            assert use_tqdm is False
            assert isinstance(sampling_params, list) and len(sampling_params) == len(prompts)
            self.generate_calls.append((prompts, sampling_params))
            outputs = []
            for k, (prompt, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
                ids = prompt["prompt_token_ids"]
                completions = []
                for j in range(sp.n):
                    # vLLM seeds the j-th child of a request with seed + j.
                    rng = random.Random(stable_seed(sp.seed + j, self.weights, tuple(ids)))
                    length = rng.randint(1, sp.max_tokens)
                    tokens = [rng.randrange(4, 100) for _ in range(length)]
                    stop = length < sp.max_tokens
                    if stop:
                        tokens[-1] = EOS
                    positions = [{t: Logprob(-rng.random() - 0.01, rank=1)} for t in tokens]
                    completions.append(
                        CompletionOutput(
                            index=j,
                            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                            token_ids=tokens,
                            cumulative_logprob=sum(
                                lp.logprob for p in positions for lp in p.values()
                            ),
                            logprobs=None
                            if self.drop_logprobs
                            else (FlatLogprobs(positions) if self.flat else positions),
                            finish_reason=self.finish_override.get(k, "stop" if stop else "length"),
                        )
                    )
                # vLLM aggregates children as they finish; order is not guaranteed.
                outputs.append(
                    RequestOutput(str(k), None, list(ids), None, list(reversed(completions)))
                )
            return outputs
        finally:
            self._lock.release()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.rpcs.append((method, tuple(args), dict(kwargs)))
        if method == "update_config":
            # vllm.config.update_config: only the sections named are overridden.
            overrides = args[0]
            if "model_config" in overrides:
                self.model = overrides["model_config"]["model"]
            if "load_config" in overrides:
                self.load_format = overrides["load_config"]["load_format"]
        elif method == "reload_weights":
            if self.load_format == "dummy":
                # Like vLLM's dummy loader: the new weights are never read. Current vLLM
                # refuses (its DummyModelLoader has no get_all_weights); the argument-less
                # reload of older ones re-ran the dummy init.
                if "weights_path" in kwargs:
                    raise NotImplementedError("Model reloading with `dummy` format")
                self.dummy_inits += 1
                self.weights = f"random-{self.dummy_inits}"
            else:
                self.weights = kwargs.get("weights_path", self.model)
        else:
            raise AttributeError(f"the worker has no method {method}")
        return [None] * self.tensor_parallel_size

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.prefix_resets += 1
        return True


# ---------------------------------------------------------------------------- helpers


def request(
    attempt_id=1, prompt="12+7=", n=3, seed=5, temperature=0.9, top_p=0.95, max_new_tokens=6
):
    return GenerationRequest(
        attempt_id=attempt_id,
        prompt=prompt,
        row={},
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )


def engine(**kwargs) -> tuple[VLLMEngine, FakeLLM]:
    llm = FakeLLM()
    return VLLMEngine(llm, sampling_params_cls=SamplingParams, **kwargs), llm


# ---------------------------------------------------------------------------- tests


def test_groups_go_to_vllm_in_one_call_with_their_own_sampling_params():
    eng, llm = engine()
    outs = eng.generate(
        [
            request(1, n=2, seed=10),
            request(2, prompt="3-1=", n=4, seed=20, temperature=0.5, top_p=0.8, max_new_tokens=3),
        ]
    )
    assert len(llm.generate_calls) == 1
    prompts, params = llm.generate_calls[0]
    tok = _tokenizer()
    assert prompts == [
        {"prompt_token_ids": tok("12+7=")["input_ids"]},
        {"prompt_token_ids": tok("3-1=")["input_ids"]},
    ]
    assert params[0] == SamplingParams(
        n=2, temperature=0.9, top_p=0.95, max_tokens=6, seed=10, logprobs=0
    )
    assert params[1] == SamplingParams(
        n=4, temperature=0.5, top_p=0.8, max_tokens=3, seed=20, logprobs=0
    )
    assert [len(o.completions) for o in outs] == [2, 4]


def test_outputs_are_converted_in_completion_order():
    eng, llm = engine()
    out = eng.generate([request(n=5, seed=3)])[0]
    assert isinstance(out, GenerationOutput)
    assert out.prompt_token_ids == _tokenizer()("12+7=")["input_ids"]
    # Reproduce what the stand-in sampled for child j (seed + j) and compare.
    again = FakeLLM().generate(
        [{"prompt_token_ids": out.prompt_token_ids}],
        [SamplingParams(n=5, temperature=0.9, top_p=0.95, max_tokens=6, seed=3, logprobs=0)],
        use_tqdm=False,
    )[0]
    expected = sorted(again.outputs, key=lambda c: c.index)
    for mine, theirs in zip(out.completions, expected, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert mine.logprobs == [
            p[t].logprob for p, t in zip(theirs.logprobs, theirs.token_ids, strict=True)
        ]
        assert mine.finish_reason == theirs.finish_reason
        assert mine.text == theirs.text
        assert (mine.finish_reason == "stop") == (mine.token_ids[-1] == EOS)
        assert all(lp < 0 for lp in mine.logprobs)


def test_flat_logprobs_are_read_like_lists():
    eng, llm = engine()
    llm.flat = True
    flat = eng.generate([request(seed=9)])[0]
    llm.flat = False
    plain = eng.generate([request(seed=9)])[0]
    assert flat == plain


def test_an_aborted_or_malformed_group_fails_alone():
    eng, llm = engine()
    llm.finish_override = {1: "abort"}
    outs = eng.generate([request(1), request(2), request(3)])
    assert isinstance(outs[1], EngineError) and "abort" in str(outs[1])
    assert isinstance(outs[0], GenerationOutput) and isinstance(outs[2], GenerationOutput)
    llm.finish_override = {}
    llm.drop_logprobs = True
    assert isinstance(eng.generate([request()])[0], EngineError)


def test_a_prompt_longer_than_the_model_fails_alone():
    eng, llm = engine(max_model_len=8)
    outs = eng.generate([request(1, prompt="1+1="), request(2, prompt="123456789+987654321=")])
    assert isinstance(outs[0], GenerationOutput)
    assert isinstance(outs[1], ValueError) and "max_model_len is 8" in str(outs[1])
    assert len(llm.generate_calls[0][0]) == 1


def test_without_max_model_len_the_engines_own_bounds_the_prompt(tmp_path):
    """With `generation.vllm.max_model_len` unset (its default) the check was skipped, and one
    over-long prompt failed the whole `LLM.generate` call (vLLM validates every prompt first)."""
    config = SimpleNamespace(
        run=SimpleNamespace(seed=7),
        model=SimpleNamespace(name_or_path="builtin:tiny-arith"),
        generation=SimpleNamespace(
            backend="vllm", use_chat_template=False,
            vllm=SimpleNamespace(tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=None,
                                 enforce_eager=True, dtype="float32"),
        ),
    )
    eng = VLLMEngine.from_config(config, llm_factory=FakeLLM, sampling_params_cls=SamplingParams)
    assert "max_model_len" not in eng.llm.engine_args and eng.max_model_len == 32
    long_prompt = "+".join(["123456789"] * 8) + "="
    outs = eng.generate([request(1, prompt="1+1="), request(2, prompt=long_prompt)])
    assert isinstance(outs[0], GenerationOutput)
    assert isinstance(outs[1], ValueError) and "max_model_len is 32" in str(outs[1])


def test_sampling_parameters_vllm_refuses_fail_their_request_alone():
    """vLLM 0.32 refuses a temperature above 2 as the SamplingParams is made: made outside the
    per-request guard, that failed every group of the batch."""
    eng, llm = engine()
    outs = eng.generate([request(1), request(2, temperature=2.5), request(3)])
    assert isinstance(outs[1], ValueError) and "temperature" in str(outs[1])
    assert isinstance(outs[0], GenerationOutput) and isinstance(outs[2], GenerationOutput)
    assert len(llm.generate_calls[0][0]) == 2


def test_load_weights_reloads_in_place_and_resets_the_prefix_cache():
    eng, llm = engine()
    before = eng.generate([request(seed=4)])[0]
    eng.load_weights(3, "/runs/r/weights/v000003")
    assert llm.rpcs == [
        (
            "reload_weights",
            (),
            {"weights_path": "/runs/r/weights/v000003", "is_checkpoint_format": True},
        )
    ]
    assert llm.prefix_resets == 1
    assert eng.weight_version == 3
    after = eng.generate([request(seed=4)])[0]
    assert after != before
    eng.load_weights(4, None)
    assert len(llm.rpcs) == 1 and eng.weight_version == 4


def test_older_vllm_reloads_through_update_config():
    eng, llm = engine(reload_style="update_config")
    eng.load_weights(1, "/w/v000001")
    assert [m for m, _, _ in llm.rpcs] == ["update_config", "reload_weights"]
    assert llm.rpcs[0][1] == ({"model_config": {"model": "/w/v000001"}},)
    assert llm.weights == "/w/v000001" and llm.prefix_resets == 1


@pytest.mark.parametrize("reload_style", ["weights_path", "update_config"])
def test_the_stand_in_reloads_nothing_under_the_dummy_load_format(reload_style):
    # An engine that forgets to switch the load format (the bug this stand-in now catches):
    # the reload fails, or leaves random weights in place of the published version.
    llm = FakeLLM(load_format="dummy")
    eng = VLLMEngine(llm, sampling_params_cls=SamplingParams, reload_style=reload_style)
    if reload_style == "weights_path":
        with pytest.raises(NotImplementedError, match="dummy"):
            eng.load_weights(0, "/runs/r/weights/v000000")
    else:
        eng.load_weights(0, "/runs/r/weights/v000000")
        assert llm.weights == "random-1"


@pytest.mark.parametrize("reload_style", ["weights_path", "update_config"])
def test_a_dummy_start_switches_to_the_real_loader_before_its_first_reload(reload_style):
    config = SimpleNamespace(
        model=SimpleNamespace(name_or_path="builtin:tiny-arith"),
        generation=SimpleNamespace(backend="vllm"),
    )
    made: list[FakeLLM] = []

    def factory(**kwargs):
        made.append(FakeLLM(**kwargs))
        return made[-1]

    eng = VLLMEngine.from_config(
        config, llm_factory=factory, sampling_params_cls=SamplingParams, reload_style=reload_style
    )
    llm = made[0]
    assert llm.load_format == "dummy" and eng.load_format == "dummy"
    random_start = eng.generate([request(seed=4)])[0]
    eng.load_weights(0, "/runs/r/weights/v000000")
    # vLLM's own example: update_config({"load_config": {"load_format": "auto"}}), then reload.
    assert llm.rpcs[0] == ("update_config", ({"load_config": {"load_format": "auto"}},), {})
    assert llm.load_format == "auto"
    assert llm.weights == "/runs/r/weights/v000000"
    assert eng.generate([request(seed=4)])[0] != random_start
    switches = [rpc for rpc in llm.rpcs if rpc[1] and "load_config" in rpc[1][0]]
    eng.load_weights(1, "/runs/r/weights/v000001")
    assert llm.weights == "/runs/r/weights/v000001"
    # The switch is made once.
    assert [rpc for rpc in llm.rpcs if rpc[1] and "load_config" in rpc[1][0]] == switches


def test_engine_args_from_config(tmp_path):
    config = SimpleNamespace(
        run=SimpleNamespace(seed=7),
        model=SimpleNamespace(name_or_path="builtin:tiny-arith"),
        generation=SimpleNamespace(
            backend="vllm",
            use_chat_template=False,
            vllm=SimpleNamespace(
                tensor_parallel_size=2,
                gpu_memory_utilization=0.5,
                max_model_len=64,
                enforce_eager=True,
                dtype="bfloat16",
            ),
        ),
    )
    made: list[FakeLLM] = []

    def factory(**kwargs):
        made.append(FakeLLM(**kwargs))
        return made[-1]

    eng = VLLMEngine.from_config(config, llm_factory=factory, sampling_params_cls=SamplingParams)
    args = made[0].engine_args
    assert args["model"] == str(tiny_arith_path()) == args["tokenizer"]
    assert args["tensor_parallel_size"] == 2 and args["gpu_memory_utilization"] == 0.5
    assert (
        args["max_model_len"] == 64
        and args["enforce_eager"] is True
        and args["dtype"] == "bfloat16"
    )
    assert args["seed"] == 7
    assert args["logprobs_mode"] == "processed_logprobs"
    # The shipped tiny model has a config but no weights: vLLM starts with dummy weights and
    # version 0 is loaded in place before the first batch.
    assert args["load_format"] == "dummy"
    assert eng.max_model_len == 64

    (tmp_path / "model.safetensors").write_bytes(b"")
    config.model.name_or_path = str(tmp_path)
    VLLMEngine.from_config(config, llm_factory=factory, sampling_params_cls=SamplingParams)
    assert "load_format" not in made[1].engine_args


def test_batching_engine_in_front_of_vllm():
    eng, llm = engine()
    with BatchingEngine(
        eng, max_batch=8, max_wait_ms=50, weights_provider=lambda needed: (0, "/w/v000000")
    ) as b:
        results: dict[int, Any] = {}

        def run(i):
            results[i] = b.submit(request(attempt_id=i, seed=100 + i))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert len(llm.generate_calls) < 8
    assert sum(len(prompts) for prompts, _ in llm.generate_calls) == 8
    assert [m for m, _, _ in llm.rpcs] == ["reload_weights"]
    alone, _ = engine()
    alone.load_weights(0, "/w/v000000")
    for i, out in results.items():
        assert out.weight_version == 0
        assert (
            out.completions == alone.generate([request(attempt_id=i, seed=100 + i)])[0].completions
        )


def test_chat_template_is_applied_to_the_token_ids():
    llm = FakeLLM()
    llm.tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    eng = VLLMEngine(llm, sampling_params_cls=SamplingParams, use_chat_template=True)
    eng.generate([request(prompt="1+2=")])
    assert (
        llm.generate_calls[0][0][0]["prompt_token_ids"]
        == llm.tokenizer("[1+2=]", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_without_vllm_the_error_says_how_to_install_it():
    from refill.tasks.backends import make_engine

    config = SimpleNamespace(
        model=SimpleNamespace(name_or_path="builtin:tiny-arith"),
        generation=SimpleNamespace(backend="vllm"),
    )
    with pytest.raises(ImportError, match=r"refill\[vllm\]"):
        make_engine(config)


# ---------------------------------------------------------------------------- the real engine


def _vllm_and_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_and_cuda(), reason="needs the vllm package and a CUDA device")
def test_real_vllm_engine(tmp_path):
    import torch
    import transformers

    from refill.tasks.backends.hf import processed_logprobs

    def tiny(seed, directory):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=100,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(40)
        model.save_pretrained(directory)
        _tokenizer().save_pretrained(directory)
        return model

    base = tiny(0, tmp_path / "base")
    other = tiny(1, tmp_path / "v000001")
    config = SimpleNamespace(
        model=SimpleNamespace(name_or_path=str(tmp_path / "base")),
        generation=SimpleNamespace(
            backend="vllm",
            vllm=SimpleNamespace(
                gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=128, dtype="float32"
            ),
        ),
    )
    eng = VLLMEngine.from_config(config)
    req = request(n=4, seed=11, temperature=0.8, top_p=0.9, max_new_tokens=8)
    pair = [req, request(attempt_id=2, prompt="3+4=", seed=12)]
    first = eng.generate(pair)
    assert all(isinstance(o, GenerationOutput) for o in first)
    assert [o.completions for o in eng.generate(pair)] == [o.completions for o in first]

    def check_logprobs(model, output):
        for c in output.completions:
            ids = torch.tensor([output.prompt_token_ids + c.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0]
            k = len(output.prompt_token_ids)
            rows = len(c.token_ids)
            lp = processed_logprobs(
                logits[k - 1 : k - 1 + rows], torch.full((rows,), 0.8), torch.full((rows,), 0.9)
            )
            expected = lp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=2e-2)

    check_logprobs(base, first[0])
    eng.load_weights(1, str(tmp_path / "v000001"))
    after = eng.generate([req])[0]
    assert after.completions != first[0].completions
    check_logprobs(other, after)
