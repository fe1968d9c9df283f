"""SPEC §3.3 and §3.6: the budgets that decide are the ones stored on the slot rows.

A slot's `filter_budget` and `drop_budget` are written from the run's config when its step is
admitted; from then on the consumer reads them from the slot, so a run's budgets are what its
slots say in SQL. The tests change them in SQL, then drive the slots past the config's budgets.

`refill check` flags a slot whose budget differs from the run's config (`budget_exceeded`):
that is the drift these tests make on purpose, so they check the ledger themselves rather than
through the suite's after-test check.
"""

from __future__ import annotations

import re

from sqlalchemy import text

from refill.models import decisions
from refill.models.results import Outcome
from tests.support.driver import Driver
from tests.support.invariants import NAMES, ledger_violations


def store_budget(d: Driver, column: str, step: int, idx: int, budget: int) -> None:
    if column not in ("filter_budget", "drop_budget"):
        raise ValueError(f"not a slot budget column: {column}")
    d.ledger.transaction(
        lambda s: s.execute(
            text(f"UPDATE slots SET {column} = :b WHERE run_id = :r AND step = :s AND idx = :i"),
            {"b": budget, "r": d.run_id, "s": step, "i": idx},
        )
    )


def assert_only_budget_drift(d: Driver, drifted: set[tuple[int, int]]) -> None:
    """Every invariant holds but the budgets' agreement with the config, broken at `drifted`."""
    others = [n for n in NAMES if n != "budget_exceeded"]
    with d.ledger.session() as session:
        assert ledger_violations(session, d.run_id, only=others) == []
        flagged = ledger_violations(session, d.run_id, only=["budget_exceeded"])
    located = [re.search(r", step (\d+), slot (\d+): (?:filter|drop) budget is ", v) for v in flagged]
    assert all(located), flagged
    assert {(int(m[1]), int(m[2])) for m in located if m} == drifted


def test_the_stored_filter_budget_decides(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, check=False)  # the config's budget: 3 replacements per slot
    assert d.admit() == [0, 1]
    d.relay()
    store_budget(d, "filter_budget", 0, 2, 5)
    store_budget(d, "filter_budget", 0, 0, 1)
    # Raised: a fourth and a fifth filtered group are replaced, where the config's 3 would
    # have failed the run at the fourth.
    assert [d.filter_slot(0, 2).outcome for _ in range(5)] == [Outcome.FILTERED] * 5
    slot = d.slot(0, 2)
    assert (slot.status, slot.filtered, slot.filter_replacements, slot.needs_replacement) == ("open", 5, 5, True)
    assert d.live_of(0, 2).reason == "filter_replacement"
    assert d.run().status == "running"
    # Lowered: the second filtered group in a row is past it.
    assert d.filter_slot(0, 0).outcome is Outcome.FILTERED
    assert d.run().status == "running"
    last = d.filter_slot(0, 0)
    assert last.outcome is Outcome.FILTERED
    expected = decisions.budget_exhausted_message(
        step=0, slot=0, budget=1, p=1.0, num_prompts_per_step=4, max_num_steps=3, config_budget=3
    )
    assert "drew 2 zero-variance groups in a row, past its stored budget of 1 (the run's config" in expected
    run = d.run()
    assert (run.status, run.end_reason, run.error) == ("failed", "budget_exhausted", expected)
    assert last.detail == expected.splitlines()[0]
    slot = d.slot(0, 0)
    assert (slot.filtered, slot.filter_replacements, slot.filter_budget) == (2, 1, 1)
    assert_only_budget_drift(d, {(0, 0), (0, 2)})


def drop_prompt(d: Driver, step: int, idx: int) -> None:
    """Fail the slot's live attempt until its prompt is dropped (2 tries per prompt)."""
    for _ in range(2):
        d.fail(d.live_of(step, idx).id)


def test_the_stored_drop_budget_decides(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, check=False)  # the config's budget: 1 replacement per slot, under replace
    d.admit()
    d.relay()
    store_budget(d, "drop_budget", 0, 0, 0)
    store_budget(d, "drop_budget", 0, 1, 2)
    # Lowered to none: the first dropped prompt shrinks the slot.
    drop_prompt(d, 0, 0)
    slot = d.slot(0, 0)
    assert (slot.status, slot.shrink_reason, slot.drops, slot.drop_replacements) == ("shrunk", "dropped", 1, 0)
    # Raised to two: a second replacement, where the config's 1 would have shrunk the slot.
    drop_prompt(d, 0, 1)
    drop_prompt(d, 0, 1)
    slot = d.slot(0, 1)
    assert (slot.status, slot.drops, slot.drop_replacements) == ("open", 2, 2)
    assert d.live_of(0, 1).reason == "drop_replacement"
    drop_prompt(d, 0, 1)
    slot = d.slot(0, 1)
    assert (slot.status, slot.shrink_reason, slot.drops, slot.drop_replacements) == ("shrunk", "dropped", 3, 2)
    # Two of four slots shrunk: at the floor of ceil(4 * 0.5) = 2, the run goes on.
    assert (d.step(0).dropped_shrunk, d.run().status) == (2, "running")
    assert_only_budget_drift(d, {(0, 0), (0, 1)})
