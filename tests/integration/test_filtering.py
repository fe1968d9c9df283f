"""SPEC §3.3 and §3.4: the zero-variance filter, its per-slot budget, and the spare pool."""

from __future__ import annotations

import pytest

from refill.models import decisions
from refill.models.results import Outcome
from refill.models.runs import RunStateError
from tests.support.driver import FLAT, SPREAD, Driver


def test_filtered_group_is_replaced_from_the_spare_pool(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    assert d.admit() == [0, 1]
    assert d.spare_pool() == [8, 9, 10, 11]
    first = d.live_of(0, 0)
    assert d.finish_one(first.id, FLAT).outcome is Outcome.FILTERED
    filtered = d.attempt(first.id)
    assert (filtered.state, filtered.zero_variance, filtered.reward_mean, filtered.failure_kind) == (
        "filtered", True, 1.0, None,
    )
    slot = d.slot(0, 0)
    assert (slot.status, slot.needs_replacement, slot.filtered, slot.filter_replacements) == ("open", True, 1, 1)
    # the fault-tolerance side is untouched
    assert (slot.drops, slot.drop_replacements, slot.infra_failures, slot.data_failures) == (0, 0, 0, 0)
    replacement = d.live_of(0, 0)
    assert (replacement.reason, replacement.try_no) == ("filter_replacement", 1)
    assert (replacement.origin_step, replacement.origin_slot) == (0, 0)
    assert d.position(replacement.prompt_id) == 8
    # taking prompt 8 left 3 < 4 in the pool: one batch of N = 4 was drawn
    assert d.spare_pool() == [9, 10, 11, 12, 13, 14, 15]
    assert d.run().loader_cursor == 16
    assert d.groups() == [] and d.step(0).committed == 0
    # the replacement commits into the slot
    assert d.finish_one(replacement.id, SPREAD).outcome is Outcome.COMMITTED
    slot = d.slot(0, 0)
    assert (slot.status, slot.group_attempt_id, slot.needs_replacement) == ("committed", replacement.id, False)


def test_filter_tolerance_is_read_from_the_config(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"zero_variance_tolerance": 0.1}})
    d.admit()
    assert d.commit_slot(0, 0, [0.5, 0.55, 0.5, 0.6]).outcome is Outcome.FILTERED  # spread 0.1
    assert d.commit_slot(0, 1, [0.5, 0.65, 0.5, 0.5]).outcome is Outcome.COMMITTED  # spread 0.15
    assert d.slot(0, 0).filtered == 1 and d.slot(0, 1).status == "committed"


def test_without_dynamic_sampling_a_zero_variance_group_trains(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"use_dynamic_sampling": False}, "rollout_failure": {"on_dropped_prompt": "shrink"}})
    d.admit()
    assert d.spare_pool() == []  # nothing needs one: no filtering, drops shrink
    outcome = d.commit_slot(0, 0, FLAT)
    assert outcome.outcome is Outcome.COMMITTED
    group = d.group(outcome.attempt_id)
    assert group is not None and group.zero_variance is True
    assert d.slot(0, 0).filtered == 0


def test_filtering_under_shrink_still_replaces(ledger) -> None:  # type: ignore[no-untyped-def]
    # Filtering is a data decision and does not read on_dropped_prompt.
    d = Driver(ledger, {"rollout_failure": {"on_dropped_prompt": "shrink"}})
    d.admit()
    assert d.spare_pool() == [8, 9, 10, 11]
    assert d.filter_slot(0, 3).outcome is Outcome.FILTERED
    slot = d.slot(0, 3)
    assert (slot.status, slot.filter_replacements, slot.drop_budget) == ("open", 1, 0)
    assert d.live_of(0, 3).reason == "filter_replacement"


def test_budget_exhaustion_fails_the_run_naming_the_slot(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # budget 3, N = 4, max_num_steps = 3
    d.admit()
    d.relay()
    for idx in (1, 2, 3):
        assert d.commit_slot(0, idx).outcome is Outcome.COMMITTED
    outcomes = [d.filter_slot(0, 0) for _ in range(4)]
    assert [o.outcome for o in outcomes] == [Outcome.FILTERED] * 4
    # p = 4 zero-variance of 7 finished = 0.571; expected = (4/7)**4 * 4 * 3 = 256/2401 * 12 = 1.2795
    expected = decisions.budget_exhausted_message(
        step=0, slot=0, budget=3, p=4 / 7, num_prompts_per_step=4, max_num_steps=3
    )
    assert "p=0.571" in expected and "= 1.28 exhausted slots" in expected
    assert "slot (step 0, index 0) drew 4 zero-variance groups in a row" in expected
    assert outcomes[-1].detail == expected.splitlines()[0]
    run = d.run()
    assert (run.status, run.end_reason, run.error) == ("failed", "budget_exhausted", expected)
    assert run.finished_at == d.now
    # the slot that exhausted it is visible
    slot = d.slot(0, 0)
    assert (slot.status, slot.filtered, slot.filter_replacements, slot.filter_budget) == ("open", 4, 3, 3)
    assert [s.filtered for s in d.slots(0)] == [4, 0, 0, 0]
    # the run stopped its work: every live attempt was cancelled, none is dispatched after
    assert d.live() == []
    cancelled = d.attempts(state="cancelled")
    assert len(cancelled) == 4 and {a.error for a in cancelled} == {"run failed"}
    assert d.admit() == []
    assert d.relay() == []
    with pytest.raises(RunStateError, match="failed and cannot resume"):
        d.resume()


def test_budget_counts_per_slot_not_per_step(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    for idx in range(4):
        for _ in range(3):  # three filters each: at the budget, not past it
            assert d.filter_slot(0, idx).outcome is Outcome.FILTERED
    assert d.run().status == "running"
    assert [(s.filtered, s.filter_replacements) for s in d.slots(0)] == [(3, 3)] * 4
    d.fill_step(0)
    assert d.step(0).status == "released"


def test_filtered_group_never_spends_the_fault_tolerance_budget(ledger) -> None:  # type: ignore[no-untyped-def]
    # max_attempts_per_prompt 2, max_replacement_attempts 1
    d = Driver(ledger)
    d.admit()
    d.filter_slot(0, 0)
    d.filter_slot(0, 0)
    slot = d.slot(0, 0)
    assert (slot.filter_replacements, slot.drop_replacements, slot.drops) == (2, 0, 0)
    # the second replacement fails twice: its prompt is dropped, and the drop budget is whole
    d.fail(d.live_of(0, 0).id)
    retry = d.live_of(0, 0)
    assert (retry.reason, retry.try_no) == ("retry", 2)
    d.fail(retry.id)
    slot = d.slot(0, 0)
    assert (slot.status, slot.infra_failures, slot.drops, slot.drop_replacements) == ("open", 2, 1, 1)
    assert (slot.filtered, slot.filter_replacements) == (2, 2)
    assert d.live_of(0, 0).reason == "drop_replacement"
    # and the dynamic-sampling budget is whole too: one more filter is allowed
    assert d.filter_slot(0, 0).outcome is Outcome.FILTERED
    assert d.run().status == "running"
    assert d.slot(0, 0).filter_replacements == 3
    assert d.live_of(0, 0).reason == "filter_replacement"


def test_filtered_group_resets_the_consecutive_drop_counter(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(
        ledger,
        {"rollout_failure": {"max_attempts_per_prompt": 1, "max_consecutive_dropped_prompts": 2, "min_step_batch_fraction": 0.25}},
    )
    d.admit()
    d.fail(d.live_of(0, 0).id)
    d.fail(d.live_of(0, 1).id)
    assert d.run().consecutive_dropped == 2
    assert d.filter_slot(0, 2).outcome is Outcome.FILTERED
    assert d.run().consecutive_dropped == 0
    d.fail(d.live_of(0, 3).id)
    d.fail(d.live_of(1, 0).id)
    run = d.run()
    # four infra drops, but never more than two in a row: the run is healthy
    assert (run.status, run.consecutive_dropped) == ("running", 2)
    # a third in a row fails it
    d.fail(d.live_of(1, 1).id, error="CUDA error: device lost")
    run = d.run()
    assert (run.status, run.end_reason) == ("failed", "fleet_failed")
    assert run.error == decisions.consecutive_drops_message(3, 2, "CUDA error: device lost")


def test_committed_group_resets_the_consecutive_drop_counter(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"max_attempts_per_prompt": 1}})
    d.admit()
    d.fail(d.live_of(0, 0).id)
    assert d.run().consecutive_dropped == 1
    d.commit_slot(0, 1)
    assert d.run().consecutive_dropped == 0


def test_spare_pool_refills_one_batch_below_the_mark(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)  # reserve 4, N = 4
    d.admit()
    assert (d.spare_pool(), d.run().loader_cursor) == ([8, 9, 10, 11], 12)
    d.filter_slot(0, 0)  # takes 8: 3 < 4, draws 12..15
    assert (d.spare_pool(), d.run().loader_cursor) == ([9, 10, 11, 12, 13, 14, 15], 16)
    d.filter_slot(0, 1)  # takes 9: 6, no draw
    d.filter_slot(0, 2)  # takes 10: 5
    d.filter_slot(0, 3)  # takes 11: 4, still not below the mark
    assert (d.spare_pool(), d.run().loader_cursor) == ([12, 13, 14, 15], 16)
    d.filter_slot(1, 0)  # takes 12: 3 < 4, draws 16..19
    assert (d.spare_pool(), d.run().loader_cursor) == ([13, 14, 15, 16, 17, 18, 19], 20)
    assert [d.position(d.live_of(0, i).prompt_id) for i in range(4)] == [8, 9, 10, 11]
    assert d.position(d.live_of(1, 0).prompt_id) == 12


def test_spare_pool_mark_above_one_batch_draws_one_batch_per_check(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"rollout_failure": {"replacement_reserve_prompts": 6}})
    d.admit()
    # 0 < 6: one batch of 4, not enough to reach the mark, and no second batch
    assert d.spare_pool() == [8, 9, 10, 11]
    d.filter_slot(0, 0)  # 3 < 6: one more batch
    assert d.spare_pool() == [9, 10, 11, 12, 13, 14, 15]
    d.filter_slot(0, 1)  # 6: not below
    assert d.spare_pool() == [10, 11, 12, 13, 14, 15]


def test_admission_tops_the_pool_up_too(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    for idx in range(4):
        d.filter_slot(0, idx)
    assert d.spare_pool() == [12, 13, 14, 15]
    d.fill_step(0)
    d.fill_step(1)
    assert d.train(0)
    d.admit()
    assert [s.step for s in d.steps()] == [0, 1, 2]  # step 2 takes 16..19; the pool is at the mark
    assert [d.position(s.prompt_id) for s in d.slots(2)] == [16, 17, 18, 19]
    assert d.spare_pool() == [12, 13, 14, 15]


def test_results_after_the_run_failed_in_the_same_batch_are_late(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    for _ in range(3):
        d.filter_slot(0, 0)
    exhausting = d.live_of(0, 0)
    other = d.live_of(0, 1)
    d.start_all([exhausting.id, other.id])
    outcomes = d.record(d.result(exhausting.id, FLAT), d.result(other.id, SPREAD)).outcomes
    assert [o.outcome for o in outcomes] == [Outcome.FILTERED, Outcome.LATE]
    assert outcomes[1].detail == "attempt is already cancelled"
    assert d.run().end_reason == "budget_exhausted"
    assert d.groups() == [] and d.slot(0, 1).status == "open"
