"""Trainer state on disk: the model, optimizer, scheduler and RNG streams at a weight version,
for an exact resume at any number of ranks.

`checkpoints/vNNNNNN/` holds the tensors as a `torch.distributed.checkpoint` (DCP) directory:
every rank writes its own shards of the model's master weights and of the optimizer state,
keyed by parameter name, so a checkpoint written by N ranks loads into M ranks, or into a
trainer of one process, each reading the slices it needs. Beside them `trainer_state.json`
holds what is not a tensor (the version, the optimizer's hyperparameters, the scheduler, the
RNG states), written by rank 0. The published weights (`weights/vNNNNNN`) are a copy for the
generators in `model.dtype`; the checkpoint keeps the master weights, which under mixed
precision are finer, so a resume continues exactly where the trainer was.

A checkpoint is written into a temporary directory and renamed into place, as a weight version
is (every rank must see the same run directory: a shared filesystem across machines). Nothing
in it is unpickled but DCP's own metadata, read with an unpickler that accepts only DCP's
metadata classes, so a swapped checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import random
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from refill.trainer.distributed import World, agreed
from refill.trainer.weights import (
    checkpoint_dir,
    checkpoint_versions,
    commit_directory,
    temporary_directory,
)

STATE_FILE = "trainer_state.json"
#: A checkpoint written before DCP (format 1): optimizer (by parameter position), scheduler and
#: RNG, torch.save'd; the model was the published version alone.
LEGACY_FILE = "trainer_state.pt"
#: DCP's metadata file in a checkpoint directory (torch's `_metadata_fn`).
METADATA_FILE = ".metadata"
FORMAT = 2


def capture_rng() -> dict[str, Any]:
    """The RNG streams as plain JSON data."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(_byte_tensor(state["torch"]))
    random.setstate(_as_tuples(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


def _byte_tensor(value: Any) -> torch.Tensor:
    # A list of bytes from JSON, or the tensor itself from a format-1 checkpoint.
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=torch.uint8)


def _as_tuples(value: Any) -> Any:
    # random.setstate wants the exact nested tuples random.getstate gave.
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value


def save(
    run_dir: Path,
    version: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rng: dict[str, Any],
    keep: int,
    world: World | None = None,
) -> Path:
    """Write the checkpoint of `version` and drop all but the newest `keep`. With a `world`,
    every rank calls this together."""
    final = checkpoint_dir(run_dir, version)
    leader = world is None or world.leader
    tmp: Any = None
    if leader:
        try:
            tmp = temporary_directory(final)
        except OSError as error:
            tmp = error
    if world is not None:
        tmp = world.broadcast(tmp)  # every rank writes its shards there
    if isinstance(tmp, OSError):
        raise agreed(tmp)
    tensors: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer.state:
        state = get_optimizer_state_dict(model, optimizer)
        tensors["optimizer"] = state["state"]
        groups = state["param_groups"]
    else:
        # Nothing to shard yet (no update since the start); DSD would take a step to make some.
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    with _single_process(world), _as_error(f"saving checkpoint v{version}"):
        dcp.save(
            tensors,
            checkpoint_id=str(tmp),
            process_group=world.control if world else None,
            no_dist=world is None,
        )
    error: BaseException | None = None
    if leader:
        try:
            meta = {
                "format": FORMAT,
                "version": version,
                "ranks": world.size if world else 1,
                "optimizer_state": "optimizer" in tensors,
                "param_groups": groups,
                "scheduler": scheduler.state_dict(),
                "rng": rng,
            }
            (tmp / STATE_FILE).write_text(json.dumps(meta))
            commit_directory(tmp, final)
            for old in checkpoint_versions(run_dir)[:-keep]:
                shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
        except Exception as caught:  # noqa: BLE001 - every rank raises it below (World.agree)
            shutil.rmtree(tmp, ignore_errors=True)
            error = caught
    if world is not None:
        world.agree(error, f"saving checkpoint v{version}")
    elif error is not None:
        raise error
    return final


@contextlib.contextmanager
def _single_process(world: World | None) -> Iterator[None]:
    # DCP warns that it "assumes" one process even when told so (no_dist); it is meant.
    with warnings.catch_warnings():
        if world is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _as_error(what: str) -> Iterator[None]:
    """DCP's failures as an ordinary exception (DCP raises a BaseException, which nothing
    short of the process would catch), naming each rank's cause. DCP raises it on every rank
    alike, having gathered every rank's outcome."""
    try:
        yield
    except CheckpointException as error:
        causes = "; ".join(
            f"rank {rank}: {type(cause).__name__}: {cause}"
            for rank, (cause, _trace) in sorted(error.failures.items())
        )
        raise agreed(RuntimeError(f"{what} failed: {causes}")) from None


def exists(run_dir: Path, version: int) -> bool:
    path = checkpoint_dir(run_dir, version)
    return (path / STATE_FILE).is_file() or (path / LEGACY_FILE).is_file()


def missing(run_dir: Path, version: int) -> FileNotFoundError:
    have = checkpoint_versions(run_dir)
    return FileNotFoundError(
        f"no trainer checkpoint for version {version} under {Path(run_dir) / 'checkpoints'}"
        f" (it holds {', '.join(map(str, have)) or 'none'}); resume from one of those, "
        "or from version 0 to start over"
    )


def load(
    run_dir: Path,
    version: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    world: World | None = None,
) -> dict[str, Any]:
    """Load the checkpoint of `version` into the model, optimizer and scheduler (whatever number
    of ranks wrote it); returns its non-tensor state (`rng` for `restore_rng`). With a `world`,
    every rank calls this together."""
    path = checkpoint_dir(run_dir, version)
    # Every rank reads the same files: what they find wrong, they all find alike.
    if not exists(run_dir, version):
        raise agreed(missing(run_dir, version))
    if not (path / STATE_FILE).is_file():
        return _load_legacy(path / LEGACY_FILE, version, model, optimizer, scheduler)
    meta = json.loads((path / STATE_FILE).read_text())
    if meta.get("format") != FORMAT or meta.get("version") != version:
        raise agreed(
            ValueError(
                f"{path} holds format {meta.get('format')} version {meta.get('version')}, not "
                f"format {FORMAT} version {version}: the checkpoint directory was renamed, "
                "mixed up, or written by another refill"
            )
        )
    tensors: dict[str, Any] = {"model": get_model_state_dict(model)}
    if meta["optimizer_state"]:
        # Makes the state (a step at lr 0 on zero gradients) so that DCP has tensors to fill.
        tensors["optimizer"] = get_optimizer_state_dict(model, optimizer)["state"]
    with _single_process(world), _as_error(f"loading checkpoint {path}"):
        dcp.load(
            tensors,
            storage_reader=_SafeReader(str(path)),
            process_group=world.control if world else None,
            no_dist=world is None,
        )
    set_model_state_dict(model, tensors["model"])
    groups = [_tuples_back(g) for g in meta["param_groups"]]
    if meta["optimizer_state"]:
        set_optimizer_state_dict(
            model, optimizer, {"state": tensors["optimizer"], "param_groups": groups}
        )
    else:
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved)
    scheduler.load_state_dict(meta["scheduler"])
    return meta


def _load_legacy(
    file: Path, version: int, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """A format-1 checkpoint, so that a run checkpointed before DCP resumes: the model is the
    published version (`restore` loaded it), the optimizer state is taken whole by every rank
    and sharded as the model is."""
    state = torch.load(file, map_location="cpu", weights_only=True)
    if state.get("version") != version:
        raise agreed(
            ValueError(
                f"checkpoint v{version:06d} says it holds version {state.get('version')}; "
                "the checkpoint directory was renamed or mixed up"
            )
        )
    saved = state["optimizer"]
    # The old optimizer took the trainable parameters in model order: position i is a name.
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]
    if saved["state"]:
        set_optimizer_state_dict(
            model,
            optimizer,
            {"state": {names[i]: s for i, s in saved["state"].items()}, "param_groups": groups},
            options=StateDictOptions(full_state_dict=True),
        )
    else:
        for group, old in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in old.items() if k != "params"})
    scheduler.load_state_dict(state["scheduler"])
    return {"format": 1, "version": version, "rng": state["rng"]}


def _tuples_back(group: dict[str, Any]) -> dict[str, Any]:
    # JSON has no tuples; the optimizers keep betas as one.
    return {k: tuple(v) if k == "betas" else v for k, v in group.items()}


#: What DCP's metadata pickles name besides its own classes (all inert: no call runs code).
_METADATA_GLOBALS = {
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts DCP's metadata classes, torch.Size and dtypes, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            found = getattr(torch, name, None)
            if name == "Size" or isinstance(found, torch.dtype):
                return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"a checkpoint's metadata names {module}.{name}, which no refill checkpoint holds; "
            "refusing to load it"
        )


class _SafeReader(FileSystemReader):
    """DCP's file reader, its metadata read with `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        data = (Path(self.path) / name).read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
