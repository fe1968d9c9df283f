"""JSON only on the wire: a pickle-serialized message is refused by a real worker before any
refill code runs, and the worker goes on serving JSON messages. A result body has a version:
a consumer records the inline body of the previous release (version 1) and the claim check
(version 2) alike, so consumers are upgraded before workers; a claim check is a few hundred
bytes in Redis at any rollout length."""

from __future__ import annotations

import os
import random
import time

from sqlalchemy import select

from bench.payloads import RedisProbe
from refill.models import rollout_codec
from refill.models.admission import admit_steps
from refill.models.leases import start_attempt
from refill.models.payload import (
    ClaimCheckResult,
    Completion,
    GenerateMessage,
    PayloadRef,
    ResultMessage,
    payload_name,
)
from refill.models.payload_store import FileStore
from refill.models.runs import request_stop, start_run, stop_run
from refill.models.tables import Attempt, Group, Run
from refill.tasks.queues import GENERATE, RESULTS, TASK_GENERATE, TASK_RECORD_RESULT


def _wait_for(predicate, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_pickle_messages_are_refused(running_fleet, fleet_ledger) -> None:
    app = running_fleet.app
    body = GenerateMessage(
        run_id=999_999, attempt_id=999_999, prompt="1+1=", row={"prompt": "1+1="}, n=2,
        temperature=1.0, top_p=1.0, max_new_tokens=4, seed=1, min_weight_version=0,
    ).to_json()
    generate_log = len(running_fleet.log("generate"))
    consume_log = len(running_fleet.log("consume"))
    app.send_task(TASK_GENERATE, args=[body], queue=GENERATE, routing_key=GENERATE, serializer="pickle")
    app.send_task(
        TASK_RECORD_RESULT, args=[{"run_id": 1, "attempt_id": 1}], queue=RESULTS, routing_key=RESULTS,
        serializer="pickle",
    )
    refusal = "Refusing to deserialize untrusted content of type pickle"
    assert _wait_for(lambda: refusal in running_fleet.log("generate")[generate_log:])
    assert _wait_for(lambda: refusal in running_fleet.log("consume")[consume_log:])
    # Neither task ran.
    assert "succeeded" not in running_fleet.log("generate")[generate_log:]
    assert "succeeded" not in running_fleet.log("consume")[consume_log:]
    # The same worker still serves JSON: a generate message for an attempt the ledger never
    # dispatched runs and is skipped by the lease handshake.
    app.send_task(TASK_GENERATE, args=[body], queue=GENERATE, routing_key=GENERATE)
    assert _wait_for(lambda: "'skipped'" in running_fleet.log("generate")[generate_log:])
    with fleet_ledger.session() as session:
        assert session.get(Attempt, 999_999) is None


def test_a_bundle_runs_each_attempt_and_refuses_only_its_malformed_item(running_fleet, fleet_ledger) -> None:
    """The relay sends a run's attempts together as {"bundle": [...]}; a worker runs every
    attempt of it (here none was dispatched, so each is skipped by its lease handshake) and
    refuses a malformed item without losing the others."""
    app = running_fleet.app
    bodies = [
        GenerateMessage(
            run_id=999_998, attempt_id=999_990 + i, prompt="1+1=", row={"prompt": "1+1="}, n=2,
            temperature=1.0, top_p=1.0, max_new_tokens=4, seed=1, min_weight_version=0,
        ).to_json()
        for i in range(3)
    ]
    generate_log = len(running_fleet.log("generate"))
    app.send_task(
        TASK_GENERATE, args=[{"bundle": [*bodies, {"run_id": 999_998}]}], queue=GENERATE, routing_key=GENERATE
    )
    assert _wait_for(lambda: "'skipped x3'" in running_fleet.log("generate")[generate_log:])
    assert "refused generate message" in running_fleet.log("generate")[generate_log:]


def test_a_consumer_records_both_result_body_versions(running_fleet, fleet_ledger) -> None:
    """A worker of the previous release sends its group inline (no "v": version 1); one of this
    release stores it and sends a claim check (version 2). The same consumer commits both."""
    run_id = running_fleet.create_run(fleet_ledger, {"grpo": {"num_prompts_per_step": 2, "max_num_steps": 1}})
    fleet_ledger.transaction(lambda s: start_run(s, run_id, "wire-format-test"))  # no controller loop: nothing relayed
    fleet_ledger.transaction(lambda s: admit_steps(s, run_id))
    with fleet_ledger.session() as session:
        old, new = session.scalars(
            select(Attempt.id).where(Attempt.run_id == run_id, Attempt.step == 0).order_by(Attempt.id).limit(2)
        ).all()
        run_dir = session.get(Run, run_id).run_dir
    for attempt in (old, new):
        assert fleet_ledger.transaction(lambda s, a=attempt: start_attempt(s, a, "upgrading-worker")) is not None
    completions = [Completion([1, 2], [-0.5, -0.5], "<sim:solved>" if i % 2 else "x") for i in range(8)]
    rewards = [float(i % 2) for i in range(8)]
    inline = ResultMessage(
        run_id=run_id, attempt_id=old, worker="upgrading-worker", weight_version=0, prompt_token_ids=[1, 2, 3],
        completions=completions, rewards=rewards,
    ).to_json()
    assert "v" not in inline
    rollout = rollout_codec.Rollout.build([1, 2, 3], completions)
    ref = FileStore.of_run(run_dir).put(new, rollout_codec.pack_payload(rollout, rollout_codec.texts(completions)))
    claim = ClaimCheckResult(
        run_id=run_id, attempt_id=new, worker="upgrading-worker", weight_version=0, rewards=rewards,
        payload=ref, prompt_length=3, lengths=[2] * 8,
    ).to_json()
    for body in (inline, claim):
        running_fleet.app.send_task(TASK_RECORD_RESULT, args=[body], queue=RESULTS, routing_key=RESULTS, serializer="json")

    def committed() -> dict[int, tuple[bool, str | None]]:
        with fleet_ledger.session() as session:
            rows = session.execute(
                select(Group.attempt_id, Group.rollout.is_not(None), Group.payload_ref).where(Group.run_id == run_id)
            ).all()
        return {a: (inlined, ref) for a, inlined, ref in rows}

    assert _wait_for(lambda: len(committed()) == 2)
    assert committed() == {old: (True, None), new: (False, ref.name)}
    fleet_ledger.transaction(lambda s: request_stop(s, run_id))
    fleet_ledger.transaction(lambda s: stop_run(s, run_id))


def test_a_claim_check_is_a_few_hundred_bytes_in_redis_at_any_length() -> None:
    """What Redis holds for one result in flight: the Celery message as a worker sends it
    (headers, the base64 JSON body). 16 completions of 8,192 tokens inline are megabytes; as
    a claim check, with a lease holder's name of 200 characters, well under 4 KB."""
    rng = random.Random(0)
    worker = "w" * 200
    claim = ClaimCheckResult(
        run_id=10**6, attempt_id=10**9, worker=worker, weight_version=10**4, rewards=[rng.random() for _ in range(16)],
        payload=PayloadRef(payload_name(10**9, "0123456789abcdef"), 2**31, "sha256:" + "f" * 64),
        prompt_length=4096, lengths=[8192] * 16, generation_seconds=123.456789,
    ).to_json()
    inline = ResultMessage(
        run_id=1, attempt_id=2, worker=worker, weight_version=0, prompt_token_ids=list(range(64)),
        completions=[Completion([rng.randrange(32000) for _ in range(512)], [-rng.random() for _ in range(512)], "t" * 2048) for _ in range(16)],
        rewards=[rng.random() for _ in range(16)],
    ).to_json()
    probe = RedisProbe(os.environ["REFILL_TEST_REDIS_URL"])
    try:
        (claim_entry,), (inline_entry,) = probe.entries([claim], bundled=False), probe.entries([inline], bundled=False)
    finally:
        probe.close()
    assert len(claim_entry) < 4096
    assert len(inline_entry) > 100 * len(claim_entry) // 2
