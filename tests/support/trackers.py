"""Reading back what the experiment trackers wrote, from their files, with no server.

- TensorBoard: tensorboard's EventAccumulator (which drops the steps a restart marked as
  orphaned, as TensorBoard does).
- W&B: an offline run's `run-<id>.wandb` file. wandb 0.31 ships no reader of its own (the
  `wandb.sdk.internal.datastore` of earlier versions is gone), so this reads the format: a 7-byte
  header (":W&B", a 2-byte magic, a version byte), then LevelDB's log format (32 KiB blocks of
  records: crc32c (4 bytes), length (2, little-endian), type (1: full, 2: first, 3: middle,
  4: last)), each record a `wandb_internal_pb2.Record`.
- MLflow: its file store, through MlflowClient.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

WANDB_HEADER = 7
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


# --- TensorBoard -------------------------------------------------------------------------------


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def tensorboard_text(logdir: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [b"".join(e.tensor_proto.string_val).decode() for e in accumulator.Tensors(tag)]


# --- W&B ---------------------------------------------------------------------------------------


def _wandb_payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    offset, pending = WANDB_HEADER, b""
    while offset + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < RECORD_HEADER:  # a block's tail too short for a header is padding
            offset += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        if length == 0 and kind == 0:  # zero padding (a file still being written)
            break
        chunk = data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            raise AssertionError(f"{path}: record type {kind} at {offset}")


def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    for payload in _wandb_payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def wandb_run_files(wandb_dir: Path) -> list[Path]:
    """Every offline run file under WANDB_DIR, oldest first (one per opening of the run)."""
    return sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def wandb_history(files: list[Path]) -> list[dict[str, Any]]:
    """The history rows (`run.log` calls) of a run's files, in order, values decoded."""
    rows = []
    for path in files:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
    return rows


def wandb_config(files: list[Path]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            # The config given to wandb.init is in the run record; later changes are config records.
            updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
            for item in updates:
                config[_key(item)] = json.loads(item.value_json)
    return config


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


# --- MLflow ------------------------------------------------------------------------------------


def mlflow_run(tracking_uri: str, experiment: str) -> tuple[Any, Any]:
    """(client, the one run of `experiment`)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]
