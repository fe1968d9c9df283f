"""The ledger's invariants (SPEC §8), as SQL-backed checks over one run's rows.

`refill check RUN` runs them all. Each check returns `Violation`s that name where the ledger
is wrong (run, step, slot, attempt) and how; an empty list means the invariant holds. They read
the tables only, never a process's memory, so they prove what the ledger says happened.

Several invariants are also CHECK constraints or unique indexes of the schema
(`models/tables.py`); the checks do not trust them: a ledger restored from a dump, a
constraint dropped by hand, or a bug in a migration must still be caught, and where a
constraint covers a counter the checks also compare the counter with the rows it counts.

The checks live by what they guard: `group_invariants` (committed groups), `slot_invariants`
(slots, steps and their counters), `run_invariants` (weight versions, outbox, spare pool) and
`prompt_invariants` (the loader's draws under prompt skipping);
`invariant_types` holds what they share. This module lists them and runs them.

Run them on one snapshot (`refill.admin.snapshot.read_snapshot`: REPEATABLE READ on PostgreSQL),
so that a check of a running run sees one consistent state of the ledger.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from refill.admin.group_invariants import (
    check_committed_once,
    check_group_placement,
    check_staleness,
    check_zero_variance,
)
from refill.admin.invariant_types import Check, CheckResult, Context, Report
from refill.admin.payload_invariants import check_payloads
from refill.admin.prompt_invariants import check_prompt_draws
from refill.admin.run_invariants import check_messages, check_spare_pool, check_weight_versions
from refill.admin.slot_invariants import (
    check_budgets,
    check_counters,
    check_live_attempts,
    check_released_full,
)
from refill.models.settings import LedgerSettings
from refill.models.tables import Run

CHECKS: tuple[Check, ...] = (
    Check("slot_committed_twice", "no slot committed twice: a group in one slot, trained in one step", check_committed_once),
    Check("budget_exceeded", "per-slot filter and drop budgets and the run's consecutive-drop limit never exceeded; counts agree with attempts", check_budgets),
    Check("zero_variance_trained", "no zero-variance group trained under dynamic sampling; the filter fired only on zero-variance groups", check_zero_variance),
    Check("staleness_bound", "step - weight version <= max_lookahead_versions for every group and admission", check_staleness),
    Check("released_step_not_full", "each released step full: committed == num_slots - shrunk, no open slot", check_released_full),
    Check("weight_versions", "weight versions 0..v contiguous, one per trained step", check_weight_versions),
    Check("live_attempts", "an open slot of an open step has exactly one live attempt; settled slots none", check_live_attempts),
    Check("step_counters", "step counters (committed, shrunk, dropped) agree with their slots; the run's scored and zero-variance group counts with its attempts, its spare-pool count with the pool", check_counters),
    Check("group_placement", "each committed group in one slot or parked, and only in a committed slot; groups belong to committed attempts", check_group_placement),
    Check("outbox", "released steps have metrics and a train_step message", check_messages),
    Check("spare_pool", "a taken spare prompt is run by the attempt that took it", check_spare_pool),
    Check("payloads", "every committed, untrained group's stored payload exists, at the size its worker wrote", check_payloads),
    Check("prompt_draws", "under prompt skipping: every place of each epoch drawn once, in order; each skip replays from its seeded uniform and probability; no taken prompt lost; skipped_prompts agree", check_prompt_draws),
)


def run_checks(session: Session, run_id: int, only: list[str] | None = None) -> Report:
    """Every check of `CHECKS` (or those named in `only`) over run `run_id`; raises
    LookupError for an unknown run. Give it a session on one snapshot
    (`refill.admin.snapshot.read_snapshot`) to check a running run."""
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"there is no run {run_id}")
    ctx = Context(session, run, LedgerSettings.from_config(run.config))
    results = []
    for check in CHECKS:
        if only and check.name not in only:
            continue
        results.append(CheckResult(check.name, check.description, check.fn(ctx)))
    return Report(run_id, results)
