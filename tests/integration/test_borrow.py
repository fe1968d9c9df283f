"""SPEC §3.4: a slot waiting on a replacement takes a group committed for a later step (borrow),
and a later step's commit fills an earlier slot that waits on one (push); the replacement
prompt then serves the later slot."""

from __future__ import annotations

from refill.models.results import Outcome
from tests.support.driver import SPREAD, Driver


def test_borrow_moves_a_later_group_and_respawns_the_lender(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    lent = d.commit_slot(1, 2)
    assert lent.outcome is Outcome.COMMITTED
    assert d.slot(1, 2).group_attempt_id == lent.attempt_id and d.step(1).committed == 1
    filtered = d.filter_slot(0, 0)
    assert filtered.outcome is Outcome.FILTERED
    # the earlier step filled without waiting for a generation
    borrower = d.slot(0, 0)
    assert (borrower.status, borrower.group_attempt_id, borrower.borrowed_in) == ("committed", lent.attempt_id, 1)
    assert (borrower.needs_replacement, borrower.filtered, borrower.filter_replacements) == (False, 1, 1)
    assert d.live(0) and all(a.slot_idx != 0 for a in d.live(0))
    group = d.group(lent.attempt_id)
    assert group is not None and (group.moves, group.parked, group.origin_step) == (1, False, 1)
    # the lender slot gets the spare prompt as a RESPAWN attempt
    lender = d.slot(1, 2)
    assert (lender.status, lender.group_attempt_id, lender.lent_out, lender.needs_replacement) == ("open", None, 1, True)
    respawn = d.live_of(1, 2)
    assert (respawn.reason, respawn.try_no, respawn.origin_step, respawn.origin_slot) == ("respawn", 1, 1, 2)
    assert d.position(respawn.prompt_id) == 8
    # spare budgets: only the borrower's filter budget was spent
    assert (lender.filter_replacements, lender.drop_replacements, lender.filtered) == (0, 0, 0)
    assert (d.step(0).committed, d.step(1).committed) == (1, 0)
    assert d.spare_pool() == [9, 10, 11, 12, 13, 14, 15]
    # the respawn commits where the lent group was
    assert d.finish_one(respawn.id, SPREAD).outcome is Outcome.COMMITTED
    assert d.slot(1, 2).group_attempt_id == respawn.id
    d.fill_step(0)
    assert d.step(0).status == "released"
    assert d.metrics(0).promoted_prompt_groups == 1


def test_in_order_borrows_from_the_latest_step_first(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"async_rl": {"max_lookahead_versions": 2}})
    assert d.admit() == [0, 1, 2]
    d.commit_slot(1, 0)
    d.commit_slot(2, 1)
    newest = d.commit_slot(2, 3)
    d.filter_slot(0, 0)
    assert d.slot(0, 0).group_attempt_id == newest.attempt_id
    assert d.slot(2, 3).status == "open" and d.live_of(2, 3).reason == "respawn"
    assert d.slot(1, 0).status == "committed" and d.slot(2, 1).status == "committed"


def test_borrow_when_the_data_has_ended_shrinks_the_lender(ledger) -> None:  # type: ignore[no-untyped-def]
    # 8 prompts: steps 0 and 1 take them all, the pool stays empty
    d = Driver(ledger, {"grpo": {"max_num_steps": 10}}, num_prompts=8)
    assert d.admit() == [0, 1]
    assert d.spare_pool() == [] and d.run().loader_exhausted
    lent = d.commit_slot(1, 1)
    d.filter_slot(0, 0)
    assert d.slot(0, 0).group_attempt_id == lent.attempt_id
    lender = d.slot(1, 1)
    assert (lender.status, lender.shrink_reason, lender.lent_out) == ("shrunk", "end_of_data", 1)
    step1 = d.step(1)
    assert (step1.shrunk, step1.dropped_shrunk, step1.committed) == (1, 0, 0)
    d.fill_step(0)
    d.fill_step(1)
    assert [s.status for s in d.steps()] == ["released", "released"]
    assert d.step(1).committed == 3
    assert d.train(0) and d.train(1)
    run = d.run()
    assert (run.status, run.end_reason) == ("completed", "end_of_data")


def test_push_placement_fills_an_earlier_slot_and_reaims_its_replacement(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.relay()
    d.filter_slot(0, 0)  # nothing to borrow: the spare prompt 8 is dispatched for (0, 0)
    replacement = d.live_of(0, 0)
    assert (replacement.reason, d.position(replacement.prompt_id)) == ("filter_replacement", 8)
    later = d.commit_slot(1, 1)
    assert later.outcome is Outcome.COMMITTED
    # the later step's group filled the earlier slot that waited on a replacement
    earlier = d.slot(0, 0)
    assert (earlier.status, earlier.group_attempt_id, earlier.borrowed_in) == ("committed", later.attempt_id, 1)
    assert earlier.needs_replacement is False
    # ... and the replacement now serves the later slot, keeping its origin
    moved = d.attempt(replacement.id)
    assert (moved.step, moved.slot_idx, moved.origin_step, moved.origin_slot) == (1, 1, 0, 0)
    assert (moved.state, moved.min_weight_version) == ("pending", 0)
    own = d.slot(1, 1)
    assert (own.status, own.group_attempt_id, own.lent_out) == ("open", None, 0)
    assert own.attempts == 2  # its first attempt and the re-aimed one
    assert d.live_of(1, 1).id == replacement.id
    assert (d.step(0).committed, d.step(1).committed) == (1, 0)
    group = d.group(later.attempt_id)
    assert group is not None and group.moves == 1
    # the re-aimed replacement commits into the later slot
    assert d.finish_one(replacement.id, SPREAD).outcome is Outcome.COMMITTED
    assert d.slot(1, 1).group_attempt_id == replacement.id


def test_push_placement_does_not_reaim_a_running_attempt_too_stale_for_the_later_step(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # lookahead 1
    d.admit()
    d.fill_step(0)
    d.filter_slot(1, 0)  # (1, 0) waits on a replacement generated with v >= 0
    replacement = d.live_of(1, 0)
    assert d.start(replacement.id, engine_version=0) is not None  # running on v0
    assert d.train(0)
    d.admit()
    assert d.step(2).status == "open"  # step 2 needs v >= 1
    later = d.commit_slot(2, 0, version=1)
    # v0 cannot train step 2: the running replacement stays with (1, 0), the group with (2, 0)
    assert d.slot(2, 0).group_attempt_id == later.attempt_id
    assert d.slot(1, 0).status == "open" and d.slot(1, 0).needs_replacement
    still = d.attempt(replacement.id)
    assert (still.step, still.slot_idx, still.state) == (1, 0, "running")


def test_push_placement_raises_the_floor_of_a_queued_replacement(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    d.fill_step(0)
    d.filter_slot(1, 0)
    replacement = d.live_of(1, 0)
    assert replacement.min_weight_version == 0
    assert d.train(0)
    d.admit()
    later = d.commit_slot(2, 0, version=1)
    # not started yet: it moves to step 2 and may only be generated with v >= 1
    assert d.slot(1, 0).group_attempt_id == later.attempt_id
    moved = d.attempt(replacement.id)
    assert (moved.step, moved.slot_idx, moved.min_weight_version) == (2, 0, 1)
    lease = d.start(replacement.id, engine_version=0)
    assert lease is not None and lease.min_weight_version == 1
