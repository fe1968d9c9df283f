"""Scenarios 2 and 3 of issue 6: Redis loses every message (FLUSHALL) or goes away and comes
back empty (a restart without persistence). The ledger re-sends what was lost; the workers,
the consumer and the controller reconnect; the run completes with nothing lost.

Both break the whole Redis, not only this session's keys: any other test session on the same
Redis loses its messages too (that is the scenario). The suite's own fleet lives through it:
later scenarios run on the same workers.
"""

from __future__ import annotations

import base64
import json
from urllib.parse import urlparse

import pytest
from sqlalchemy import select

from refill.models.tables import Attempt, Outbox, Run
from tests.support.chaos_fleet import (
    FAULT_RUN,
    REDIS_URL,
    assert_nothing_lost,
    drive_with_fault,
    fault_facts,
    redis_client,
    restart_redis,
)
from tests.support.fleet import merged

pytestmark = pytest.mark.faults

#: More groups in flight (two steps of 32) than the fleet's 16 generation threads: at any
#: moment messages wait on the generate queue, and a flush loses them.
BACKLOG = {
    # Enough attempts per step that, bundled 8 to a message, some wait in Redis while every
    # worker thread holds a bundle.
    "grpo": {"max_num_steps": 5, "num_prompts_per_step": 256},
    "generation": {"sim": {"latency": {"distribution": "constant", "mean_seconds": 0.1}}},
}


def _attempts_of(raw: bytes) -> list[int]:
    """The attempt ids in a raw `refill.generate` message (one attempt or a bundle) as kombu
    stores it in Redis."""
    message = json.loads(raw)
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    return [int(item["attempt_id"]) for item in args[0].get("bundle", [args[0]])]


def _resent_train_steps(session, run_id: int) -> int:
    steps = list(session.scalars(select(Outbox.step).where(Outbox.run_id == run_id, Outbox.kind == "train_step")))
    return len(steps) - len(set(steps))


def test_flushall_mid_run(fleet, fault_ledger) -> None:
    """2. Every message in Redis is lost; the ledger settles each lost attempt (the reaper
    re-dispatches it once generation.queue_timeout_seconds passed, unless its slot was filled
    otherwise first) and re-sends a lost train_step."""
    run_id = fleet.create_run(fault_ledger, merged(FAULT_RUN, BACKLOG))
    client = redis_client()

    def backlog(session) -> bool:
        version = session.scalar(select(Run.weight_version).where(Run.id == run_id))
        if version < 1:
            return False
        return sum(len(_attempts_of(raw)) for raw in client.lrange(f"{fleet.prefix}generate", 0, -1)) >= 5

    def flush() -> tuple[list[int], int]:
        # Read what is lost and flush in one transaction: nothing slips in between.
        pipe = client.pipeline(transaction=True)
        pipe.lrange(f"{fleet.prefix}generate", 0, -1).llen(f"{fleet.prefix}results").flushall()
        waiting, results, _ = pipe.execute()
        return [a for raw in waiting for a in _attempts_of(raw)], results

    try:
        result = drive_with_fault(fleet, fault_ledger, run_id, when=backlog, fault=flush)
    finally:
        client.close()
    lost, lost_results = result.injected
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        resent = _resent_train_steps(session, run_id)
        ends = [
            (a.state, a.failure_kind, a.error or "")
            for a in session.scalars(select(Attempt).where(Attempt.id.in_(lost)))
        ]
    reaped = sum(kind == "infra" and "waited on the generate queue" in error for _, kind, error in ends)
    cancelled = sum(state == "cancelled" for state, _, _ in ends)
    print(facts.line(
        "flushall", result.seconds, generate_messages_lost=len(lost), result_messages_lost=lost_results,
        lost_attempts_reaped=reaped, lost_attempts_cancelled=cancelled, train_steps_resent=resent,
    ))
    assert_nothing_lost(facts, steps=5)
    # Messages were lost. No worker ever ran their attempts; the ledger settled every one:
    # the reaper failed it once its queue timeout passed (and dispatched its prompt again),
    # or its slot was filled otherwise (an over-dispatched extra) and it was cancelled.
    assert len(lost) >= 5 and len(ends) == len(lost)
    assert reaped + cancelled == len(lost), ends


@pytest.mark.skipif(
    urlparse(REDIS_URL).hostname not in ("127.0.0.1", "localhost", "::1"),
    reason="restarts Redis with .ci/run's command, so it must run on this machine",
)
def test_restart_redis_mid_run(fleet, fault_ledger) -> None:
    """3. Redis shuts down (nosave) and starts again empty; workers, consumer and controller
    reconnect, and the run completes."""
    run_id = fleet.create_run(fault_ledger, merged(FAULT_RUN, {"grpo": {"max_num_steps": 6}}))
    pids = {name: process.pid for name, process in fleet.workers.items()}

    def halfway(session) -> bool:
        return session.scalar(select(Run.weight_version).where(Run.id == run_id)) >= 2

    result = drive_with_fault(fleet, fault_ledger, run_id, when=halfway, fault=restart_redis)
    with fault_ledger.session() as session:
        facts = fault_facts(session, run_id)
        resent = _resent_train_steps(session, run_id)
    print(facts.line("restart-redis", result.seconds, down_seconds=round(result.injected, 1), train_steps_resent=resent))
    assert_nothing_lost(facts, steps=6)
    # The same worker processes carried on: they reconnected rather than died.
    assert all(fleet.alive(name) for name in pids), {n: fleet.alive(n) for n in pids}
    for name in pids:
        assert "Connection to broker lost" in fleet.log(name) or name not in fleet.roles
