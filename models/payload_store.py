"""The payload store: where a generation worker leaves a group's rollout for the trainer.

The claim check (issue 17). A group of 16 completions of 8,192 tokens is 2 MB packed and
4 MB as JSON; through the broker, Redis held every in-flight result in memory and the consumer
decoded every token on its serial path, though its decisions read only the rewards. Now the
worker stores the packed group (`rollout_codec.pack_payload`: the rollout and its texts) here
and sends a `ClaimCheckResult` with its `PayloadRef` (name, size, checksum); the consumer
commits the reference; the trainer's claim reads the payload and verifies it.

The store is the run's directory, `<run_dir>/payloads/<bucket>/<attempt>.<nonce>.rfp`, shared
by every worker and the trainer as the weights already are. Why files and not the ledger
(measured, bench/README.md "Payloads beside the broker"): a 2 MB payload costs about the same
to write either way (7 ms), but the ledger is one server, which every byte of every rollout
would cross three times (written, WAL-logged, read by the trainer: 13 ms for a 2 MB row against
0.3 ms for the file) and which must also run every decision; a fleet of 200 groups a second
would push 400 MB/s through it. A discarded group (filtered, failed, refused) is an unlink
rather than a dead row for VACUUM. Files spread over the shared storage the fleet already has.

Nothing is lost and nothing left behind:

- the worker writes a payload whole (a temporary file, fsync, rename, the directory fsynced)
  before it sends the result, so a result never names a payload that is not there; the
  payloads a worker finishes together share one directory fsync (`FileStore.stage`, then
  `FileStore.publish` for the batch);
- the consumer commits a group with its reference, and removes the payloads of what it did
  not commit (filtered, failed, refused results) after its transaction committed
  (`Remover`): a consumer that dies mid-batch leaves them for the redelivered batch;
- what a crash leaves behind (a worker that died between storing and sending, a consumer that
  died between committing and removing) the controller sweeps (`PayloadKeeper`): a payload whose
  attempt can send no result any more and that no committed group holds;
- a finished run's payloads follow `infra.payloads.retention` (removed when the run ends) or
  go with `refill gc RUN` (`FileStore.measure`, `FileStore.remove_all`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from refill.config import RunConfig
from refill.drain import Drain
from refill.durable import fsync_dir
from refill.models import rollout_codec
from refill.models.db import Ledger
from refill.models.payload import (
    PAYLOAD_BUCKET,
    Completion,
    PayloadRef,
    payload_name,
    payload_name_problem,
)
from refill.models.tables import Attempt, AttemptState, Group, Run, RunStatus

log = logging.getLogger(__name__)

#: The store's directory under a run's directory.
PAYLOADS = "payloads"
_LIVE = tuple(state.value for state in AttemptState.live())
#: Ids per ledger query of a sweep.
_CHUNK = 1000
#: Threads that read a step's payloads (reads and sha256 release the GIL).
READ_THREADS = 8


class DamagedPayload(rollout_codec.RolloutFormatError):
    """A stored payload that is missing, or not what its worker wrote (size, checksum, layout)."""


@dataclass(frozen=True)
class Staged:
    """A payload written and fsynced under its temporary name (`FileStore.stage`), not yet in
    the store: `partial` goes to `final` in `FileStore.publish`."""

    partial: Path
    final: Path
    ref: PayloadRef


class FileStore:
    """One run's payloads, as files under `root` (`<run_dir>/payloads`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @classmethod
    def of_run(cls, run_dir: str | os.PathLike[str]) -> FileStore:
        return cls(Path(run_dir) / PAYLOADS)

    def path(self, name: str) -> Path:
        return self.root / name

    def put(self, attempt_id: int, payload: bytes) -> PayloadRef:
        """Store `payload` for `attempt_id` under a name no other write uses; returns once it is
        on disk (written, fsynced, renamed into place, the rename fsynced), so a result that
        names it never names a partial file."""
        return self.put_many([(attempt_id, payload)])[0]

    def put_many(self, payloads: Sequence[tuple[int, bytes]]) -> list[PayloadRef]:
        """`put` for several `(attempt_id, payload)`, in order, with one fsync per directory
        for all of them rather than one per payload (`stage` each, then `publish` them)."""
        staged = [self.stage(attempt_id, payload) for attempt_id, payload in payloads]
        self.publish(staged)
        return [s.ref for s in staged]

    def stage(self, attempt_id: int, payload: bytes) -> Staged:
        """The first half of `put`: `payload` written and fsynced under a temporary name. It is
        not in the store until `publish`; what a crash leaves staged, the sweep removes."""
        name = payload_name(attempt_id, secrets.token_hex(8))
        final = self.path(name)
        final.parent.mkdir(parents=True, exist_ok=True)
        # A leading dot: the sweep tells a write in progress (or a crashed one) by it.
        partial = final.with_name("." + final.name + ".tmp")
        with open(partial, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        return Staged(partial, final, PayloadRef(name, len(payload), rollout_codec.checksum(payload)))

    def publish(self, staged: Iterable[Staged]) -> None:
        """The second half of `put`: rename each staged payload into place, then fsync each
        directory they went to once. A result may name them only after this returned."""
        directories: dict[Path, None] = {}
        for one in staged:
            os.replace(one.partial, one.final)
            directories[one.final.parent] = None
        # A directory's fsync makes every rename into it before the call durable: one for the
        # whole batch. An fsync costs a journal commit (about 3 ms here, bench/README.md), which
        # per payload capped a worker's rate of results.
        for directory in directories:
            fsync_dir(directory)

    def read(self, ref: PayloadRef) -> bytes:
        """The payload as its worker wrote it; DamagedPayload (saying what differs) if it is
        missing or its size or checksum is not the recorded one."""
        try:
            with open(self.path(ref.name), "rb") as fh:
                payload = fh.read()
        except FileNotFoundError as error:
            raise DamagedPayload(f"{self.path(ref.name)} is missing") from error
        if len(payload) != ref.size:
            raise DamagedPayload(f"{self.path(ref.name)} has {len(payload)} bytes, its worker wrote {ref.size}")
        found = rollout_codec.checksum(payload)
        if found != ref.checksum:
            raise DamagedPayload(f"{self.path(ref.name)} has checksum {found}, its worker wrote {ref.checksum}")
        return payload

    def remove(self, names: Iterable[str]) -> int:
        """Remove these payloads (those already gone are skipped); how many were removed."""
        removed = 0
        for name in names:
            try:
                self.path(name).unlink()
                removed += 1
            except FileNotFoundError:
                continue
        return removed

    def listing(self, skip_buckets: Collection[int] = ()) -> Iterator[tuple[int, str]]:
        """`(bucket, name)` of every file in the store, writes in progress (their name with a
        leading dot) included, buckets in `skip_buckets` left out."""
        try:
            buckets = [entry for entry in os.scandir(self.root) if entry.is_dir() and entry.name.isdigit()]
        except FileNotFoundError:
            return
        for bucket in buckets:
            number = int(bucket.name)
            if number in skip_buckets:
                continue
            try:
                entries = list(os.scandir(bucket.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_file():
                    yield number, f"{bucket.name}/{entry.name}"

    def measure(self) -> tuple[int, int]:
        """`(files, bytes)` the store holds."""
        files = size = 0
        for _, name in self.listing():
            try:
                size += self.path(name).stat().st_size
            except FileNotFoundError:
                continue
            files += 1
        return files, size

    def remove_all(self) -> int:
        """Remove the whole store; how many files it held."""
        count = sum(1 for _ in self.listing())
        if self.root.exists():
            shutil.rmtree(self.root)
        return count


def store_for(config: RunConfig, run_dir: str) -> FileStore | None:
    """The run's payload store, or None when its results carry their groups inline."""
    if config.infra.payloads.store == "inline":
        return None
    return FileStore.of_run(run_dir)


def stored_attempt(name: str) -> int | None:
    """The attempt a stored file belongs to (a write in progress included), or None for a file
    the store did not write."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith(".") and base.endswith(".tmp"):
        name = name[: len(name) - len(base)] + base[1:-4]
    try:
        attempt_id = int(name.rsplit("/", 1)[-1].split(".", 1)[0])
    except ValueError:
        return None
    return attempt_id if payload_name_problem(name, attempt_id) is None else None


# --- the trainer's read -------------------------------------------------------------------


@dataclass(frozen=True)
class StoredGroup:
    """A committed group's payload as the trainer's claim finds it in the ledger."""

    attempt_id: int
    ref: PayloadRef
    group_size: int
    num_tokens: int


def read_groups(
    store: FileStore, groups: list[StoredGroup], where: str
) -> list[tuple[Sequence[int], list[Completion]]]:
    """`(prompt_token_ids, completions)` of each group (numpy arrays, as `TrainGroup` holds
    them), read and verified (size, checksum, layout, and the group's size and token count as
    committed), in order. A damaged payload
    raises DamagedPayload naming `where` (the run and step) and the group."""

    def one(group: StoredGroup) -> tuple[Sequence[int], list[Completion]]:
        try:
            prompt, completions = rollout_codec.unpack_payload(store.read(group.ref), arrays=True)
        except rollout_codec.RolloutFormatError as error:
            raise DamagedPayload(f"{where}: the payload of group {group.attempt_id} is damaged: {error}") from error
        tokens = sum(len(c.token_ids) for c in completions)
        if len(completions) != group.group_size or tokens != group.num_tokens:
            raise DamagedPayload(
                f"{where}: the payload of group {group.attempt_id} ({store.path(group.ref.name)}) holds "
                f"{len(completions)} completions of {tokens} tokens, the ledger committed "
                f"{group.group_size} of {group.num_tokens}"
            )
        return prompt, completions

    if len(groups) <= 1:
        return [one(g) for g in groups]
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(groups)), thread_name_prefix="payload-read") as pool:
        return list(pool.map(one, groups))


# --- what nothing will read ---------------------------------------------------------------


def unclaimed(session: Session, run_id: int, names: dict[str, int]) -> tuple[list[str], set[str]]:
    """`(unclaimed, held)` of the names among `names` (name -> attempt id). Nothing will ever
    read an unclaimed one: no committed group holds it, and its attempt can send no result any
    more (it finished, or this ledger never dispatched it). A committed group holds each held
    one. The rest belong to attempts still in flight: their results may be on the way.

    An attempt leaves the live states only by the transaction that records its result or
    fails it, and a payload only becomes a group's in that same transaction; so a name judged
    here unclaimed can never be committed later."""
    ids = sorted(set(names.values()))
    states: dict[int, str] = {}
    held: set[str] = set()
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        states.update(
            session.execute(select(Attempt.id, Attempt.state).where(Attempt.run_id == run_id, Attempt.id.in_(chunk))).all()
        )
        held.update(
            session.scalars(
                select(Group.payload_ref).where(
                    Group.run_id == run_id, Group.attempt_id.in_(chunk), Group.payload_ref.is_not(None)
                )
            )
        )
    doomed = [name for name, attempt in names.items() if name not in held and states.get(attempt) not in _LIVE]
    return doomed, held & names.keys()


def lowest_live_attempt(session: Session, run_id: int) -> int:
    """The smallest id a payload of this run can still arrive for: its lowest live attempt, or
    past its newest attempt when none is live."""
    low = session.scalar(select(func.min(Attempt.id)).where(Attempt.run_id == run_id, Attempt.state.in_(_LIVE)))
    if low is not None:
        return int(low)
    newest = session.scalar(select(func.max(Attempt.id)).where(Attempt.run_id == run_id))
    return int(newest or 0) + 1


class PayloadKeeper:
    """The controller's part: sweep what no committed group holds every
    `infra.payloads.sweep_interval_seconds`, and apply the run's retention once it ended."""

    def __init__(self, ledger: Ledger, run_id: int, store: FileStore, interval: float, retention: str) -> None:
        self.ledger = ledger
        self.run_id = run_id
        self.store = store
        self.interval = interval
        self.retention = retention
        self._last = time.monotonic()
        # Buckets a sweep went through after every attempt of theirs had finished: nothing
        # stores there any more (but a worker whose lease expired and that stores anyway: the
        # next `refill gc` or the retention takes its file).
        self._closed: set[int] = set()
        # Payloads seen held by a committed group (kept for the trainer), not looked up again.
        self._held: set[str] = set()
        self._retired = False

    @classmethod
    def for_run(cls, ledger: Ledger, run: Run, config: RunConfig) -> PayloadKeeper | None:
        store = store_for(config, run.run_dir)
        if store is None:
            return None
        payloads = config.infra.payloads
        return cls(ledger, run.id, store, payloads.sweep_interval_seconds, payloads.retention)

    def after_housekeeping(self, status: str) -> None:
        """Called with the run's status after each of the controller's housekeeping passes."""
        try:
            if status == RunStatus.RUNNING.value:
                if time.monotonic() - self._last >= self.interval:
                    self._last = time.monotonic()
                    self.sweep()
            elif status in (RunStatus.COMPLETED.value, RunStatus.FAILED.value) and not self._retired:
                self._retired = True
                if self.retention == "delete":
                    removed = self.store.remove_all()
                    log.info("run %s %s: its %d payloads removed (infra.payloads.retention: delete)", self.run_id, status, removed)
                else:
                    self.sweep()
        except OSError as error:
            # The shared storage hiccuped: the run goes on, the next pass sweeps again.
            log.warning("run %s: sweeping payloads failed: %r", self.run_id, error)

    def sweep(self) -> int:
        """Remove the payloads nothing will read; how many were removed."""
        low = self.ledger.transaction(lambda s: lowest_live_attempt(s, self.run_id), what="payload sweep")
        listed: dict[str, int] = {}
        buckets: set[int] = set()
        for bucket, name in self.store.listing(self._closed):
            buckets.add(bucket)
            attempt = stored_attempt(name)
            if attempt is not None and name not in self._held:
                listed[name] = attempt
        doomed, held = self.ledger.transaction(lambda s: unclaimed(s, self.run_id, listed), what="payload sweep")
        self._held.update(held)
        removed = self.store.remove(doomed)
        # Only now: a bucket is closed once a sweep that began after its last attempt finished
        # went through it.
        self._closed.update(b for b in buckets if (b + 1) * PAYLOAD_BUCKET <= low)
        self._held = {name for name in self._held if int(name.split("/", 1)[0]) not in self._closed}
        if removed:
            log.info("run %s: %d payloads no committed group holds removed", self.run_id, removed)
        return removed


def missing_payloads(session: Session, run: Run) -> list[tuple[int, str, str]]:
    """`(attempt id, path, problem)` of each committed, untrained group whose payload is not in
    the run's store as committed (missing, or another size). For `refill check`: reads the
    store's directory, not the payloads (sizes, not checksums)."""
    store = FileStore.of_run(run.run_dir)
    rows = session.execute(
        select(Group.attempt_id, Group.payload_ref, Group.payload_bytes).where(
            Group.run_id == run.id, Group.trained_step.is_(None), Group.payload_ref.is_not(None)
        )
    ).all()
    problems = []
    for attempt_id, name, size in rows:
        path = store.path(name)
        try:
            found = path.stat().st_size
        except FileNotFoundError:
            problems.append((attempt_id, str(path), "is missing"))
            continue
        if found != size:
            problems.append((attempt_id, str(path), f"has {found} bytes, its worker wrote {size}"))
    return problems


class Remover:
    """Removes discarded payloads on a thread of its own (`refill.drain`), after the commit
    that discarded them, so that unlinking files never delays the consumer's next batch. What
    it has not removed when the process dies, the controller's sweep does."""

    def __init__(self) -> None:
        self.removed = 0
        self._drain: Drain[tuple[FileStore, list[str]]] = Drain(self._remove, name="payload-remover")

    def submit(self, store: FileStore, names: list[str]) -> None:
        if names:
            self._drain.submit([(store, names)])

    def _remove(self, work: list[tuple[FileStore, list[str]]]) -> None:
        for store, names in work:
            try:
                self.removed += store.remove(names)
            except OSError as error:
                log.warning("removing %d discarded payloads failed (%r); the controller's sweep will", len(names), error)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until what was submitted so far is removed; False if that took over `timeout`."""
        return self._drain.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self._drain.close(timeout)
