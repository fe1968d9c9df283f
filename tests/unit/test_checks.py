"""`refill.admin.invariants` on both ledgers (PostgreSQL and SQLite), on runs driven through the
ledger API by hand (tests/support/driver.py): healthy runs in several states pass, and each
kind of corruption is named with its run, step, slot and attempt.

A corruption is written and checked inside one transaction that is then rolled back, so the
shared PostgreSQL test database is left as it was. Where a CHECK constraint forbids the corrupt
row, the test bypasses it openly: on PostgreSQL it drops the constraint inside that transaction
(DDL is transactional, so the rollback restores it); SQLite cannot drop a constraint, so the test
sets `PRAGMA ignore_check_constraints` on its connection for the duration (and resets it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import text

from refill.admin.invariant_types import Violation
from refill.admin.invariants import CHECKS, run_checks
from refill.admin.snapshot import read_snapshot
from refill.models.db import Ledger
from refill.models.results import Outcome
from tests.support import invariants
from tests.support.driver import FLAT, Driver


def report(ledger: Ledger, run_id: int) -> list[Violation]:
    with read_snapshot(ledger) as session:
        return run_checks(session, run_id).violations


@contextmanager
def bypassing(session: Any, table: str, constraint: str) -> Iterator[None]:
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


def tampered(ledger: Ledger, run_id: int, *statements: str, bypass: tuple[str, str] | None = None, **params: Any) -> list[Violation]:
    """Run `statements`, then every check, in one transaction that is rolled back."""
    with ledger.sessions() as session:
        try:
            if bypass is not None:
                with bypassing(session, *bypass):
                    for statement in statements:
                        session.execute(text(statement), params)
                    return run_checks(session, run_id).violations
            for statement in statements:
                session.execute(text(statement), params)
            return run_checks(session, run_id).violations
        finally:
            session.rollback()


@pytest.fixture
def d(ledger: Ledger) -> Driver:
    """A running run: step 0 trained; step 1 open with slot 0 filtered (a replacement in
    flight), slot 1 committed, the rest in flight; step 2 admitted."""
    driver = Driver(ledger, check=False)
    driver.admit()
    driver.fill_step(0)
    assert driver.train(0)
    driver.admit()
    assert driver.filter_slot(1, 0).outcome is Outcome.FILTERED
    assert driver.commit_slot(1, 1).outcome is Outcome.COMMITTED
    return driver


def where(v: Violation) -> tuple[str, int | None, int | None, int | None]:
    return v.check, v.step, v.slot, v.attempt


def test_a_healthy_running_run_passes_every_check(d: Driver) -> None:
    with read_snapshot(d.ledger) as session:
        result = run_checks(session, d.run_id)
        assert [r.name for r in result.results] == [c.name for c in CHECKS]
        assert result.ok, [str(v) for v in result.violations]
        # The colleague's test helper agrees.
        assert invariants.ledger_violations(session, d.run_id) == []


def test_a_finished_run_and_a_stopped_run_pass(ledger: Ledger) -> None:
    driver = Driver(ledger, check=False)
    for step in range(3):
        driver.admit()
        driver.fill_step(step)
        assert driver.train(step)
    assert driver.run().status == "completed"
    assert report(ledger, driver.run_id) == []
    stopped = Driver(ledger, check=False)
    stopped.admit()
    stopped.filter_slot(0, 2)
    stopped.stop()
    assert stopped.run().status == "stopped"
    assert report(ledger, stopped.run_id) == []


def test_a_run_that_exhausted_a_filter_budget_passes(ledger: Ledger) -> None:
    """Filtered past its budget is legal exactly when the run failed for it."""
    driver = Driver(ledger, check=False)
    driver.admit()
    for _ in range(4):  # budget 3: the fourth zero-variance group fails the run
        driver.filter_slot(0, 1)
    run = driver.run()
    assert (run.status, run.end_reason) == ("failed", "budget_exhausted")
    assert report(ledger, driver.run_id) == []
    with ledger.sessions() as session:
        session.execute(text("UPDATE runs SET status = 'completed', end_reason = 'max_num_steps' WHERE id = :r"), {"r": driver.run_id})
        found = run_checks(session, driver.run_id).violations
        session.rollback()
    assert [where(v) for v in found] == [("budget_exceeded", 0, 1, None)]
    assert "filtered 4 times, past its budget of 3" in found[0].message


def test_an_open_slot_without_a_live_attempt(d: Driver) -> None:
    live = d.live_of(1, 2).id
    found = tampered(d.ledger, d.run_id, "UPDATE attempts SET state = 'cancelled' WHERE id = :a", a=live)
    assert [where(v) for v in found] == [("live_attempts", 1, 2, None)]
    assert "open slot has 0 live attempts [], not exactly 1" in found[0].message


def test_a_group_in_two_slots(d: Driver) -> None:
    g = d.slot(0, 0).group_attempt_id
    h = d.slot(0, 1).group_attempt_id
    # The unique index on slots.group_attempt_id forbids this row: drop it (rolled back after).
    found = tampered(
        d.ledger,
        d.run_id,
        "DROP INDEX ix_slots_group_attempt_id",
        "UPDATE slots SET group_attempt_id = :g WHERE run_id = :r AND step = 0 AND idx = 1",
        g=g,
        r=d.run_id,
    )
    assert ("slot_committed_twice", 0, 0, g) in map(where, found)
    assert ("slot_committed_twice", 0, 1, g) in map(where, found)
    assert ("slot_committed_twice", 0, None, h) in map(where, found)  # trained, now in no slot
    assert ("group_placement", 0, 1, h) in map(where, found)


def test_a_trained_zero_variance_group(d: Driver) -> None:
    g = d.slot(0, 3).group_attempt_id
    found = tampered(
        d.ledger, d.run_id, "UPDATE groups SET rewards = :flat WHERE attempt_id = :g", g=g, flat=str(FLAT)
    )
    assert [where(v) for v in found] == [("zero_variance_trained", 0, 3, g)]
    assert "trained in step 0" in found[0].message


def test_a_filtered_attempt_with_spread(d: Driver) -> None:
    (filtered,) = d.attempts(1, 0, state="filtered")
    found = tampered(
        d.ledger, d.run_id, "UPDATE attempts SET rewards = :spread WHERE id = :a", a=filtered.id, spread="[0.0, 1.0, 0.0, 1.0]"
    )
    assert [where(v) for v in found] == [("zero_variance_trained", 1, 0, filtered.id)]


def test_a_filter_budget_overrun(d: Driver) -> None:
    # CHECK (filter_replacements <= filter_budget) forbids it: bypassed for the transaction.
    found = tampered(
        d.ledger,
        d.run_id,
        "UPDATE slots SET filter_replacements = 4, filtered = 4 WHERE run_id = :r AND step = 1 AND idx = 0",
        bypass=("slots", "ck_slots_filter_budget"),
        r=d.run_id,
    )
    messages = [v.message for v in found if where(v) == ("budget_exceeded", 1, 0, None)]
    assert "4 filter replacements, past the dynamic-sampling budget of 3" in messages
    assert "counts 4 filtered groups, but 1 filtered attempts served it" in messages


def test_a_raised_budget_that_hides_an_overrun(d: Driver) -> None:
    """No constraint is broken: the slot's budget column was raised to fit its count."""
    found = tampered(
        d.ledger,
        d.run_id,
        "UPDATE slots SET filter_budget = 9 WHERE run_id = :r AND step = 1 AND idx = 0",
        r=d.run_id,
    )
    assert [where(v) for v in found] == [("budget_exceeded", 1, 0, None)]
    assert "filter budget is 9, but the run's config says" in found[0].message


def test_a_stale_group(d: Driver) -> None:
    g = d.slot(1, 1).group_attempt_id
    found = tampered(d.ledger, d.run_id, "UPDATE groups SET weight_version = -1 WHERE attempt_id = :g", g=g)
    assert [where(v) for v in found] == [("staleness_bound", 1, 1, g)]
    assert "staleness 2, past max_lookahead_versions=1" in found[0].message


def test_a_released_step_that_is_not_full(d: Driver) -> None:
    g = d.slot(0, 2).group_attempt_id
    found = tampered(
        d.ledger,
        d.run_id,
        "UPDATE slots SET status = 'open', group_attempt_id = NULL WHERE run_id = :r AND step = 0 AND idx = 2",
        r=d.run_id,
    )
    assert ("released_step_not_full", 0, 2, None) in map(where, found)
    assert ("released_step_not_full", 0, None, None) in map(where, found)
    assert ("step_counters", 0, None, None) in map(where, found)
    assert ("slot_committed_twice", 0, None, g) in map(where, found)


def test_a_weight_version_gap(d: Driver) -> None:
    found = tampered(
        d.ledger, d.run_id, "UPDATE weight_versions SET trained_step = 5 WHERE run_id = :r AND version = 1", r=d.run_id
    )
    assert [where(v) for v in found] == [("weight_versions", 5, None, None)]
    found = tampered(d.ledger, d.run_id, "DELETE FROM weight_versions WHERE run_id = :r AND version = 1", r=d.run_id)
    assert any(v.check == "weight_versions" and "missing [1]" in v.message for v in found)


def test_violations_read_well() -> None:
    v = Violation("staleness_bound", "too stale", 3, step=4, slot=5, attempt=6)
    assert str(v) == "staleness_bound: run 3, step 4, slot 5, attempt 6: too stale"
    assert Violation("weight_versions", "gap", 3).where == "run 3"
    assert run_checks.__doc__ and "LookupError" in run_checks.__doc__


def test_an_unknown_run(ledger: Ledger) -> None:
    with read_snapshot(ledger) as session, pytest.raises(LookupError, match="there is no run 4242"):
        run_checks(session, 4242)
