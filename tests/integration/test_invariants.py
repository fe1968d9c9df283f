"""The invariant checks of tests/support/invariants.py find each kind of broken ledger.

Every integration test ends with `assert_ledger_consistent`; these tests break a healthy
ledger one row at a time to show that the check would have noticed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from refill.models.tables import (
    Attempt,
    Group,
    Outbox,
    Run,
    Slot,
    SparePrompt,
    Step,
)
from tests.support import invariants
from tests.support.driver import Driver


@pytest.fixture
def d(ledger) -> Driver:  # type: ignore[no-untyped-def]
    driver = Driver(ledger, check=False)
    driver.admit()
    driver.fill_step(0)
    assert driver.train(0)
    driver.admit()
    driver.filter_slot(1, 0)
    driver.commit_slot(1, 1)
    with ledger.session() as s:
        assert invariants.ledger_violations(s, driver.run_id) == []
    return driver


def broken(d: Driver, tamper: Callable[[Any], None]) -> list[str]:
    d.ledger.transaction(tamper)
    with d.ledger.session() as s:
        return invariants.ledger_violations(s, d.run_id)


def test_healthy_ledger_passes(d: Driver) -> None:
    with d.ledger.session() as s:
        invariants.assert_ledger_consistent(s, d.run_id)


def test_open_slot_without_a_live_attempt(d: Driver) -> None:
    live = d.live_of(1, 2).id
    found = broken(d, lambda s: s.execute(update(Attempt).where(Attempt.id == live).values(state="cancelled")))
    assert "open slot (1, 2) has 0 live attempts, not 1" in found


def test_open_slot_with_two_live_attempts(d: Driver) -> None:
    live = d.live_of(1, 2)

    def tamper(s):  # type: ignore[no-untyped-def]
        s.add(
            Attempt(
                run_id=d.run_id, step=1, slot_idx=2, origin_step=1, origin_slot=2, prompt_id=live.prompt_id,
                try_no=1, reason="retry", state="queued", min_weight_version=0, created_at=d.now,
                available_at=d.now,
            )
        )

    assert "open slot (1, 2) has 2 live attempts, not 1" in broken(d, tamper)


def test_settled_slot_with_a_live_attempt(d: Driver) -> None:
    live = d.live_of(1, 2).id
    found = broken(d, lambda s: s.execute(update(Attempt).where(Attempt.id == live).values(slot_idx=1)))
    assert "committed slot (1, 1) of a open step has 1 live attempts" in found


def test_step_counters(d: Driver) -> None:
    found = broken(d, lambda s: s.execute(update(Step).where(Step.run_id == d.run_id, Step.step == 1).values(committed=3)))
    assert "step 1 says 4 slots / 3 committed / 0 shrunk / 0 dropped, its slots say 4 / 1 / 0 / 0" in found


def test_released_step_with_an_open_slot(d: Driver) -> None:
    def tamper(s):  # type: ignore[no-untyped-def]
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 0, Slot.idx == 3)
            .values(status="open", group_attempt_id=None)
        )

    found = broken(d, tamper)
    assert "slot (0, 3) is open in a step that is not" in found
    assert any(line.startswith("step 0 says 4 slots / 4 committed") for line in found)


def test_group_in_no_slot_and_not_parked(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id

    def tamper(s):  # type: ignore[no-untyped-def]
        s.execute(
            update(Slot).where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 1).values(status="open", group_attempt_id=None)
        )
        s.execute(update(Step).where(Step.run_id == d.run_id, Step.step == 1).values(committed=0))

    found = broken(d, tamper)
    assert f"group {group} is not parked and in 0 slots" in found


def test_zero_variance_group_in_a_slot(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    found = broken(d, lambda s: s.execute(update(Group).where(Group.attempt_id == group).values(zero_variance=True)))
    assert f"slot (1, 1) holds zero-variance group {group} under dynamic sampling" in found


def test_stale_group_in_a_slot(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    found = broken(d, lambda s: s.execute(update(Group).where(Group.attempt_id == group).values(weight_version=-1)))
    assert "slot (1, 1) holds a group of v-1: staleness 2, bound 1" in found


def test_live_attempt_below_its_floor(d: Driver) -> None:
    live = d.live_of(2, 0).id
    found = broken(d, lambda s: s.execute(update(Attempt).where(Attempt.id == live).values(min_weight_version=0)))
    assert f"live attempt {live} for step 2 may generate with v0, below v1" in found


def test_filtered_past_the_budget_in_a_running_run(d: Driver) -> None:
    found = broken(
        d,
        lambda s: s.execute(
            update(Slot).where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 0).values(filtered=4)
        ),
    )
    assert "slot (1, 0) was filtered 4 times past budget 3 but the run is running" in found


def test_weight_versions_and_training_order(d: Driver) -> None:
    found = broken(d, lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(weight_version=2)))
    assert "run is at v2 but has versions [0, 1]" in found
    assert "run is at v2 but trained steps are [0]" in found


def test_step_admitted_before_its_weights(d: Driver) -> None:
    early = d.now - timedelta(seconds=1)

    def tamper(s):  # type: ignore[no-untyped-def]
        step = s.get(Step, (d.run_id, 2))
        step.admitted_at = early

    d.tick(0)
    with d.ledger.session() as s:
        published = s.get(Step, (d.run_id, 0)).trained_at
    assert published is not None and early < published
    assert "step 2 was admitted before weight version 1 existed" in broken(d, tamper)


def test_pending_attempt_without_a_message(d: Driver) -> None:
    pending = d.live_of(2, 1)
    assert pending.state == "pending"
    found = broken(d, lambda s: s.execute(update(Outbox).where(Outbox.attempt_id == pending.id).values(sent_at=d.now)))
    assert f"pending attempt {pending.id} has no unsent generate message" in found


def test_live_attempts_of_a_run_that_is_not_running(d: Driver) -> None:
    found = broken(d, lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(status="stopped")))
    assert any(line.startswith("run is stopped but has") for line in found)


def test_spare_prompt_taken_by_the_wrong_attempt(d: Driver) -> None:
    other = d.live_of(2, 1).id

    def tamper(s):  # type: ignore[no-untyped-def]
        s.execute(
            update(SparePrompt)
            .where(SparePrompt.run_id == d.run_id, SparePrompt.taken_at.is_not(None))
            .values(taken_by_attempt=other)
        )

    assert any(" was taken by an attempt on prompt " in line for line in broken(d, tamper))


def test_assert_lists_every_violation(d: Driver) -> None:
    d.ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(weight_version=2)))
    with d.ledger.session() as s, pytest.raises(AssertionError) as raised:
        invariants.assert_ledger_consistent(s, d.run_id)
    assert f"run {d.run_id} breaks the ledger's invariants" in str(raised.value)
    assert "run is at v2 but has versions [0, 1]" in str(raised.value)


def test_each_check_is_a_plain_function_of_session_and_run(d: Driver) -> None:
    with d.ledger.session() as s:
        for check in invariants.CHECKS:
            assert check(s, d.run_id) == [], check.__name__
