"""Trainer state on disk: optimizer, scheduler and RNG streams at a weight version.

The model itself is the published weight version (`weights/vNNNNNN`), so a checkpoint holds
only what is not already there. A checkpoint is written atomically like a weight version.
It is a local file the trainer wrote for itself, loaded with `weights_only=True` so it cannot
run code even if someone swaps it.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from refill.trainer.weights import atomic_directory, checkpoint_dir, checkpoint_versions

STATE_FILE = "trainer_state.pt"


def capture_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # As plain lists so the file loads under weights_only.
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the exact nested tuples random.getstate gave.
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value


def save(run_dir: Path, version: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as the checkpoint of `version` and drop all but the newest `keep`."""
    final = checkpoint_dir(run_dir, version)
    with atomic_directory(final) as tmp:
        torch.save(state, tmp / STATE_FILE)
    for old in checkpoint_versions(run_dir)[:-keep]:
        shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
    return final


def load(run_dir: Path, version: int) -> dict[str, Any]:
    path = checkpoint_dir(run_dir, version) / STATE_FILE
    if not path.is_file():
        have = checkpoint_versions(run_dir)
        raise FileNotFoundError(
            f"no trainer checkpoint for version {version} under {Path(run_dir) / 'checkpoints'}"
            f" (it holds {', '.join(map(str, have)) or 'none'}); resume from one of those, "
            "or from version 0 to start over"
        )
    return torch.load(path, map_location="cpu", weights_only=True)
