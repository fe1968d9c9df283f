from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from refill.assets import resolve_model_path, tiny_arith_path  # noqa: E402
from refill.models.payload import GenerationRequest  # noqa: E402
from refill.tasks.backends import make_engine  # noqa: E402
from refill.tasks.backends.base import GenerationOutput  # noqa: E402
from refill.tasks.backends.hf import (  # noqa: E402
    HFEngine,
    inverse_cdf_sample,
    processed_logprobs,
)

torch.set_num_threads(1)

EOS, PAD = 2, 0


def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(tiny_arith_path()), local_files_only=True)


def tiny_model(seed: int, eos_bias: float | None = None):
    torch.manual_seed(seed)
    tok = tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    # A random tiny model is nearly uniform over its vocabulary; sharpen it so that top-p
    # actually cuts tokens away.
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    if eos_bias is not None:
        # A head with a bias makes stopping (and never emitting padding) controllable.
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[EOS] = eos_bias
            head.bias[PAD] = -100.0
        model.lm_head = head
    return model.eval()


@pytest.fixture(scope="module")
def engine():
    return HFEngine(tiny_model(0), tokenizer())


def request(
    prompt="12+7=", n=3, seed=1, temperature=1.0, top_p=1.0, max_new_tokens=6, attempt_id=1
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


def as_tuples(output: GenerationOutput):
    return [(c.token_ids, c.finish_reason, c.text) for c in output.completions]


def test_shapes_and_prompt_ids(engine):
    outputs = engine.generate([request(n=3), request(prompt="5-3=", n=2, attempt_id=2)])
    assert [len(o.completions) for o in outputs] == [3, 2]
    assert outputs[0].prompt_token_ids == tokenizer()("12+7=")["input_ids"]
    for out in outputs:
        for c in out.completions:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 6
            assert all(0 <= t < 100 for t in c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == EOS)
            if c.finish_reason == "length":
                assert len(c.token_ids) == 6


def test_determinism_by_seed(engine):
    a = engine.generate([request(seed=11)])[0]
    b = engine.generate([request(seed=11)])[0]
    c = engine.generate([request(seed=12)])[0]
    assert as_tuples(a) == as_tuples(b)
    assert a.completions[0].logprobs == b.completions[0].logprobs
    assert as_tuples(a) != as_tuples(c)
    # The n completions of one group are different samples, not copies.
    assert len({tuple(c.token_ids) for c in a.completions}) > 1


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5)])
def test_logprobs_match_a_recomputed_forward_pass(engine, temperature, top_p):
    out = engine.generate(
        [request(n=4, seed=3, temperature=temperature, top_p=top_p, max_new_tokens=8)]
    )[0]
    prompt = out.prompt_token_ids
    for completion in out.completions:
        assert all(math.isfinite(lp) and lp <= 0 for lp in completion.logprobs)
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0]
        # Position k predicts token k + 1.
        predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion.token_ids)]
        rows = len(completion.token_ids)
        logp = processed_logprobs(
            predicting, torch.full((rows,), temperature), torch.full((rows,), top_p)
        )
        expected = logp.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_top_p_truncates_the_distribution():
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0]])
    full = processed_logprobs(logits, torch.tensor([1.0]), torch.tensor([1.0]))
    cut = processed_logprobs(logits, torch.tensor([1.0]), torch.tensor([0.8]))
    assert torch.isfinite(full).all()
    # The first two tokens hold about 0.91 of the mass: the nucleus stops there.
    assert torch.isfinite(cut[0, :2]).all() and torch.isinf(cut[0, 2:]).all()
    assert torch.logsumexp(cut, -1).item() == pytest.approx(0.0, abs=1e-6)
    assert (cut[0, :2] > full[0, :2]).all()


def test_a_row_that_asks_no_cut_is_not_cut_beside_rows_that_do():
    """Groups of runs with different top_p share an engine batch. A top_p = 1 row went through
    the cut with the others, and float32's running sum reaches 1.0 before the end of a large
    vocabulary: its tail became -inf, tokens the engine could never draw."""
    logits = torch.randn(2, 150_000, generator=torch.Generator().manual_seed(0)) * 3
    mixed = processed_logprobs(logits, torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.5]))
    alone = processed_logprobs(logits[:1], torch.tensor([1.0]), torch.tensor([1.0]))
    assert torch.isfinite(mixed[0]).all()
    assert torch.allclose(mixed[0], alone[0], atol=1e-6)
    assert torch.isinf(mixed[1]).any()


def test_a_sampled_token_stays_in_the_nucleus_it_was_drawn_from():
    """Scoring a token the engine drew (`keep`), a recomputation whose rounding put it just
    outside the nucleus (bf16) gave it -inf: its importance weight nothing, the token out of
    the gradient without a word. It keeps a finite log-prob; the other tokens are as before."""
    logits = torch.tensor([[4.0, 3.0, 2.0, -5.0], [4.0, 3.0, 2.0, -5.0]])
    cut = processed_logprobs(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.8, 0.8]))
    kept = processed_logprobs(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.8, 0.8]), keep=torch.tensor([2, 0]))
    assert math.isinf(cut[0, 2].item()) and math.isfinite(kept[0, 2].item())
    assert torch.logsumexp(kept[0], -1).item() == pytest.approx(0.0, abs=1e-6)
    assert math.isinf(kept[0, 3].item())  # only the kept token joins the nucleus
    assert torch.equal(kept[1], cut[1])  # a token already inside changes nothing


def test_groups_batched_together_equal_groups_generated_alone(engine):
    calls: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        a = request(prompt="3+4=", n=2, seed=21, attempt_id=1)
        b = request(
            prompt="19-11=",
            n=3,
            seed=22,
            temperature=0.8,
            top_p=0.9,
            max_new_tokens=4,
            attempt_id=2,
        )
        together = engine.generate([a, b])
        batched_calls = list(calls)
        calls.clear()
        alone = [engine.generate([a])[0], engine.generate([b])[0]]
    finally:
        hook.remove()
    # One batched decode: every forward pass carried all 5 rows, and there were no more passes
    # than the longest group needs.
    assert set(batched_calls) == {5}
    assert len(batched_calls) <= 6
    for joint, single in zip(together, alone, strict=True):
        assert as_tuples(joint) == as_tuples(single)
        assert joint.prompt_token_ids == single.prompt_token_ids
        for cj, cs in zip(joint.completions, single.completions, strict=True):
            assert torch.allclose(torch.tensor(cj.logprobs), torch.tensor(cs.logprobs), atol=1e-5)


def test_stops_at_eos_and_strips_padding():
    engine = HFEngine(tiny_model(0, eos_bias=14.0), tokenizer())
    out = engine.generate([request(n=16, seed=5, max_new_tokens=12)])[0]
    lengths = {len(c.token_ids) for c in out.completions}
    assert len(lengths) > 1
    assert any(c.finish_reason == "stop" for c in out.completions)
    for c in out.completions:
        assert PAD not in c.token_ids
        assert EOS not in c.token_ids[:-1]
        assert "<eos>" not in c.text and "<pad>" not in c.text


def test_a_model_that_always_stops():
    engine = HFEngine(tiny_model(0, eos_bias=80.0), tokenizer())
    out = engine.generate([request(n=2)])[0]
    for c in out.completions:
        assert c.token_ids == [EOS]
        assert c.finish_reason == "stop"
        assert c.text == ""
        assert c.logprobs[0] == pytest.approx(0.0, abs=1e-4)


def test_greedy_ignores_the_seed(engine):
    a = engine.generate([request(temperature=0.0, seed=1)])[0]
    b = engine.generate([request(temperature=0.0, seed=999)])[0]
    assert as_tuples(a) == as_tuples(b)
    assert len({tuple(c.token_ids) for c in a.completions}) == 1
    assert all(lp == 0.0 for c in a.completions for lp in c.logprobs)


def test_a_bad_request_fails_alone(engine):
    outputs = engine.generate([request(prompt=""), request(seed=3)])
    assert isinstance(outputs[0], ValueError) and "no tokens" in str(outputs[0])
    assert isinstance(outputs[1], GenerationOutput)


def test_load_weights_changes_outputs_in_place(tmp_path):
    engine = HFEngine(tiny_model(0), tokenizer())
    before = engine.generate([request(seed=8)])[0]
    other = tiny_model(1)
    other.save_pretrained(tmp_path / "v000001")
    model_object = engine.model
    engine.load_weights(1, str(tmp_path / "v000001"))
    assert engine.weight_version == 1
    assert engine.model is model_object
    after = engine.generate([request(seed=8)])[0]
    assert as_tuples(after) != as_tuples(before)
    reference = HFEngine(other, tokenizer()).generate([request(seed=8)])[0]
    assert as_tuples(after) == as_tuples(reference)
    # A version without files (the base model) only records the version.
    engine.load_weights(2, None)
    assert engine.weight_version == 2
    assert as_tuples(engine.generate([request(seed=8)])[0]) == as_tuples(after)


def test_load_weights_refuses_a_mismatched_directory(tmp_path):
    from safetensors.torch import save_file

    engine = HFEngine(tiny_model(0), tokenizer())
    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="does not"):
        engine.load_weights(1, str(tmp_path))
    assert engine.weight_version is None


def test_chat_template_is_applied_when_asked():
    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    engine = HFEngine(tiny_model(0), tok, use_chat_template=True)
    out = engine.generate([request(prompt="2+2=")])[0]
    assert out.prompt_token_ids == tok("<2+2=>:", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="no chat template"):
        HFEngine(tiny_model(0), tokenizer(), use_chat_template=True)


def test_make_engine_loads_a_local_directory(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model(0).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    config = SimpleNamespace(
        model=SimpleNamespace(name_or_path=str(model_dir), dtype="float32"),
        generation=SimpleNamespace(backend="hf", use_chat_template=False, hf={"device": "cpu"}),
    )
    engine = make_engine(config)
    assert isinstance(engine, HFEngine)
    assert engine.device.type == "cpu" and next(engine.model.parameters()).dtype == torch.float32
    reference = HFEngine(tiny_model(0), tokenizer()).generate([request(seed=4)])[0]
    assert as_tuples(engine.generate([request(seed=4)])[0]) == as_tuples(reference)


def test_builtin_tiny_model_builds_from_its_shipped_config():
    path = Path(resolve_model_path("builtin:tiny-arith"))
    if not (path / "config.json").exists():
        pytest.skip("refill/assets/tiny-arith/config.json is not shipped yet")
    config = SimpleNamespace(
        model=SimpleNamespace(
            name_or_path="builtin:tiny-arith", warm_start=SimpleNamespace(seed=3)
        ),
        generation=SimpleNamespace(backend="hf", hf={"device": "cpu"}),
    )
    first, second = make_engine(config), make_engine(config)
    assert first.pad_id == 0 and first.eos_ids == [EOS]
    out = first.generate([request(n=2)])[0]
    assert len(out.completions) == 2
    # A config-only model is initialised from the seed, identically each time.
    assert as_tuples(second.generate([request(n=2)])[0]) == as_tuples(out)


def test_a_zero_uniform_never_picks_a_token_outside_the_nucleus():
    # Logits (0, 3, 2, 1): p = (0.032, 0.644, 0.237, 0.087). top_p 0.5 keeps token 1 alone;
    # top_p 0.9 keeps 1, 2, 3. torch.rand can return exactly 0: the draw is at 1 - u = 1,
    # the top of the CDF, which a token of mass 0 never reaches first. (A draw at u = 0 found
    # token 0, outside the nucleus, with log-prob -inf.)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    logp = processed_logprobs(logits, torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.9]))
    assert logp[0].tolist()[1] == 0.0 and math.isinf(logp[0, 0].item())
    assert math.isinf(logp[1, 0].item())
    zero = inverse_cdf_sample(logp, torch.tensor([0.0, 0.0]))
    # Row 0: only token 1 has mass. Row 1: the CDF reaches its top at token 3, the last
    # token of the nucleus in vocabulary order.
    assert zero.tolist() == [1, 3]
    assert all(math.isfinite(logp[row, token].item()) for row, token in enumerate(zero.tolist()))
    # u just below 1 draws just above 0: the first token of the nucleus.
    assert inverse_cdf_sample(logp, torch.tensor([0.999, 0.999])).tolist() == [1, 1]
