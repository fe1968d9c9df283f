"""Weight version 0: the warm start, its cache, and the plain initial model."""

from __future__ import annotations

import json

import pytest
import torch

from refill.model_loading import load_model, load_tokenizer, model_directory
from refill.trainer import warmstart
from refill.trainer.warmstart import _examples, cache_key, prepare_initial_weights
from refill.trainer.weights import weights_dir


@pytest.fixture
def short(settings):
    settings.model.warm_start.enabled = True
    settings.model.warm_start.steps = 3
    settings.model.warm_start.batch_size = 8
    return settings


def _state(path):
    return load_model(path).state_dict()


def test_warm_start_is_cached_and_reused(short, tmp_path, monkeypatch):
    calls = []
    real = warmstart.supervised_warm_start

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(warmstart, "supervised_warm_start", counting)
    first = prepare_initial_weights(short, tmp_path / "a")
    second = prepare_initial_weights(short, tmp_path / "b")
    assert first == str(weights_dir(tmp_path / "a", 0))
    assert len(calls) == 1  # the second run found the cache
    a, b = _state(first), _state(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The warm start changed the weights away from the seeded init.
    init = load_model(model_directory("builtin:tiny-arith"), seed=short.model.warm_start.seed)
    assert not torch.equal(a["model.norm.weight"], init.state_dict()["model.norm.weight"])
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1
    assert json.loads((entries[0] / "warm_start.json").read_text())["settings"]["steps"] == 3
    # Idempotent: a run that has version 0 keeps it.
    assert prepare_initial_weights(short, tmp_path / "a") == first
    assert len(calls) == 1


def test_cache_key_follows_the_settings(short):
    source = model_directory(short.model.name_or_path)
    base = cache_key(short, source)
    assert cache_key(short, source) == base
    for key, value in [("steps", 4), ("lr", 1e-2), ("seed", 5), ("format_noise", 0.1)]:
        original = getattr(short.model.warm_start, key)
        setattr(short.model.warm_start, key, value)
        assert cache_key(short, source) != base, key
        setattr(short.model.warm_start, key, original)
    short.data.prompt_template = "Q: {prompt}"
    assert cache_key(short, source) != base


def test_without_warm_start_version_0_is_the_seeded_init(settings, tmp_path):
    path = prepare_initial_weights(settings, tmp_path / "run")
    init = load_model(model_directory("builtin:tiny-arith"), seed=settings.model.warm_start.seed)
    saved = _state(path)
    assert all(torch.equal(saved[k], v) for k, v in init.state_dict().items())
    assert not (tmp_path / "cache").exists()


def test_format_noise_marks_that_fraction_of_answers():
    tokenizer = load_tokenizer(model_directory("builtin:tiny-arith"))
    rows = [{"prompt": "3+4=", "answer": "7"}] * 1000
    examples = _examples(rows, tokenizer, "{prompt}", 0.6, seed=0)
    seven, dot, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("7", ".", "<eos>"))
    untidy = sum(1 for _, answer in examples if answer == [seven, dot, eos])
    tidy = sum(1 for _, answer in examples if answer == [seven, eos])
    assert tidy + untidy == 1000
    assert 550 <= untidy <= 650
    assert examples[0][0] == tokenizer("3+4=").input_ids


def test_a_model_path_without_config_is_explained(settings, tmp_path):
    settings.model.name_or_path = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        prepare_initial_weights(settings, tmp_path / "run")
