"""The claim check through the ledger (issue 17): a result that names a stored payload commits
its reference, the trainer's claim reads and verifies the payload, the payloads nothing will
read are discarded at commit or swept, and `refill check` proves the committed ones exist."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select, update

from refill.admin.invariant_types import Context
from refill.admin.payload_invariants import check_payloads
from refill.models import payload_store, rollout_codec
from refill.models.payload import (
    PAYLOAD_BUCKET,
    ClaimCheckResult,
    Completion,
    GenerateMessage,
    ResultMessage,
    as_list,
)
from refill.models.payload_store import (
    DamagedPayload,
    FileStore,
    PayloadKeeper,
    unclaimed,
)
from refill.models.results import Outcome
from refill.models.settings import LedgerSettings
from refill.models.tables import Attempt, Group, Run, RunStatus
from refill.tasks.consumer import ResultConsumer
from refill.tasks.generation import GenerationService
from tests.support.driver import FLAT, SPREAD, Driver


def _completions(n: int, seed: int) -> list[Completion]:
    return [Completion([seed % 90, i, 7], [-0.5, -0.25, -1.0 - seed], f"text {seed}/{i}", "stop") for i in range(n)]


class Claims:
    """Plays a generation worker of the claim check for a Driver's run: stores the group, then
    hands back the result that names it."""

    def __init__(self, d: Driver, root: Path) -> None:
        self.d = d
        self.run_dir = root / f"run-{d.run_id}"
        d.ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(run_dir=str(self.run_dir))))
        self.store = FileStore.of_run(self.run_dir)
        self.stored: dict[int, tuple[list[int], list[Completion]]] = {}

    def result(self, attempt_id: int, rewards: list[float], version: int = 0, worker: str | None = None) -> ClaimCheckResult:
        prompt, completions = [5, 6, attempt_id % 90], _completions(len(rewards), attempt_id)
        rollout = rollout_codec.Rollout.build(prompt, completions)
        ref = self.store.put(attempt_id, rollout_codec.pack_payload(rollout, rollout_codec.texts(completions)))
        self.stored[attempt_id] = (prompt, completions)
        return ClaimCheckResult(
            run_id=self.d.run_id, attempt_id=attempt_id, worker=worker or self.d.worker, weight_version=version,
            rewards=rewards, payload=ref, prompt_length=len(prompt), lengths=[len(c.token_ids) for c in completions],
        )

    def finish(self, attempt_id: int, rewards: list[float]):  # type: ignore[no-untyped-def]
        version = self.d._started(attempt_id)
        return self.d.record(self.result(attempt_id, rewards, version))

    def names(self) -> set[str]:
        return {name for _, name in self.store.listing()}


@pytest.fixture
def d(ledger) -> Driver:  # type: ignore[no-untyped-def]
    driver = Driver(ledger)
    driver.admit()
    return driver


@pytest.fixture
def claims(d: Driver, tmp_path: Path) -> Claims:
    return Claims(d, tmp_path)


def test_a_claim_check_commits_its_reference_and_the_trainer_reads_the_group(d: Driver, claims: Claims) -> None:
    """Slots 0 and 2 come as claim checks, 1 and 3 inline (a worker of the previous release
    during an upgrade): the step trains on all four, each exactly as generated, in slot order."""
    for idx in range(4):
        attempt = d.live_of(0, idx).id
        if idx % 2 == 0:
            (recorded,) = claims.finish(attempt, SPREAD).outcomes
        else:
            recorded = d.finish_one(attempt, SPREAD)
        assert recorded.outcome is Outcome.COMMITTED
    with d.ledger.session() as session:
        groups = {g.attempt_id: g for g in session.scalars(select(Group).where(Group.run_id == d.run_id))}
        for attempt_id, group in groups.items():
            if attempt_id in claims.stored:
                assert (group.rollout, group.completion_texts) == (None, None)
                assert group.payload_bytes == claims.store.path(group.payload_ref).stat().st_size
                assert group.num_tokens == 3 * 4
            else:
                assert group.payload_ref is None and group.rollout is not None
    batch = d.claim(0)
    assert batch is not None
    assert [g.attempt_id for g in batch.groups] == [d.slot(0, i).group_attempt_id for i in range(4)]
    for group in batch.groups:
        if group.attempt_id in claims.stored:
            prompt, completions = claims.stored[group.attempt_id]
            # The trainer gets numpy arrays (TrainGroup), equal to what the worker stored.
            assert (as_list(group.prompt_token_ids), group.completions) == (prompt, completions)
            assert group.prompt_token_ids.dtype == np.int64
            assert all(c.token_ids.dtype == np.int64 and c.logprobs.dtype == np.float64 for c in group.completions)
        assert group.rewards == SPREAD and group.weight_version == 0
    assert d.finish_training(0)
    # A trained group's payload stays (the run's retention decides); nothing was discarded.
    assert len(claims.names()) == 2


def test_the_payloads_nothing_will_read_are_discarded_at_commit(d: Driver, claims: Claims) -> None:
    slot0, slot1, slot2, slot3 = (d.live_of(0, i).id for i in range(4))
    d.start_all([slot0, slot1, slot2, slot3])
    committed = claims.result(slot0, SPREAD)
    filtered = claims.result(slot1, FLAT)
    wrong_size = claims.result(slot2, SPREAD[:3])
    batch = d.record(committed, filtered, wrong_size)
    assert [o.outcome for o in batch.outcomes] == [Outcome.COMMITTED, Outcome.FILTERED, Outcome.FAILED]
    assert batch.outcomes[2].detail == "group has 3 completions, the run expects 4"
    assert sorted(batch.discarded) == sorted([(d.run_id, filtered.payload.name), (d.run_id, wrong_size.payload.name)])  # type: ignore[union-attr]

    # The same result delivered again holds the committed group's payload: kept. Another
    # payload for the settled attempt (a second write) is not anybody's: discarded.
    again = d.record(committed)
    assert again.outcomes[0].outcome is Outcome.DUPLICATE and again.discarded == []
    stray = claims.result(slot0, SPREAD)
    assert d.record(stray).discarded == [(d.run_id, stray.payload.name)]  # type: ignore[union-attr]

    # A result from a worker that does not hold the lease of a live attempt must not remove the
    # holder's payload; the holder's own result then commits it.
    impostor = dataclasses.replace(claims.result(slot3, SPREAD), worker="impostor")
    assert d.record(impostor).discarded == []
    holder = claims.result(slot3, SPREAD)
    assert d.record(holder).outcomes[0].outcome is Outcome.COMMITTED

    # An attempt the ledger never dispatched: its payload is nobody's.
    unknown = claims.result(10**9, SPREAD)
    assert d.record(unknown).discarded == [(d.run_id, unknown.payload.name)]  # type: ignore[union-attr]


def test_a_late_claim_check_is_discarded(d: Driver, claims: Claims) -> None:
    attempt = d.live_of(0, 0).id
    d.start_all([attempt])
    d.tick(120)  # past the 60 s lease, no heartbeat
    assert d.reap().attempts >= 1
    late = claims.result(attempt, SPREAD)
    batch = d.record(late)
    assert batch.outcomes[0].outcome is Outcome.LATE
    assert batch.discarded == [(d.run_id, late.payload.name)]  # type: ignore[union-attr]


def test_an_oversized_claim_check_is_a_data_failure_on_receipt(d: Driver, claims: Claims, ledger) -> None:  # type: ignore[no-untyped-def]
    """The consumer bounds what a worker stored by infra.max_result_bytes as it bounds an inline
    result, and removes the refused payload with the failure."""
    attempt = d.live_of(0, 0).id
    d.start_all([attempt])
    result = claims.result(attempt, SPREAD)
    result = dataclasses.replace(result, payload=dataclasses.replace(result.payload, size=10**9))  # type: ignore[arg-type]
    consumer = ResultConsumer(ledger, max_wait_ms=0)
    try:
        assert consumer.submit(result.to_json()) == "FAILED"
        assert consumer._remover.flush(10)
    finally:
        consumer.close()
    assert "exceeds infra.max_result_bytes" in (d.attempt(attempt).error or "")
    assert claims.names() == set()


def test_the_consumer_records_both_body_versions_and_removes_what_it_discarded(d: Driver, claims: Claims, ledger) -> None:  # type: ignore[no-untyped-def]
    slots = [d.live_of(0, i).id for i in range(4)]
    d.start_all(slots)
    inline = d.result(slots[0], SPREAD).to_json()
    assert "v" not in inline  # what a worker of the previous release sends
    bodies = [
        inline,
        claims.result(slots[1], SPREAD).to_json(),
        claims.result(slots[2], FLAT).to_json(),
        {"v": 2, "run_id": d.run_id, "attempt_id": slots[3], "payload": {"ref": "../../x", "bytes": 1, "checksum": "x"}},
    ]
    filtered_name = bodies[2]["payload"]["ref"]
    consumer = ResultConsumer(ledger, max_wait_ms=50)
    try:
        outcomes = [""] * 4

        def submit(i: int) -> None:
            outcomes[i] = consumer.submit(bodies[i])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert consumer._remover.flush(10)
    finally:
        consumer.close()
    assert outcomes == ["COMMITTED", "COMMITTED", "FILTERED", "MALFORMED"]
    assert filtered_name not in claims.names() and len(claims.names()) == 1
    rejected = d.rejected()
    assert len(rejected) == 1 and "payload name '../../x'" in (rejected[0].detail or "")


def test_a_damaged_payload_is_named_when_the_trainer_reads_the_step(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, check=False)  # the payload store is damaged by hand
    d.admit()
    claims = Claims(d, tmp_path)
    for idx in range(4):
        claims.finish(d.live_of(0, idx).id, SPREAD)
    victim = d.slot(0, 2).group_attempt_id
    group = d.group(victim)
    assert group is not None and group.payload_ref is not None
    path = claims.store.path(group.payload_ref)
    path.write_bytes(path.read_bytes()[:-1] + b"?")
    batch = d.claim(0)
    assert batch is not None and d.step(0).status == "training"
    with pytest.raises(DamagedPayload, match=f"run {d.run_id} step 0: the payload of group {victim} is damaged: .* has checksum"):
        batch.groups  # noqa: B018 - reading the groups is what verifies them
    path.unlink()
    with d.ledger.session() as session:
        (violation,) = check_payloads(_context(session, d.run_id))
    assert violation.attempt == victim and str(path) in violation.message and "is missing" in violation.message


def _context(session, run_id: int) -> Context:  # type: ignore[no-untyped-def]
    run = session.get(Run, run_id)
    return Context(session, run, LedgerSettings.from_config(run.config))


def test_the_sweep_removes_what_no_committed_group_holds(d: Driver, claims: Claims) -> None:
    """What a crash leaves behind: a worker that stored and died (its lease then expired), a
    consumer that committed and died before removing a filtered group's payload, a write cut
    short. The sweep removes those and keeps what is committed or still in flight."""
    committed_attempt, filtered_attempt, reaped_attempt, running_attempt = (d.live_of(0, i).id for i in range(4))
    claims.finish(committed_attempt, SPREAD)
    d.start_all([filtered_attempt, reaped_attempt])
    filtered = claims.result(filtered_attempt, FLAT)
    assert d.record(filtered).outcomes[0].outcome is Outcome.FILTERED  # nobody removes it
    orphan = claims.result(reaped_attempt, SPREAD)  # stored, never sent
    d.tick(120)
    d.reap()
    d.start_all([running_attempt])
    in_flight = claims.result(running_attempt, SPREAD)  # stored, on its way
    bucket = claims.store.path(orphan.payload.name).parent  # type: ignore[union-attr]
    partial = bucket / f".{reaped_attempt}.0123456789abcdef.rfp.tmp"
    partial.write_bytes(b"RFP")
    foreign = bucket / "notes.txt"
    foreign.write_text("not the store's")
    committed_name = d.group(committed_attempt).payload_ref  # type: ignore[union-attr]

    keeper = PayloadKeeper(d.ledger, d.run_id, claims.store, interval=60, retention="keep")
    assert keeper.sweep() == 3
    assert claims.names() == {committed_name, in_flight.payload.name, f"{bucket.name}/notes.txt"}  # type: ignore[union-attr]
    with d.ledger.session() as session:
        judged = unclaimed(session, d.run_id, {committed_name: committed_attempt, in_flight.payload.name: running_attempt})  # type: ignore[union-attr,dict-item]
    assert judged == ([], {committed_name})
    assert keeper.sweep() == 0
    # The attempt in flight never sends its result either: once its lease is reaped, the next
    # sweep takes its payload (a payload kept for a live attempt is looked at again).
    d.tick(120)
    assert d.reap().attempts == 1
    assert keeper.sweep() == 1
    assert claims.names() == {committed_name, f"{bucket.name}/notes.txt"}


def test_a_sweep_skips_the_buckets_whose_attempts_all_finished(d: Driver, claims: Claims, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    keeper = PayloadKeeper(d.ledger, d.run_id, claims.store, interval=60, retention="keep")
    attempt = d.live_of(0, 0).id
    claims.finish(attempt, SPREAD)
    orphan = claims.result(attempt, SPREAD).payload  # a second write for a settled attempt: nobody's
    assert orphan is not None
    keeper.sweep()
    bucket = attempt // PAYLOAD_BUCKET
    assert orphan.name not in claims.names() and bucket not in keeper._closed  # live attempts there
    # Every attempt of the bucket finished before the next sweep began: it closes, and is not
    # listed again (a payload stored there later, by a worker past its lease, waits for gc).
    monkeypatch.setattr(payload_store, "lowest_live_attempt", lambda session, run_id: (bucket + 1) * PAYLOAD_BUCKET)
    keeper.sweep()
    assert bucket in keeper._closed
    late = claims.store.put(attempt + 2, b"written after its bucket closed")
    assert keeper.sweep() == 0 and late.name in claims.names()


def test_the_retention_removes_a_finished_runs_payloads(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, check=False)  # told the run ended while the ledger says it runs
    d.admit()
    claims = Claims(d, tmp_path)
    for idx in range(4):
        claims.finish(d.live_of(0, idx).id, SPREAD)
    keeper = PayloadKeeper(d.ledger, d.run_id, claims.store, interval=3600, retention="delete")
    keeper.after_housekeeping(RunStatus.RUNNING.value)  # not due
    keeper.after_housekeeping(RunStatus.STOPPED.value)  # may resume: kept
    assert len(claims.names()) == 4
    keeper.after_housekeeping(RunStatus.COMPLETED.value)
    assert not claims.store.root.exists()
    with d.ledger.session() as session:
        session.execute(update(Run).where(Run.id == d.run_id).values(status=RunStatus.COMPLETED.value))
        # A finished run whose store is gone trains no more: nothing to prove.
        assert check_payloads(_context(session, d.run_id)) == []
        session.rollback()
    keep = PayloadKeeper(d.ledger, d.run_id, claims.store, interval=3600, retention="keep")
    held = claims.finish(d.live_of(1, 0).id, SPREAD).outcomes[0]
    claims.store.put(10**9, b"an attempt this ledger never dispatched")
    keep.after_housekeeping(RunStatus.COMPLETED.value)  # keep: only what nobody holds goes
    assert claims.names() == {d.group(held.attempt_id).payload_ref}  # type: ignore[union-attr]


# --- the generation worker ------------------------------------------------------------------------

#: The sim back-end's completions scored as a fleet scores them.
SIM_REWARD = {"reward": {"function": "refill.rewards.sim:solved"}}
NO_FILTER = {"grpo": {"use_dynamic_sampling": False}}


def _service(d: Driver) -> tuple[GenerationService, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []
    return GenerationService(d.ledger, send_results=sent.extend, worker=d.worker), sent


def _messages(d: Driver) -> list[GenerateMessage]:
    return [GenerateMessage.from_json(m.body) for m in d.relay() if m.kind == "generate"]


def test_a_worker_stores_a_checked_group_and_sends_its_claim_check(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Without dynamic sampling every usable group is stored (with it, a zero-variance group is
    # not: see test_a_worker_stores_no_group_the_run_filters).
    d = Driver(ledger, {**SIM_REWARD, **NO_FILTER, "generation": {"max_new_tokens": 64, "sim": {"tokens_per_completion": 64}}})
    d.admit()
    claims = Claims(d, tmp_path)
    service, sent = _service(d)
    try:
        message = _messages(d)[0]
        assert service.run(message) == "generated"
    finally:
        service.close()
    (body,) = sent
    assert body["v"] == 2 and len(body["lengths"]) == 4 and set(body["lengths"]) == {64}
    result = ResultMessage.from_json(body)
    assert isinstance(result, ClaimCheckResult) and result.payload is not None
    prompt, completions = rollout_codec.unpack_payload(claims.store.read(result.payload))
    assert len(prompt) == result.prompt_length and [len(c.token_ids) for c in completions] == result.lengths
    assert d.record(result).outcomes[0].outcome in (Outcome.COMMITTED, Outcome.FILTERED)


def test_a_bundle_runs_as_one_batch_through_each_stage(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The attempts of one generate message go through the lease handshake, the engine, the
    payloads' publication and the send together (one submission each), and a group that
    fails its checks fails alone: the others are stored and sent beside it."""
    from refill.tasks.backends import make_engine

    d = Driver(ledger, {**SIM_REWARD, **NO_FILTER})  # every usable group stored
    d.admit()
    claims = Claims(d, tmp_path)
    engine_batches: list[int] = []

    def factory(config):  # type: ignore[no-untyped-def]
        engine = make_engine(config)
        generate = engine.generate

        def counted(requests):  # type: ignore[no-untyped-def]
            engine_batches.append(len(requests))
            outputs = generate(requests)
            # Every other group one completion short, by position: the sim back-end's own
            # `wrong_group_size_rate` draws by each request's seed, which follows the attempt
            # ids, so which groups failed depended on what ran before in the database.
            for output in outputs[1::2]:
                output.completions.pop()
            return outputs

        engine.generate = counted
        return engine

    sends: list[list[dict[str, Any]]] = []
    service = GenerationService(d.ledger, send_results=sends.append, worker=d.worker, engine_factory=factory)
    messages = _messages(d)[:6]
    try:
        outcome = service.run_all(messages)
        handshakes, publishes = service._handshakes.batches_processed, service._publishes.batches_processed
    finally:
        service.close()
    assert engine_batches == [6] and handshakes == 1 and publishes == 1
    (sent,) = sends
    assert [body["attempt_id"] for body in sent] == [m.attempt_id for m in messages]
    results = [ResultMessage.from_json(body) for body in sent]
    failed = [r for r in results if r.error_kind is not None]
    stored = [r for r in results if r.error_kind is None]
    # Both kinds are in this bundle, and the outcome counts them.
    assert failed and stored, outcome
    assert outcome == f"data x{len(failed)}, generated x{len(stored)}"
    assert all(r.error_kind == "data" and r.payload is None for r in failed)  # type: ignore[attr-defined]
    assert claims.names() == {r.payload.name for r in stored}  # type: ignore[attr-defined]
    batch = d.record(*results)
    assert sorted(o.outcome is Outcome.FAILED for o in batch.outcomes) == sorted(r.error_kind is not None for r in results)


def test_a_bundle_whose_engine_closed_reports_each_attempt_as_an_infra_failure(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An engine closed under a bundle (another run's engine took its place) fails each of its
    attempts as infra, sent at once so they are tried again, not left to their leases."""
    d = Driver(ledger, SIM_REWARD)
    d.admit()
    Claims(d, tmp_path)
    service, sent = _service(d)
    messages = _messages(d)[:3]
    try:
        assert service.run(messages[0]) in ("generated", "data")
        service._current.engine.close()  # type: ignore[union-attr]
        assert service.run_all(messages[1:]) == "infra x2"
    finally:
        service.close()
    failed = [ResultMessage.from_json(body) for body in sent[1:]]
    assert [r.attempt_id for r in failed] == [m.attempt_id for m in messages[1:]]
    assert all(r.error_kind == "infra" and "closed" in (r.error or "") for r in failed)


@pytest.mark.parametrize(
    ("sim", "infra", "problem"),
    [
        ({"wrong_group_size_rate": 1.0}, {}, "group has 3 completions, the run expects 4"),
        ({"oversized_rate": 1.0}, {"max_result_bytes": 4096}, "exceeds infra.max_result_bytes=4096"),
    ],
)
def test_a_worker_stores_nothing_for_a_group_it_cannot_use(ledger, tmp_path: Path, sim, infra, problem: str) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {**SIM_REWARD, "generation": {"sim": sim}, "infra": infra})
    d.admit()
    claims = Claims(d, tmp_path)
    service, sent = _service(d)
    try:
        assert service.run(_messages(d)[0]) == "data"
    finally:
        service.close()
    result = ResultMessage.from_json(sent[0])
    assert isinstance(result, ClaimCheckResult) and result.payload is None and problem in (result.error or "")
    assert claims.names() == set()
    assert d.record(result).outcomes[0].outcome is Outcome.FAILED


def test_a_worker_that_cannot_store_reports_an_infra_failure(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {**SIM_REWARD, **NO_FILTER})  # a zero-variance group would not be stored at all
    d.admit()
    claims = Claims(d, tmp_path)
    claims.run_dir.mkdir(parents=True)
    (claims.run_dir / "payloads").write_text("a file where the store's directory belongs")
    service, sent = _service(d)
    try:
        assert service.run(_messages(d)[0]) == "infra"
    finally:
        service.close()
    result = ResultMessage.from_json(sent[0])
    assert result.error_kind == "infra" and "could not store the payload under" in (result.error or "")


def _inline(d: Driver, attempt_id: int, rewards: list[float]) -> ResultMessage:
    return d.result(attempt_id, rewards, completions=_completions(len(rewards), attempt_id))


@pytest.mark.parametrize("dynamic_sampling", [True, False])
def test_a_worker_stores_no_group_the_run_filters(ledger, tmp_path: Path, dynamic_sampling: bool) -> None:  # type: ignore[no-untyped-def]
    """Under dynamic sampling a zero-variance group is filtered, and nothing ever reads a
    filtered group's rollout: the worker sends its rewards and lengths without storing it
    (`unstored`), the consumer filters it, and there is nothing to remove. Without dynamic
    sampling the same group trains, so it is stored and committed."""
    from refill.tasks.claim_checks import claim_check

    d = Driver(ledger, {} if dynamic_sampling else NO_FILTER)
    d.admit()
    claims = Claims(d, tmp_path)
    flat, spread = d.live_of(0, 0).id, d.live_of(0, 1).id
    d.start_all([flat, spread])
    settings = LedgerSettings.from_config(d.config)
    sent = [claim_check(_inline(d, a, rewards), claims.store, settings, 10**7) for a, rewards in ((flat, FLAT), (spread, SPREAD))]
    assert all(isinstance(r, ClaimCheckResult) and r.error_kind is None for r in sent)
    if dynamic_sampling:
        assert sent[0].payload is None and sent[0].unstored == "zero_variance" and sent[0].lengths == [3] * 4
        assert claims.names() == {sent[1].payload.name}  # type: ignore[union-attr]
    else:
        assert sent[0].unstored is None and claims.names() == {r.payload.name for r in sent}  # type: ignore[union-attr]
    batch = d.record(*(ResultMessage.from_json(r.to_json()) for r in sent))
    expected = Outcome.FILTERED if dynamic_sampling else Outcome.COMMITTED
    assert [o.outcome for o in batch.outcomes] == [expected, Outcome.COMMITTED]
    assert batch.discarded == []
    with d.ledger.session() as session:
        assert session.scalar(select(Attempt.zero_variance).where(Attempt.id == flat)) is True


@pytest.mark.parametrize(("overrides", "rewards"), [({}, SPREAD), (NO_FILTER, FLAT)])
def test_a_claim_check_without_a_payload_for_a_group_the_run_trains_is_a_data_failure(ledger, tmp_path: Path, overrides, rewards) -> None:  # type: ignore[no-untyped-def]
    """A claim check that stored nothing (`unstored`) for a group this run would train (one with
    spread, or any group without dynamic sampling) names no rollout to train on: a data
    failure, whose slot is tried again, never a group committed without its payload."""
    d = Driver(ledger, overrides)
    d.admit()
    Claims(d, tmp_path)
    attempt = d.live_of(0, 0).id
    d.start_all([attempt])
    claim = ClaimCheckResult(
        run_id=d.run_id, attempt_id=attempt, worker=d.worker, weight_version=0, rewards=rewards,
        payload=None, prompt_length=3, lengths=[3] * 4, unstored="zero_variance",
    )
    (recorded,) = d.record(claim).outcomes
    assert recorded.outcome is Outcome.FAILED
    assert recorded.detail == "the worker stored no payload (zero_variance) for a group this run does not filter"
    assert d.live_of(0, 0).id != attempt  # the slot's prompt goes out again
    with d.ledger.session() as session:
        assert session.scalars(select(Group).where(Group.attempt_id == attempt)).all() == []


def test_an_oversized_group_is_a_data_failure_even_when_the_run_would_filter_it(ledger, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The worker judges an invalid payload before the filter (SPEC §3), as the consumer
    does: a zero-variance group over `infra.max_result_bytes` is a data failure, not filtered."""
    from refill.tasks.claim_checks import claim_check

    d = Driver(ledger)
    d.admit()
    claims = Claims(d, tmp_path)
    attempt = d.live_of(0, 0).id
    settings = LedgerSettings.from_config(d.config)
    sent = claim_check(_inline(d, attempt, FLAT), claims.store, settings, 64)
    assert sent.error_kind == "data" and "exceeds infra.max_result_bytes=64" in (sent.error or "")
    assert sent.unstored is None and claims.names() == set()
