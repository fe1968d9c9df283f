"""The ledger's invariants for the test suite: the very checks `refill check RUN` ships.

The suite proves a ledger with `refill.admin.invariants.run_checks` and nothing else, so a check
the tests rely on is a check operators get, and a corruption `refill check` would miss is one
the tests miss too (tests/integration/test_invariants.py corrupts a healthy ledger to show
that each is found, by check and location). This module only adapts the report to the tests:

- `ledger_violations(session, run_id)`: one line per violation (`str(Violation)`: check,
  run, step, slot, attempt, message); empty when every invariant holds;
- `assert_ledger_consistent(session, run_id)`: fails listing every violation.

Give them a session on one snapshot of the ledger (`refill.admin.snapshot.read_snapshot`, or a
session with nothing else writing the run) so that the checks see one state of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.orm import Session

from refill.admin.invariants import CHECKS, run_checks

NAMES = tuple(c.name for c in CHECKS)


def ledger_violations(
    session: Session, run_id: int, only: Iterable[str] | None = None
) -> list[str]:
    """Every violation `refill check RUN` finds in the run (of the checks named in `only`, when
    given), one line each."""
    names = None if only is None else list(only)
    unknown = [n for n in names or [] if n not in NAMES]
    if unknown or names == []:
        raise ValueError(f"no check named {unknown or names}; the checks are: {', '.join(NAMES)}")
    return [str(v) for v in run_checks(session, run_id, only=names).violations]


def assert_ledger_consistent(session: Session, run_id: int) -> None:
    problems = ledger_violations(session, run_id)
    assert not problems, f"run {run_id} breaks the ledger's invariants:\n  " + "\n  ".join(problems)
