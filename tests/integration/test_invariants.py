"""`refill check`'s invariants find each kind of broken ledger, where it is broken.

Every integration test ends with `assert_ledger_consistent` (tests/support/invariants.py),
which is `refill.admin.invariants.run_checks`: the checks `refill check RUN` ships. These tests
break a healthy ledger one row at a time and assert what the product reports: the check that
fires and its location (step, slot, attempt), so that a check that went quiet, or one that
blames the wrong slot, fails here.

Each corruption is written and checked in one transaction that is then rolled back. Where a
CHECK constraint or unique index forbids the corrupt row, the test bypasses it openly inside
that transaction: the checks must not trust the schema (a ledger restored from a dump, or a
constraint dropped by hand, must still be caught).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session

from refill.admin.invariant_types import LIVE, Violation
from refill.admin.invariants import CHECKS, run_checks
from refill.models.payload import payload_name
from refill.models.payload_store import FileStore
from refill.models.settings import LedgerSettings
from refill.models.tables import (
    Attempt,
    Group,
    PromptDraw,
    Run,
    Slot,
    SparePrompt,
    Step,
    WeightVersion,
)
from tests.support import invariants
from tests.support.driver import Driver
from tests.support.play import play

Where = tuple[str, int | None, int | None, int | None]
Tamper = Callable[[Session], Any]


@pytest.fixture
def d(ledger) -> Driver:  # type: ignore[no-untyped-def]
    """A running run: step 0 trained; step 1 open with slot 0 filtered (its replacement in
    flight), slot 1 committed, slots 2 and 3 in flight; step 2 admitted."""
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


@contextmanager
def bypassing(session: Session, table: str, constraint: str) -> Iterator[None]:
    """Let rows break one CHECK constraint for the rest of this transaction."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"ALTER TABLE {table} DROP CONSTRAINT {constraint}"))
        yield  # the caller's rollback brings the constraint back
    else:
        session.execute(text("PRAGMA ignore_check_constraints = ON"))
        try:
            yield
        finally:
            session.execute(text("PRAGMA ignore_check_constraints = OFF"))


@contextmanager
def tampered(d: Driver, tamper: Tamper, bypass: tuple[str, str] | None = None) -> Iterator[Session]:
    """A session in which `tamper` has broken the ledger; rolled back afterwards."""
    with d.ledger.sessions() as session:
        try:
            if bypass is None:
                tamper(session)
                session.flush()
                yield session
            else:
                with bypassing(session, *bypass):
                    tamper(session)
                    session.flush()
                    yield session
        finally:
            session.rollback()


def found(d: Driver, tamper: Tamper, bypass: tuple[str, str] | None = None) -> list[Violation]:
    """What `refill check` reports once `tamper` has broken the ledger."""
    with tampered(d, tamper, bypass) as session:
        return run_checks(session, d.run_id).violations


def where(violations: list[Violation]) -> set[Where]:
    return {(v.check, v.step, v.slot, v.attempt) for v in violations}


def messages(violations: list[Violation], at: Where) -> list[str]:
    return [v.message for v in violations if (v.check, v.step, v.slot, v.attempt) == at]


def test_healthy_ledger_passes(d: Driver) -> None:
    assert found(d, lambda s: None) == []
    with d.ledger.session() as s:
        invariants.assert_ledger_consistent(s, d.run_id)


# --- live attempts -------------------------------------------------------------------------


def test_open_slot_without_a_live_attempt(d: Driver) -> None:
    live = d.live_of(1, 2).id
    v = found(
        d, lambda s: s.execute(update(Attempt).where(Attempt.id == live).values(state="cancelled"))
    )
    assert where(v) == {("live_attempts", 1, 2, None)}
    assert messages(v, ("live_attempts", 1, 2, None)) == [
        "open slot has 0 live attempts [], not exactly 1 (nothing will ever fill it)"
    ]


def test_open_slot_with_two_live_attempts(d: Driver) -> None:
    live = d.live_of(1, 2)
    added: list[int] = []

    def tamper(s: Session) -> None:
        extra = Attempt(
            run_id=d.run_id,
            step=1,
            slot_idx=2,
            origin_step=1,
            origin_slot=2,
            prompt_id=live.prompt_id,
            try_no=1,
            reason="retry",
            state="queued",
            min_weight_version=0,
            created_at=d.now,
            available_at=d.now,
        )
        s.add(extra)
        s.flush()
        added.append(extra.id)

    v = found(d, tamper)
    assert where(v) == {("live_attempts", 1, 2, added[0])}
    assert messages(v, ("live_attempts", 1, 2, added[0])) == [
        f"open slot has 2 live attempts {[live.id, added[0]]}, not exactly 1"
    ]


def test_settled_slot_with_a_live_attempt(d: Driver) -> None:
    live = d.live_of(1, 2).id
    v = found(d, lambda s: s.execute(update(Attempt).where(Attempt.id == live).values(slot_idx=1)))
    assert where(v) == {("live_attempts", 1, 1, live), ("live_attempts", 1, 2, None)}
    assert messages(v, ("live_attempts", 1, 1, live)) == [
        "committed slot has a live attempt (its step is open, the run running)"
    ]


def test_live_attempts_of_a_run_that_is_not_running(d: Driver) -> None:
    live = {(a.step, a.slot_idx, a.id) for a in d.live()}
    assert len(live) == 7  # step 1's slots 0 (a replacement), 2 and 3; all four of step 2
    v = found(
        d, lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(status="stopped"))
    )
    assert where(v) == {("live_attempts", *place) for place in live}
    assert all(m.endswith("the run stopped)") for m in (x.message for x in v))


def test_live_extra_of_a_run_that_ended(d: Driver) -> None:
    """A live over-dispatch extra (no slot) is fine while the run runs, not after it ended."""
    live = d.live_of(2, 3)

    def tamper(s: Session) -> None:
        s.execute(
            update(Attempt).where(Attempt.id == live.id).values(slot_idx=None, reason="extra")
        )

    assert found(d, tamper) == [
        Violation(
            "live_attempts",
            "open slot has 0 live attempts [], not exactly 1 (nothing will ever fill it)",
            d.run_id,
            2,
            3,
        )
    ]

    def and_stop(s: Session) -> None:
        tamper(s)
        s.execute(
            update(Attempt)
            .where(Attempt.run_id == d.run_id, Attempt.id != live.id, Attempt.state.in_(LIVE))
            .values(state="cancelled")
        )
        s.execute(update(Run).where(Run.id == d.run_id).values(status="stopped"))

    assert where(found(d, and_stop)) == {("live_attempts", 2, None, live.id)}


# --- step counters and released steps -------------------------------------------------------


def test_step_counters(d: Driver) -> None:
    v = found(
        d,
        lambda s: s.execute(
            update(Step).where(Step.run_id == d.run_id, Step.step == 1).values(committed=3)
        ),
    )
    assert where(v) == {("step_counters", 1, None, None)}
    assert messages(v, ("step_counters", 1, None, None)) == [
        "step says 4 slots / 3 committed / 0 shrunk / 0 dropped; its slots say 4 / 1 / 0 / 0"
    ]


def test_released_step_with_an_open_slot(d: Driver) -> None:
    group = d.slot(0, 3).group_attempt_id

    def tamper(s: Session) -> None:
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 0, Slot.idx == 3)
            .values(status="open", group_attempt_id=None)
        )

    v = found(d, tamper)
    assert where(v) == {
        ("released_step_not_full", 0, 3, None),  # an open slot in a trained step
        ("released_step_not_full", 0, None, None),  # 3 committed slots of 4
        ("step_counters", 0, None, None),  # the step still counts 4
        ("slot_committed_twice", 0, None, group),  # trained in step 0, now in no slot
        ("group_placement", 0, 3, group),  # in no slot, yet not parked
    }
    assert messages(v, ("released_step_not_full", 0, 3, None)) == ["slot is open in a trained step"]


# --- groups: one slot each, committed attempts, trained once ----------------------------------


def test_group_in_no_slot_and_not_parked(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id

    def tamper(s: Session) -> None:
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 1)
            .values(status="open", group_attempt_id=None)
        )
        s.execute(update(Step).where(Step.run_id == d.run_id, Step.step == 1).values(committed=0))

    v = found(d, tamper)
    assert where(v) == {("group_placement", 1, 1, group), ("live_attempts", 1, 1, None)}
    assert messages(v, ("group_placement", 1, 1, group)) == [
        "group is not parked and sits in 0 slots (a group is in one slot, or parked)"
    ]


def test_parked_group_in_a_slot(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    v = found(
        d, lambda s: s.execute(update(Group).where(Group.attempt_id == group).values(parked=True))
    )
    assert where(v) == {("group_placement", 1, 1, group)}


def test_group_in_two_slots(d: Driver) -> None:
    g = d.slot(1, 1).group_attempt_id
    h = d.slot(0, 1).group_attempt_id

    def tamper(s: Session) -> None:
        # The unique index on slots.group_attempt_id forbids this row: dropped (rolled back after).
        s.execute(text("DROP INDEX ix_slots_group_attempt_id"))
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 0, Slot.idx == 1)
            .values(group_attempt_id=g)
        )

    v = found(d, tamper)
    assert {("slot_committed_twice", 0, 1, g), ("slot_committed_twice", 1, 1, g)} <= where(v)
    assert ("slot_committed_twice", 0, None, h) in where(
        v
    )  # h was trained in step 0 and is in no slot
    assert ("group_placement", 0, 1, h) in where(v)  # h in no slot and not parked
    assert messages(v, ("slot_committed_twice", 1, 1, g)) == [
        f"group {g} sits in 2 slots: (0, 1), (1, 1)"
    ]


def test_open_slot_holding_a_group(d: Driver) -> None:
    """Only a committed slot holds a group (CHECK committed_has_group, bypassed here)."""
    group = d.slot(1, 1).group_attempt_id

    def tamper(s: Session) -> None:
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 1)
            .values(status="open")
        )
        s.execute(update(Step).where(Step.run_id == d.run_id, Step.step == 1).values(committed=0))

    v = found(d, tamper, bypass=("slots", "ck_slots_committed_has_group"))
    assert where(v) == {("group_placement", 1, 1, group), ("live_attempts", 1, 1, None)}
    assert messages(v, ("group_placement", 1, 1, group)) == [
        f"open slot holds group {group} (only a committed slot holds a group)"
    ]


def test_committed_slot_without_a_group(d: Driver) -> None:
    """CHECK committed_has_group forbids it too; bypassed."""
    group = d.slot(1, 1).group_attempt_id

    def tamper(s: Session) -> None:
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 1)
            .values(group_attempt_id=None)
        )

    v = found(d, tamper, bypass=("slots", "ck_slots_committed_has_group"))
    assert where(v) == {("slot_committed_twice", 1, 1, None), ("group_placement", 1, 1, group)}
    assert messages(v, ("slot_committed_twice", 1, 1, None)) == ["committed slot holds no group"]


def test_committed_attempt_without_a_group_row(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    v = found(d, lambda s: s.execute(delete(Group).where(Group.attempt_id == group)))
    assert where(v) == {("slot_committed_twice", 1, 1, group), ("group_placement", 1, 1, group)}
    assert messages(v, ("slot_committed_twice", 1, 1, group)) == [
        f"slot holds attempt {group}, which has no group row"
    ]
    assert messages(v, ("group_placement", 1, 1, group)) == [
        "attempt is committed but has no group"
    ]


def test_group_of_an_attempt_that_did_not_commit(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    v = found(
        d, lambda s: s.execute(update(Attempt).where(Attempt.id == group).values(state="cancelled"))
    )
    assert where(v) == {("slot_committed_twice", 1, 1, group), ("group_placement", 1, 1, group)}
    assert messages(v, ("slot_committed_twice", 1, 1, group)) == [
        f"slot holds attempt {group}, which is cancelled, not committed"
    ]
    assert messages(v, ("group_placement", 1, 1, group)) == ["attempt is cancelled but has a group"]


def test_group_marked_trained_in_another_step(d: Driver) -> None:
    group = d.slot(0, 2).group_attempt_id
    v = found(
        d,
        lambda s: s.execute(update(Group).where(Group.attempt_id == group).values(trained_step=1)),
    )
    assert where(v) == {
        ("slot_committed_twice", 0, 2, group),
        ("slot_committed_twice", 1, None, group),
    }
    assert messages(v, ("slot_committed_twice", 1, None, group)) == [
        f"group {group} is marked trained in step 1, which is not trained"
    ]


# --- zero variance ------------------------------------------------------------------------------


def test_zero_variance_group_in_a_slot(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    v = found(
        d,
        lambda s: s.execute(
            update(Group).where(Group.attempt_id == group).values(zero_variance=True)
        ),
    )
    assert where(v) == {("zero_variance_trained", 1, 1, group)}
    assert messages(v, ("zero_variance_trained", 1, 1, group)) == [
        f"group {group} is committed although it is flagged zero-variance and grpo.use_dynamic_sampling is on"
    ]


def test_filtered_attempt_that_is_not_zero_variance(d: Driver) -> None:
    (filtered,) = d.attempts(1, 0, state="filtered")

    def tamper(s: Session) -> None:
        s.execute(update(Attempt).where(Attempt.id == filtered.id).values(zero_variance=False))
        # and the run's counters with it, so that only the filter's decision is wrong
        s.execute(update(Run).where(Run.id == d.run_id).values(zero_variance_groups=Run.zero_variance_groups - 1))

    v = found(d, tamper)
    assert where(v) == {("zero_variance_trained", 1, 0, filtered.id)}


def test_run_group_counts_that_disagree_with_the_attempts(d: Driver) -> None:
    run = d.run()
    v = found(d, lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(scored_groups=Run.scored_groups + 2)))
    assert where(v) == {("step_counters", None, None, None)}
    assert messages(v, ("step_counters", None, None, None)) == [
        f"run counts {run.zero_variance_groups} zero-variance groups of {run.scored_groups + 2} scored; "
        f"its attempts say {run.zero_variance_groups} of {run.scored_groups}"
    ]


def test_spare_pool_count_that_disagrees_with_the_pool(d: Driver) -> None:
    pool = len(d.spare_pool())
    assert d.run().spare_prompts_available == pool > 0
    v = found(
        d,
        lambda s: s.execute(
            update(Run).where(Run.id == d.run_id).values(spare_prompts_available=Run.spare_prompts_available - 1)
        ),
    )
    assert where(v) == {("step_counters", None, None, None)}
    assert messages(v, ("step_counters", None, None, None)) == [
        f"run counts {pool - 1} spare prompts available; the pool holds {pool} untaken"
    ]


# --- staleness and admission -------------------------------------------------------------------


def test_stale_group_in_a_slot(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    v = found(
        d,
        lambda s: s.execute(
            update(Group).where(Group.attempt_id == group).values(weight_version=-1)
        ),
    )
    assert where(v) == {("staleness_bound", 1, 1, group)}
    assert messages(v, ("staleness_bound", 1, 1, group)) == [
        f"group {group} of weights v-1 sits in step 1: staleness 2, past max_lookahead_versions=1"
    ]


def test_group_newer_than_its_step(d: Driver) -> None:
    group = d.slot(1, 1).group_attempt_id
    v = found(
        d,
        lambda s: s.execute(
            update(Group).where(Group.attempt_id == group).values(weight_version=2)
        ),
    )
    assert where(v) == {("staleness_bound", 1, 1, group)}


def test_live_attempt_below_its_floor(d: Driver) -> None:
    live = d.live_of(2, 0).id
    v = found(
        d,
        lambda s: s.execute(update(Attempt).where(Attempt.id == live).values(min_weight_version=0)),
    )
    assert where(v) == {("staleness_bound", 2, 0, live)}


def test_step_admitted_before_its_weights(d: Driver) -> None:
    early = d.now - timedelta(seconds=1)
    d.tick(0)
    with d.ledger.session() as s:
        published = s.get(WeightVersion, (d.run_id, 1)).created_at  # type: ignore[union-attr]
    assert published is not None and early < published

    def tamper(s: Session) -> None:
        s.execute(
            update(Step).where(Step.run_id == d.run_id, Step.step == 2).values(admitted_at=early)
        )

    v = found(d, tamper)
    assert where(v) == {("staleness_bound", 2, None, None)}
    assert messages(v, ("staleness_bound", 2, None, None)) == [
        "step was admitted before weight version 1 existed"
    ]


# --- budgets ------------------------------------------------------------------------------------


def test_filtered_past_the_budget_in_a_running_run(d: Driver) -> None:
    v = found(
        d,
        lambda s: s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 0)
            .values(filtered=4)
        ),
    )
    assert where(v) == {("budget_exceeded", 1, 0, None)}
    assert (
        "filtered 4 times, past its budget of 3, but the run is running rather than failed with budget_exhausted"
        in messages(v, ("budget_exceeded", 1, 0, None))
    )


def test_drop_replacements_past_the_budget(d: Driver) -> None:
    """CHECK drop_budget forbids it; bypassed."""

    def tamper(s: Session) -> None:
        s.execute(
            update(Slot)
            .where(Slot.run_id == d.run_id, Slot.step == 1, Slot.idx == 2)
            .values(drop_replacements=9, drops=9)
        )

    v = found(d, tamper, bypass=("slots", "ck_slots_drop_budget"))
    assert where(v) == {("budget_exceeded", 1, 2, None)}
    assert any(
        m.startswith("9 drop replacements, past the fault-tolerance budget of")
        for m in messages(v, ("budget_exceeded", 1, 2, None))
    )


def test_consecutive_drops_past_the_limit_in_a_running_run(d: Driver) -> None:
    limit = LedgerSettings.from_config(d.config).max_consecutive_dropped_prompts
    v = found(
        d,
        lambda s: s.execute(
            update(Run).where(Run.id == d.run_id).values(consecutive_dropped=limit + 1)
        ),
    )
    assert where(v) == {("budget_exceeded", None, None, None)}
    assert messages(v, ("budget_exceeded", None, None, None)) == [
        f"{limit + 1} consecutive dropped prompts, past rollout_failure.max_consecutive_dropped_prompts={limit}, "
        "but the run is running rather than failed with fleet_failed"
    ]
    # At the limit it holds; past it, a run that failed for it is right.
    assert (
        found(
            d,
            lambda s: s.execute(
                update(Run).where(Run.id == d.run_id).values(consecutive_dropped=limit)
            ),
        )
        == []
    )

    def failed_for_it(s: Session) -> None:
        s.execute(
            update(Attempt)
            .where(Attempt.run_id == d.run_id, Attempt.state.in_(LIVE))
            .values(state="cancelled")
        )
        s.execute(
            update(Run)
            .where(Run.id == d.run_id)
            .values(consecutive_dropped=limit + 1, status="failed", end_reason="fleet_failed")
        )

    assert "budget_exceeded" not in {x.check for x in found(d, failed_for_it)}


# --- weight versions -------------------------------------------------------------------------


def test_weight_versions_and_training_order(d: Driver) -> None:
    v = found(
        d, lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(weight_version=2))
    )
    assert where(v) == {("weight_versions", None, None, None), ("weight_versions", 1, None, None)}
    assert messages(v, ("weight_versions", None, None, None)) == [
        "run is at v2; versions must be 0..2 without gaps (missing [2], beyond the run's version [])"
    ]
    assert messages(v, ("weight_versions", 1, None, None)) == [
        "v2 exists, but step 1 is not trained"
    ]


def test_version_trained_from_the_wrong_step(d: Driver) -> None:
    v = found(
        d,
        lambda s: s.execute(
            update(WeightVersion)
            .where(WeightVersion.run_id == d.run_id, WeightVersion.version == 1)
            .values(trained_step=5)
        ),
    )
    assert where(v) == {("weight_versions", 5, None, None)}


# --- messages and the spare pool ---------------------------------------------------------------


def test_released_step_without_metrics(d: Driver) -> None:
    v = found(
        d,
        lambda s: s.execute(
            text("DELETE FROM step_metrics WHERE run_id = :r AND step = 0"), {"r": d.run_id}
        ),
    )
    assert where(v) == {("outbox", 0, None, None)}


def test_spare_prompt_taken_by_the_wrong_attempt(d: Driver) -> None:
    other = d.live_of(2, 1)
    with d.ledger.session() as s:
        taken = s.scalars(
            select(SparePrompt.id).where(
                SparePrompt.run_id == d.run_id, SparePrompt.taken_at.is_not(None)
            )
        ).all()
    assert len(taken) == 1  # the replacement of the filtered (1, 0)

    def tamper(s: Session) -> None:
        s.execute(
            update(SparePrompt)
            .where(SparePrompt.run_id == d.run_id, SparePrompt.taken_at.is_not(None))
            .values(taken_by_attempt=other.id)
        )

    v = found(d, tamper)
    assert where(v) == {("spare_pool", 2, 1, other.id)}
    assert messages(v, ("spare_pool", 2, 1, other.id))[0].endswith(
        f"was taken by attempt {other.id} on prompt {other.prompt_id}"
    )


# --- pre-rollout skipping (issue 15) ----------------------------------------------------------


@pytest.fixture
def skipping(ledger) -> Driver:  # type: ignore[no-untyped-def]
    """A run played to the end of its three epochs, skipping its always-solved prompts."""
    driver = Driver(
        ledger,
        {
            "grpo": {"max_num_steps": 50, "max_num_epochs": 3, "dynamic_sampling_max_replacements_per_slot": 16},
            "data": {"prompt_skipping": {"enabled": True, "exploration_rate": 0.05}},
        },
        num_prompts=16,
        check=False,
    )
    assert play(driver).status == "completed"
    with ledger.session() as s:
        assert invariants.ledger_violations(s, driver.run_id) == []
        assert s.scalar(select(func.count()).where(PromptDraw.run_id == driver.run_id, PromptDraw.skipped.is_(True)))
    return driver


def _one_draw(d: Driver, skipped: bool) -> tuple[int, int]:
    with d.ledger.session() as s:
        row = s.scalars(
            select(PromptDraw)
            .where(PromptDraw.run_id == d.run_id, PromptDraw.epoch == 1, PromptDraw.skipped.is_(skipped))
            .order_by(PromptDraw.position)
        ).first()
        assert row is not None
        return row.epoch, row.position


def test_a_skip_that_does_not_replay(skipping: Driver) -> None:
    epoch, place = _one_draw(skipping, skipped=True)
    v = found(
        skipping,
        lambda s: s.execute(
            text(
                "UPDATE prompt_draws SET probability = (uniform + probability) / 2 "
                "WHERE run_id = :r AND epoch = :e AND position = :p"
            ),
            {"r": skipping.run_id, "e": epoch, "p": place},
        ),
    )
    assert where(v) == {("prompt_draws", None, None, None)}
    (message,) = messages(v, ("prompt_draws", None, None, None))
    assert message.startswith(f"epoch {epoch}, place {place}: skip probability ")


def test_a_place_of_an_epoch_never_drawn(skipping: Driver) -> None:
    epoch, place = _one_draw(skipping, skipped=False)
    v = found(
        skipping,
        lambda s: s.execute(
            text("DELETE FROM prompt_draws WHERE run_id = :r AND epoch = :e AND position = :p"),
            {"r": skipping.run_id, "e": epoch, "p": place},
        ),
    )
    assert where(v) == {("prompt_draws", None, None, None)}
    found_messages = messages(v, ("prompt_draws", None, None, None))
    assert any(m.startswith(f"epoch {epoch}: 15 places recorded") for m in found_messages)
    assert any("the loader never took" in m for m in found_messages)


def test_skipped_prompts_of_a_step_that_disagree_with_the_draws(skipping: Driver) -> None:
    v = found(
        skipping,
        lambda s: s.execute(
            text("UPDATE step_metrics SET skipped_prompts = skipped_prompts + 1 WHERE run_id = :r AND step = 1"),
            {"r": skipping.run_id},
        ),
    )
    assert where(v) == {("prompt_draws", 1, None, None)}


def test_draws_of_a_run_that_does_not_skip(d: Driver) -> None:
    def tamper(s: Session) -> None:
        prompt = s.scalars(select(Slot.prompt_id).where(Slot.run_id == d.run_id)).first()
        s.add(
            PromptDraw(
                run_id=d.run_id, epoch=5, position=0, prompt_id=prompt, step=0, skipped=False, streak=0,
                probability=0.0, uniform=0.5, drawn_at=d.now,
            )
        )

    v = found(d, tamper)
    assert where(v) == {("prompt_draws", None, None, None)}


# --- the test helper is `refill check` -------------------------------------------------------


def test_the_helper_reports_what_refill_check_reports(d: Driver) -> None:
    def tamper(s: Session) -> None:
        s.execute(update(Run).where(Run.id == d.run_id).values(weight_version=2))
        s.execute(update(Step).where(Step.run_id == d.run_id, Step.step == 1).values(committed=3))

    with tampered(d, tamper) as s:
        product = run_checks(s, d.run_id).violations
        assert len(product) == 3
        assert invariants.ledger_violations(s, d.run_id) == [str(v) for v in product]
        assert invariants.ledger_violations(s, d.run_id, only=["step_counters"]) == [
            str(v) for v in product if v.check == "step_counters"
        ]
        assert invariants.ledger_violations(s, d.run_id, only=["live_attempts"]) == []
        with pytest.raises(ValueError, match="no check named"):
            invariants.ledger_violations(s, d.run_id, only=["weight_version"])


def test_assert_lists_every_violation(d: Driver) -> None:
    def tamper(s: Session) -> None:
        s.execute(update(Run).where(Run.id == d.run_id).values(weight_version=2))

    with tampered(d, tamper) as s:
        product = run_checks(s, d.run_id).violations
        with pytest.raises(AssertionError) as raised:
            invariants.assert_ledger_consistent(s, d.run_id)
    message = str(raised.value)
    assert message.startswith(f"run {d.run_id} breaks the ledger's invariants")
    assert len(product) == 2
    for violation in product:
        assert str(violation) in message


def test_every_check_of_refill_check_is_asserted_here() -> None:
    """A check added to `refill check` gets its corruption in this module too."""
    source = Path(__file__).read_text()
    assert [c.name for c in CHECKS if f'("{c.name}", ' not in source] == []


# --- stored payloads (the claim check) -------------------------------------------------------


def test_committed_group_whose_stored_payload_is_missing_or_cut(d: Driver, tmp_path: Path) -> None:
    group = d.slot(1, 1).group_attempt_id
    assert group is not None
    store = FileStore.of_run(tmp_path)
    name = payload_name(group, "0123456789abcdef")

    def stored_elsewhere(s: Session) -> None:
        s.execute(update(Run).where(Run.id == d.run_id).values(run_dir=str(tmp_path)))
        s.execute(
            update(Group)
            .where(Group.attempt_id == group)
            .values(rollout=None, completion_texts=text("NULL"), payload_ref=name, payload_bytes=10, payload_checksum="sha256:" + "0" * 64)
        )

    v = found(d, stored_elsewhere)
    assert where(v) == {("payloads", None, None, group)}
    assert messages(v, ("payloads", None, None, group)) == [f"the payload of committed group {group}, {store.path(name)}, is missing"]
    store.path(name).parent.mkdir(parents=True)
    store.path(name).write_bytes(b"123456789")
    v = found(d, stored_elsewhere)
    assert messages(v, ("payloads", None, None, group)) == [
        f"the payload of committed group {group}, {store.path(name)}, has 9 bytes, its worker wrote 10"
    ]
