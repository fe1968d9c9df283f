"""Where weight versions live on disk, how they are written atomically, and how they are loaded.

Version `v` of a run is the directory `{run_dir}/weights/v{v:06d}/`, a Hugging Face model
directory (`config.json`, `model.safetensors` or its shards, tokenizer files). It is built
under a dot-prefixed temporary name beside it and renamed into place in one step, so a
reader that lists `v??????` directories sees a version whole or not at all.

The path helpers import nothing heavy, so the controller and the ledger side can use them;
torch and safetensors are imported only by the functions that move tensors.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WEIGHTS = "weights"
CHECKPOINTS = "checkpoints"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
#: The file every published version has; its absence means "not a model directory".
CONFIG_FILE = "config.json"


def version_name(version: int) -> str:
    if version < 0:
        raise ValueError(f"weight versions start at 0, not {version}")
    return f"v{version:06d}"


def weights_dir(run_dir: str | os.PathLike[str], version: int) -> Path:
    """The directory that holds (or will hold) weight version `version` of a run."""
    return Path(run_dir) / WEIGHTS / version_name(version)


def checkpoint_dir(run_dir: str | os.PathLike[str], version: int) -> Path:
    """The directory of the trainer state (optimizer, scheduler, RNG) at `version`."""
    return Path(run_dir) / CHECKPOINTS / version_name(version)


def _versions_under(parent: Path) -> list[int]:
    if not parent.is_dir():
        return []
    found = []
    for entry in parent.iterdir():
        match = _VERSION_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def published_versions(run_dir: str | os.PathLike[str]) -> list[int]:
    """Every weight version of the run on disk, ascending (only whole ones can be there)."""
    return _versions_under(Path(run_dir) / WEIGHTS)


def checkpoint_versions(run_dir: str | os.PathLike[str]) -> list[int]:
    return _versions_under(Path(run_dir) / CHECKPOINTS)


def latest_version(run_dir: str | os.PathLike[str], at_most: int | None = None) -> int | None:
    """The newest published version, or the newest not above `at_most`; None if there is none."""
    versions = [v for v in published_versions(run_dir) if at_most is None or v <= at_most]
    return versions[-1] if versions else None


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; on success it becomes `final` in one rename.

    An existing `final` is replaced (a trainer that crashed after publishing and retrains the
    same step writes the same version again); readers then briefly see no directory, never a
    mixed one. On error the temporary directory is removed and `final` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tree_atomic(source: Path, final: Path) -> Path:
    """Copy a directory to `final` atomically, hard-linking files where the filesystem allows.

    Published files are never modified in place (a new version is a new directory), so
    sharing their inodes between a cache and a run is safe and saves a copy of the weights.
    """
    with atomic_directory(final) as tmp:
        for entry in Path(source).iterdir():
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
                continue
            try:
                os.link(entry, tmp / entry.name)
            except OSError:
                shutil.copy2(entry, tmp / entry.name)
    return final


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


def save_model_dir(model: Any, tokenizer: Any, target: Path) -> None:
    """Write `model` and `tokenizer` as a Hugging Face model directory into `target`."""
    with quiet_transformers():
        model.save_pretrained(str(target), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(target))


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

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
