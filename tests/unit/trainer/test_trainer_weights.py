"""Publishing weight versions and loading them into a generation worker's model."""

from __future__ import annotations

import os

import pytest
import torch

from refill.model_loading import has_weights, load_model, load_weights_into, model_directory
from refill.trainer.grpo import GRPOTrainer
from refill.trainer.weights import atomic_directory, latest_version, published_versions, weights_dir

from .conftest import make_groups


def test_published_version_loads_into_a_fresh_model(settings, tmp_path):
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    trainer.train_step(0, make_groups(0, seed=1))
    path = trainer.publish(1)
    assert path == str(weights_dir(tmp_path / "run", 1))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))

    # A worker's model: another seed, so every tensor starts different.
    fresh = load_model(model_directory("builtin:tiny-arith"), seed=99)
    trained = dict(trainer.model.named_parameters())
    assert not all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters())
    tensors_before = {n: p.data_ptr() for n, p in fresh.named_parameters()}
    load_weights_into(fresh, path)
    for name, param in fresh.named_parameters():
        assert torch.equal(param, trained[name]), name
        assert param.data_ptr() == tensors_before[name]  # in place: same storage
    # Tied embeddings are saved once and still tied after loading.
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_a_half_written_version_is_never_picked_up(tmp_path):
    run = tmp_path / "run"
    with atomic_directory(weights_dir(run, 0)) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_directory(weights_dir(run, 1)) as tmp:
            (tmp / "config.json").write_text("{}")
            # The writer dies before the weights are complete.
            raise RuntimeError("crash while writing")
    assert not weights_dir(run, 1).exists()
    # A writer killed outright leaves its temporary directory behind; readers ignore it.
    (run / "weights" / ".tmp-v000002-123-abcd").mkdir()
    (run / "weights" / ".tmp-v000002-123-abcd" / "model.safetensors").write_bytes(b"x")
    assert published_versions(run) == [0]
    assert latest_version(run) == 0
    assert latest_version(run, at_most=5) == 0


def test_latest_version_respects_the_bound(tmp_path):
    run = tmp_path / "run"
    for v in (0, 1, 2, 3):
        weights_dir(run, v).mkdir(parents=True)
    assert latest_version(run) == 3
    assert latest_version(run, at_most=2) == 2
    assert latest_version(tmp_path / "empty") is None


def test_republishing_a_version_replaces_it(settings, tmp_path):
    trainer = GRPOTrainer(settings, tmp_path / "run")
    trainer.restore(0)
    trainer.train_step(0, make_groups(0, seed=2))
    trainer.publish(1)
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(1.0)
    trainer.publish(1)
    reloaded = load_model(weights_dir(tmp_path / "run", 1))
    assert torch.equal(reloaded.model.norm.weight, trainer.model.model.norm.weight)
    leftovers = [p.name for p in (tmp_path / "run" / "weights").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_loading_a_directory_without_weights_says_what_is_wrong(tmp_path):
    model = load_model(model_directory("builtin:tiny-arith"))
    with pytest.raises(FileNotFoundError, match="not a published weight version"):
        load_weights_into(model, tmp_path)
    assert not has_weights(tmp_path)


def test_loading_another_architecture_is_refused(settings, tmp_path):
    from safetensors.torch import save_file

    save_file({"something.else": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    model = load_model(model_directory("builtin:tiny-arith"))
    with pytest.raises(ValueError, match="another architecture"):
        load_weights_into(model, tmp_path)
