"""Loading a causal LM, its tokenizer and a published weight version from local directories.

The trainer and the generation back-ends both read models through this module, so that they
read a model directory the same way, and a generation worker needs nothing of the trainer's
package. Nothing is ever fetched from a hub.

A directory with weights loads as a pretrained model. A directory with only a `config.json`
(the shipped `builtin:tiny-arith`) builds a model from that config with a fixed seed, so the
same config and seed always give the same initial weights. A published weight version (see
`refill.trainer.weights` for where versions live and how they are written) is a Hugging Face
model directory whose safetensors are copied into an existing model by `load_weights_into`.

torch, transformers and safetensors are imported by the functions that need them, so the
trainer's path helpers can import `CONFIG_FILE` without loading them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refill.assets import resolve_model_path

if TYPE_CHECKING:
    import torch

#: The file every model directory (and so every published version) has; its absence means
#: "not a model directory".
CONFIG_FILE = "config.json"
DTYPE_NAMES = ("float32", "bfloat16", "float16")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' per-call progress bars ("Loading weights", "Writing model
    shards"): a trainer publishes every step, and a bar per publish would bury the demo's own
    progress display."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def torch_dtype(name: str) -> torch.dtype | str:
    """The torch dtype for a `model.dtype` value ("auto" keeps the checkpoint's own)."""
    if name == "auto":
        return "auto"
    if name not in DTYPE_NAMES:
        raise ValueError(
            f"model.dtype={name!r} is not supported; use one of {', '.join([*DTYPE_NAMES, 'auto'])}"
        )
    import torch

    return getattr(torch, name)


def model_directory(name_or_path: str) -> Path:
    """The local directory of `model.name_or_path` (`builtin:NAME` or a path), checked."""
    path = Path(resolve_model_path(name_or_path)).expanduser()
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"model.name_or_path={name_or_path!r} resolves to {path}, which has no "
            f"{CONFIG_FILE}; point it at a local Hugging Face model directory (refill never "
            "downloads from a hub) or use builtin:tiny-arith"
        )
    return path


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token_id is None:
        # Padding positions are masked out everywhere; any id works, eos is always there.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | os.PathLike[str], dtype: str = "float32", seed: int = 0) -> Any:
    """The causal LM in `path`: pretrained if it has weights, else seeded random init."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if has_weights(path):
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype(dtype), local_files_only=True
            )
    else:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        resolved = torch_dtype(dtype)
        if resolved != "auto":
            model = model.to(resolved)
    return model


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    return []


def has_weights(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a model directory with safetensors weights (not only a config)."""
    return bool(_weight_files(Path(path)))


def load_weights_into(model: Any, path: str | os.PathLike[str]) -> None:
    """Load the safetensors weights of the model directory `path` into `model`, in place.

    Every parameter and buffer of `model` must be covered, except the names that share their
    tensor with a loaded one (tied embeddings are saved once). Values are copied into the
    existing tensors, converting dtype, so an engine keeps its device placement and any
    references to its parameters.
    """
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    files = _weight_files(path)
    if not files:
        raise FileNotFoundError(
            f"{path} holds no model.safetensors (nor a shard index): it is not a published "
            "weight version; use weights_dir(run_dir, version) of a version that "
            "published_versions(run_dir) lists"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(
            f"{path} has tensors the model does not: {unexpected[:5]}"
            f"{' …' if len(unexpected) > 5 else ''}; is it a version of another architecture?"
        )
    loaded_storage = {own[name].data_ptr() for name in state}
    missing = [
        name for name in own if name not in state and own[name].data_ptr() not in loaded_storage
    ]
    if missing:
        raise ValueError(
            f"{path} lacks tensors the model needs: {missing[:5]}{' …' if len(missing) > 5 else ''}"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            target = own[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, the model "
                    f"{tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
