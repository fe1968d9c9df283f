"""Loading a causal LM and its tokenizer from a local directory, never from a hub.

A directory with weights loads as a pretrained model. A directory with only a `config.json`
(the shipped `builtin:tiny-arith`) builds a model from that config with a fixed seed, so the
same config and seed always give the same initial weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from refill.assets import resolve_model_path
from refill.trainer.weights import CONFIG_FILE, has_weights, quiet_transformers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype | str:
    """The torch dtype for a `model.dtype` value ("auto" keeps the checkpoint's own)."""
    if name == "auto":
        return "auto"
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"model.dtype={name!r} is not supported; use one of {', '.join([*_DTYPES, 'auto'])}"
        ) from None


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


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
