"""Where weight versions live on disk and how they are written atomically.

Version `v` of a run is the directory `{run_dir}/weights/v{v:06d}/`, a Hugging Face model
directory (`config.json`, `model.safetensors` or its shards, tokenizer files). It is built
under a dot-prefixed temporary name beside it and renamed into place in one step, so a
reader that lists `v??????` directories sees a version whole or not at all.

The path helpers import nothing heavy, so the controller and the ledger side can use them.
Reading a version back (`has_weights`, `load_weights_into`) is `refill.model_loading`'s job,
shared with the generation back-ends, which must not need the trainer's package.
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

from refill.durable import fsync_dir
from refill.model_loading import quiet_transformers

WEIGHTS = "weights"
CHECKPOINTS = "checkpoints"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


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
    fsync_dir(root)


def temporary_directory(final: Path) -> Path:
    """A new empty directory beside `final`, dot-prefixed so no reader lists it as a version;
    `commit_directory` turns it into `final`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def commit_directory(tmp: Path, final: Path) -> None:
    """Make the filled `tmp` the directory `final` in one rename, after syncing it to disk. An
    existing `final` is replaced; readers then briefly see no directory, never a mixed one."""
    _fsync_tree(tmp)
    if final.exists():
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; on success it becomes `final` in one rename.

    An existing `final` is replaced (a trainer that crashed after publishing and retrains the
    same step writes the same version again); readers then briefly see no directory, never a
    mixed one. On error the temporary directory is removed and `final` is left as it was.
    """
    final = Path(final)
    tmp = temporary_directory(final)
    try:
        yield tmp
        commit_directory(tmp, final)
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


def save_model_dir(
    model: Any, tokenizer: Any, target: Path, state_dict: dict[str, Any] | None = None
) -> None:
    """Write `model` (its weights, or `state_dict` in their place: a sharded model's gathered
    weights) and `tokenizer` as a Hugging Face model directory into `target`."""
    with quiet_transformers():
        model.save_pretrained(str(target), state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(target))
