"""What a generation worker does with the attempts of a generate message: lease, generate,
score, report.

No Celery here: the `refill.generate` task hands the decoded message (one attempt, or a bundle
of a run's attempts) to `GenerationService.run_all`, and the results go back through the
`send_results` callable. A bundle goes through each stage as one batch.

A worker process has one engine (built from the run's config the first time the run is
seen), fronted by a `BatchingEngine` so that the many task threads of a `threads` pool feed it
batches. A `LeaseKeeper` thread extends the leases of every attempt in flight in one
statement per heartbeat.

A finished group goes to the run's payload store (`infra.payloads.store: files`, the claim
check): the worker checks its token ids and log-probs (here, where they are cheapest to check:
the consumer's path is serial), packs and stores it, and sends a `ClaimCheckResult` of a few
hundred bytes (`claim_checks.py`). With `inline` the group travels in the result message (body version 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select

from refill.config import RunConfig, from_snapshot
from refill.microbatcher import MicroBatcher
from refill.models.db import Ledger
from refill.models.leases import Lease, extend_leases, start_attempts, startable
from refill.models.payload import (
    ClaimCheckResult,
    GenerateMessage,
    ResultMessage,
    estimated_result_bytes,
)
from refill.models.payload_store import FileStore, Staged, store_for
from refill.models.settings import LedgerSettings
from refill.models.tables import Run
from refill.models.training import newest_weights
from refill.rewards.loader import load_reward_fn
from refill.rewards.scoring import RewardError, score_group
from refill.tasks.backends import make_engine
from refill.tasks.backends.base import GenerationOutput
from refill.tasks.backends.engine_batching import BatchingEngine
from refill.tasks.chaos import WorkerChaos
from refill.tasks.claim_checks import not_stored, oversized_error, publish_batch, stage_claim_check

log = logging.getLogger(__name__)

#: Seconds a worker reuses its answer to "which weights are newest" (see _newest_weights).
WEIGHTS_TTL = 0.05


@dataclass
class _RunEngine:
    run_id: int
    config: RunConfig
    engine: BatchingEngine
    reward_fn: Callable[..., float]
    heartbeat_seconds: float
    max_result_bytes: int
    lease_seconds: float
    #: the run's payload store; None when results carry their groups inline
    store: FileStore | None
    settings: LedgerSettings


class GenerationService:
    def __init__(
        self,
        ledger: Ledger,
        *,
        send_results: Callable[[list[dict[str, Any]]], None],
        worker: str,
        engine_factory: Callable[..., Any] = make_engine,
    ) -> None:
        self.ledger = ledger
        self.send_results = send_results
        self.worker = worker
        self.engine_factory = engine_factory
        self.leases = LeaseKeeper(ledger, worker)
        self._chaos = WorkerChaos()  # inert unless the fault suite sets its knob
        self._lock = threading.Lock()
        self._current: _RunEngine | None = None
        # Engines of other runs kept loaded (sim only: see _set_aside), by run.
        self._set_aside_engines: dict[int, _RunEngine] = {}
        self._lease_seconds: dict[int, float] = {}
        self._lease_lock = threading.Lock()
        # No wait for company: a handshake goes at once, and those that arrive while one
        # transaction runs share the next (group commit, as the consumer's).
        self._handshakes: MicroBatcher[tuple[int, int, float, int | None], Lease | None] = MicroBatcher(
            self._take_leases, max_batch=64, max_wait_ms=0.0, name="lease-handshakes"
        )
        # Payloads written by the attempts that finish together (a bundle's, from one engine
        # batch) go into place in one batch, with one directory fsync for all of them; as the
        # handshakes, the first goes at once and those staged meanwhile share the next.
        self._publishes: MicroBatcher[tuple[FileStore, Staged], None] = MicroBatcher(
            publish_batch, max_batch=1024, max_wait_ms=0.0, name="payload-publish"
        )
        self._weights: dict[int, tuple[float, tuple[int, str | None] | None]] = {}

    # --- a bundle of attempts --------------------------------------------------------------

    def run_all(self, messages: list[GenerateMessage]) -> str:
        """Run the attempts of one message (a bundle the relay sent together, or one) as a
        batch: their lease handshakes in one submission, their groups in one engine
        submission, their payloads published together and their results sent together.
        Returns once every result is on the broker, so the message is acknowledged only
        after each was sent. An error is raised after the other runs' attempts finished.

        The calling thread hands the bundle to each batcher once and is woken once per
        stage, where a thread per attempt paid a hand-over and a wake-up per attempt and
        stage (bench/HISTORY.md, stop 33)."""
        leases = self._lease(messages)
        outcomes: Counter[str] = Counter()
        by_run: dict[int, list[tuple[GenerateMessage, Lease]]] = {}
        for message, lease in zip(messages, leases, strict=True):
            if lease is None:
                # A repeat of a message whose attempt another worker holds or that is settled,
                # or one for an attempt this ledger never dispatched.
                log.info("attempt %s is not ours to run; skipped", message.attempt_id)
                outcomes["skipped"] += 1
            else:
                by_run.setdefault(message.run_id, []).append((message, lease))
        first_error: Exception | None = None
        # The relay bundles one run's attempts; a message of several runs is run run by run.
        for taken in by_run.values():
            try:
                results = self._run_leased(taken)
            except Exception as error:  # noqa: BLE001 - raised below, once the other runs' attempts ran
                first_error = first_error or error
                continue
            outcomes.update(result.error_kind or "generated" for result in results)
        if first_error is not None:
            raise first_error
        if len(messages) == 1:
            return next(iter(outcomes))
        return ", ".join(f"{outcome} x{n}" for outcome, n in sorted(outcomes.items()))

    def run(self, message: GenerateMessage) -> str:
        """One attempt: `run_all` of a bundle of one."""
        return self.run_all([message])

    def _lease(self, messages: list[GenerateMessage]) -> list[Lease | None]:
        """Each message's lease, or None where it is not this worker's to run. The handshakes
        of attempts arriving together (this bundle's and other task threads') share one
        transaction."""
        requests: list[tuple[int, int, float, int | None]] = []
        asked: list[int] = []
        for i, message in enumerate(messages):
            current = self._current
            if current is not None and current.run_id == message.run_id:
                # The usual case: the engine of this run is loaded and knows its weights.
                seconds, version = current.lease_seconds, current.engine.weight_version
            else:
                # A run's first messages, which arrive together: the lease is taken before the
                # engine is loaded (a stale message of another run must not make this worker
                # switch engines), with the lease length read once from the run's config.
                seconds, version = self._lease_seconds_of(message.run_id), None
            if seconds is not None:
                requests.append((message.run_id, message.attempt_id, seconds, version))
                asked.append(i)
        leases: list[Lease | None] = [None] * len(messages)
        if requests:
            for i, lease in zip(asked, self._handshakes.submit_many(requests), strict=True):
                if isinstance(lease, BaseException):
                    raise lease
                leases[i] = lease
        return leases

    def _run_leased(self, taken: list[tuple[GenerateMessage, Lease]]) -> list[ResultMessage]:
        """Generate, score, store and send the groups of one run's leased attempts."""
        run_engine = self._engine_for(taken[0][0].run_id)
        for _, lease in taken:
            self.leases.hold(lease, run_engine.heartbeat_seconds)
        try:
            results = self._generate(run_engine, taken)
        finally:
            # Stop beating before the results can be committed; the last beat's lease covers
            # the trip to the consumer.
            for message, _ in taken:
                self.leases.release(message.attempt_id)
        self.send_results([result.to_json() for result in results])
        return results

    def _lease_seconds_of(self, run_id: int) -> float | None:
        """The run's lease length (its config never changes), or None for no such run."""
        found = self._lease_seconds.get(run_id)
        if found is None:
            # Its own lock: `_lock` is held while an engine loads, which can take minutes.
            with self._lease_lock:
                found = self._lease_seconds.get(run_id)
                if found is None:
                    try:
                        config = self.ledger.transaction(lambda s: _run_config(s, run_id), what="read run config")
                    except LookupError:
                        return None
                    found = self._lease_seconds[run_id] = config.generation.lease_seconds
        return found

    def _take_leases(self, requests: list[tuple[int, int, float, int | None]]) -> list[Lease | None]:
        """Lease handshakes of the attempts that arrived while the previous ones were taken:
        one transaction (one commit) for all of them. A repeat of an attempt in the same
        batch gets no lease, as it would have one handshake later."""
        groups: dict[tuple[int, float, int | None], list[int]] = {}
        for run_id, attempt_id, seconds, version in requests:
            groups.setdefault((run_id, seconds, version), []).append(attempt_id)

        busy: list[tuple[int, int, float, int | None]] = []

        def take(session) -> dict[int, Lease]:  # type: ignore[no-untyped-def]
            taken: dict[int, Lease] = {}
            busy.clear()
            for (run_id, seconds, version), ids in groups.items():
                # On the database's clock (now=None), never this machine's. Rows a consumer's
                # batch holds are left for below: waiting for them here, holding the others,
                # could deadlock with that batch (`start_attempts`).
                leased = start_attempts(session, run_id, ids, self.worker, seconds, None, version, wait=False)
                taken.update(leased)
                left = [attempt_id for attempt_id in dict.fromkeys(ids) if attempt_id not in leased]
                busy.extend((run_id, a, seconds, version) for a in startable(session, run_id, left))
            return taken

        taken = self.ledger.transaction(take, what="lease handshake")
        if busy:
            # After the others committed, those whose rows were busy (most often the relay's:
            # it marks them queued in the transaction that published them, and a fast worker
            # gets here before it commits): waiting for them now holds nothing else, and they
            # are locked in id order.
            again: dict[tuple[int, float, int | None], list[int]] = {}
            for run_id, attempt_id, seconds, version in busy:
                again.setdefault((run_id, seconds, version), []).append(attempt_id)

            def take_busy(session) -> dict[int, Lease]:  # type: ignore[no-untyped-def]
                found: dict[int, Lease] = {}
                for (run_id, seconds, version), ids in again.items():
                    found.update(start_attempts(session, run_id, ids, self.worker, seconds, None, version))
                return found

            taken.update(self.ledger.transaction(take_busy, what="lease handshake"))
        out: list[Lease | None] = []
        for _, attempt_id, _, _ in requests:
            out.append(taken.pop(attempt_id, None))
        return out

    def _generate(self, run_engine: _RunEngine, taken: list[tuple[GenerateMessage, Lease]]) -> list[ResultMessage]:
        # Each message is its engine request (a GenerateMessage is a GenerationRequest), with
        # the weight floor its lease carries: the ledger may have raised it since the message
        # was sent (the attempt was handed to a later step).
        requests = [
            replace(message, min_weight_version=max(message.min_weight_version, lease.min_weight_version))
            for message, lease in taken
        ]
        started = time.perf_counter()
        try:
            outputs: list[GenerationOutput | BaseException] = run_engine.engine.submit_many(requests)
        except Exception as error:  # noqa: BLE001 - the engine closed under us (another run's took its place): each attempt's infra failure
            outputs = [error] * len(requests)
        results = [
            self._scored(run_engine, message, output, started)
            for (message, _), output in zip(taken, outputs, strict=True)
        ]
        if run_engine.store is None:
            return results
        return self._claim_checks(run_engine, results)

    def _scored(
        self, run_engine: _RunEngine, message: GenerateMessage, output: GenerationOutput | BaseException, started: float
    ) -> ResultMessage:
        """One attempt's result: its group scored, or why it failed."""
        # With a payload store every result is a claim check's body (version 2), failures too:
        # it bounds an engine's error text, so no message grows with what went wrong.
        message_type = ResultMessage if run_engine.store is None else ClaimCheckResult

        def failure(kind: str, error: str, version: int | None = None) -> ResultMessage:
            return message_type(
                run_id=message.run_id,
                attempt_id=message.attempt_id,
                worker=self.worker,
                weight_version=version,
                error_kind=kind,
                error=error,
                generation_seconds=time.perf_counter() - started,
            )

        if isinstance(output, BaseException):
            if not isinstance(output, Exception):
                raise output  # KeyboardInterrupt, SystemExit: not this attempt's failure
            log.warning("attempt %s: engine failed: %r", message.attempt_id, output)
            return failure("infra", f"{type(output).__name__}: {output}")
        if run_engine.store is None:
            # Inline, the message is the result: its estimated JSON is what the limit bounds.
            size = estimated_result_bytes(output)
            if size > run_engine.max_result_bytes:
                return failure("data", oversized_error(size, run_engine.max_result_bytes), output.weight_version)
        try:
            rewards = score_group(run_engine.reward_fn, [c.text for c in output.completions], message.row)
        except RewardError as error:
            return failure("data", str(error), output.weight_version)
        return ResultMessage(
            run_id=message.run_id,
            attempt_id=message.attempt_id,
            worker=self.worker,
            weight_version=output.weight_version,
            prompt_token_ids=output.prompt_token_ids,
            completions=output.completions,
            rewards=rewards,
            generation_seconds=(
                output.generation_seconds
                if output.generation_seconds is not None
                else time.perf_counter() - started
            ),
        )

    def _claim_checks(self, run_engine: _RunEngine, results: list[ResultMessage]) -> list[ResultMessage]:
        """The claim checks of a bundle's results: each group checked, packed and staged, then
        all of them published in one submission (their directory fsynced once, with those of
        the other task threads' bundles staged meanwhile)."""
        store = run_engine.store
        assert store is not None
        checked: list[ResultMessage] = []
        staged: list[tuple[int, Staged]] = []
        for result in results:
            if result.error_kind is not None:
                checked.append(result)  # a failure, already a claim check's body
                continue
            claim, one = stage_claim_check(result, store, run_engine.settings, run_engine.max_result_bytes)
            if one is not None:
                staged.append((len(checked), one))
            checked.append(claim)
        if staged:
            published = self._publishes.submit_many([(store, one) for _, one in staged])
            for (i, _), outcome in zip(staged, published, strict=True):
                if isinstance(outcome, OSError):
                    checked[i] = not_stored(results[i], store, outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    self._chaos.after_storing(checked[i].attempt_id)
        return checked

    # --- the engine of a run -------------------------------------------------------------

    def _engine_for(self, run_id: int) -> _RunEngine:
        with self._lock:
            current = self._current
            if current is not None and current.run_id == run_id:
                return current
            kept = self._set_aside_engines.pop(run_id, None)
            if kept is not None:
                if current is not None:
                    self._set_aside(current)
                self._current = kept
                return kept
            config, run_dir = self.ledger.transaction(lambda s: _run_config_and_dir(s, run_id), what="read run config")
            if current is not None:
                self._set_aside(current)
            engine = self.engine_factory(config)
            batching = BatchingEngine.from_config(
                engine, config, weights_provider=lambda needed: self._newest_weights(run_id, needed)
            )
            self._current = _RunEngine(
                run_id=run_id,
                config=config,
                engine=batching,
                reward_fn=load_reward_fn(config.reward.function, config.reward.kwargs),
                heartbeat_seconds=config.generation.heartbeat_seconds,
                lease_seconds=config.generation.lease_seconds,
                max_result_bytes=config.infra.max_result_bytes,
                store=store_for(config, run_dir),
                settings=LedgerSettings.from_config(config),
            )
            return self._current

    def _newest_weights(self, run_id: int, needed: int = 0) -> tuple[int, str | None] | None:
        """The newest published weights (the engine asks before every batch). An answer at
        least as new as the batch needs is reused for WEIGHTS_TTL seconds: a new version is
        picked up that much later at most, never below what a request requires."""
        now = time.monotonic()
        cached = self._weights.get(run_id)
        if cached is not None and now - cached[0] < WEIGHTS_TTL and cached[1] is not None and cached[1][0] >= needed:
            return cached[1]
        found = self.ledger.transaction(lambda s: newest_weights(s, run_id), what="read weights")
        self._weights[run_id] = (now, found)
        return found

    def close(self) -> None:
        self._handshakes.close(timeout=30)
        self._publishes.close(timeout=30)
        self.leases.close()
        with self._lock:
            if self._current is not None:
                self._current.engine.close()
                self._current = None
            for kept in self._set_aside_engines.values():
                kept.engine.close()
            self._set_aside_engines.clear()

    #: Engines of other runs a sim worker keeps loaded (runs sharing a fleet, issue 18).
    SET_ASIDE_ENGINES = 16

    def _set_aside(self, engine: _RunEngine) -> None:
        """Make room for another run's engine (called with the lock held).

        Runs sharing a fleet interleave their messages on every worker (the relay meters
        them by run.share), and a closed engine fails the attempts that still hold it. A
        sim engine costs nothing to keep, so it stays for the run's next message. A model
        engine is closed (one per process: the GPU is freed first), as before."""
        if engine.config.generation.backend == "sim":
            if len(self._set_aside_engines) >= self.SET_ASIDE_ENGINES:
                oldest = next(iter(self._set_aside_engines))
                self._set_aside_engines.pop(oldest).engine.close()
            self._set_aside_engines[engine.run_id] = engine
            return
        log.info("switching engine away from run %s", engine.run_id)
        engine.engine.close()


def _run_config(session, run_id: int) -> RunConfig:  # type: ignore[no-untyped-def]
    return _run_config_and_dir(session, run_id)[0]


def _run_config_and_dir(session, run_id: int) -> tuple[RunConfig, str]:  # type: ignore[no-untyped-def]
    row = session.execute(select(Run.config, Run.run_dir).where(Run.id == run_id)).first()
    if row is None:
        raise LookupError(f"there is no run {run_id} in the ledger")
    return from_snapshot(row.config, source=f"run {run_id}'s stored config"), row.run_dir


class LeaseKeeper:
    """Extends the leases of the attempts this process is generating, one UPDATE per beat."""

    def __init__(self, ledger: Ledger, worker: str) -> None:
        self.ledger = ledger
        self.worker = worker
        self._held: dict[int, float] = {}
        #: when each held lease was last known renewed (taken, or extended by a beat that
        #: started then), on this process's monotonic clock
        self._renewed: dict[int, float] = {}
        self._interval = 10.0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, lease: Lease, heartbeat_seconds: float) -> None:
        with self._cond:
            self._held[lease.attempt_id] = lease.lease_seconds
            self._renewed[lease.attempt_id] = lease.taken_at
            # Never let a lease run out between two beats.
            self._interval = min(heartbeat_seconds, lease.lease_seconds / 3)
            self._cond.notify()

    def release(self, attempt_id: int) -> None:
        with self._cond:
            seconds = self._held.pop(attempt_id, None)
            renewed = self._renewed.pop(attempt_id, None)
        if seconds is None or renewed is None or time.monotonic() - renewed <= seconds:
            return
        # A whole lease went by without a renewal: this process was frozen (SIGSTOP, a long
        # GC pause, a stuck call, a VM migration) or starved. The reaper may have taken the
        # attempt back meanwhile; ask before the result goes out, so that this worker knows
        # (the ledger refuses that result as late whatever the worker believes).
        stalled = time.monotonic() - renewed
        try:
            still_ours = attempt_id in self._extend({attempt_id: seconds})
        except Exception as error:  # noqa: BLE001 - the ledger judges the result anyway
            log.warning("attempt %s: could not check its lease after %.0fs without a renewal: %r", attempt_id, stalled, error)
            return
        if not still_ours:
            log.warning(
                "lease of attempt %s expired while this process went %.0fs without renewing it "
                "(lease %.0fs) and was re-dispatched; its result will be refused as late",
                attempt_id, stalled, seconds,
            )

    def beat(self) -> int:
        with self._cond:
            held = dict(self._held)
        if not held:
            return 0
        started = time.monotonic()
        extended = self._extend(held)
        with self._cond:
            for attempt_id in extended:
                if attempt_id in self._renewed:
                    self._renewed[attempt_id] = started
            # An attempt released while the beat ran finished normally; only those still
            # held and not extended were taken from us.
            lost = [a for a in held if a not in extended and a in self._held]
        if lost:
            log.warning(
                "leases of attempts %s expired and were re-dispatched; their results will be refused as late",
                lost,
            )
        return len(extended)

    def _extend(self, held: dict[int, float]) -> set[int]:
        """Push out the leases of `held` (attempt -> lease seconds) that are still ours, from
        the database's clock; returns the attempts extended."""
        return self.ledger.transaction(lambda s: extend_leases(s, held, self.worker), what="lease heartbeat")

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            with self._cond:
                # A lease just taken is fresh: `hold` only shortens the interval if it must
                # (waking this thread to recompute the deadline), it does not cost a beat.
                while not self._closed:
                    remaining = last + self._interval - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._closed:
                    return
            last = time.monotonic()
            try:
                self.beat()
            except Exception as error:  # noqa: BLE001 - a missed beat is retried at the next one
                log.warning("lease heartbeat failed: %r", error)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)
