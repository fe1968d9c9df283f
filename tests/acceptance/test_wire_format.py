"""JSON only on the wire: a pickle-serialized message is refused by a real worker before any
refill code runs, and the worker goes on serving JSON messages."""

from __future__ import annotations

import time

from refill.models.payload import GenerateMessage
from refill.models.tables import Attempt
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
