"""SPEC §3.4 and §5: when the data ends, slots shrink and the run completes cleanly."""

from __future__ import annotations

from refill.models.results import Outcome
from tests.support.driver import Driver


def test_shrink_at_end_of_data_then_complete(ledger) -> None:  # type: ignore[no-untyped-def]
    # 12 prompts, one epoch: steps 0 and 1 take 0..7, the pool takes 8..11 and the loader ends
    d = Driver(ledger, {"grpo": {"max_num_steps": 10}}, num_prompts=12)
    assert d.admit() == [0, 1]
    run = d.run()
    assert (run.loader_exhausted, run.loader_epoch, run.loader_cursor) == (True, 1, 0)
    assert d.spare_pool() == [8, 9, 10, 11]
    for idx in range(4):
        d.filter_slot(0, idx)  # each takes a spare: 8, 9, 10, 11
    assert d.spare_pool() == []
    # pool empty, loader exhausted, nothing later to borrow: the slot shrinks
    assert d.filter_slot(1, 0).outcome is Outcome.FILTERED
    slot = d.slot(1, 0)
    assert (slot.status, slot.shrink_reason, slot.filtered, slot.filter_replacements) == ("shrunk", "end_of_data", 1, 1)
    assert all(a.slot_idx != 0 for a in d.live(1))
    step = d.step(1)
    assert (step.shrunk, step.dropped_shrunk) == (1, 0)
    assert d.run().status == "running"  # the end of the data is not a failure
    d.fill_step(0)
    d.fill_step(1)
    assert [(s.status, s.committed, s.shrunk) for s in d.steps()] == [("released", 4, 0), ("released", 3, 1)]
    assert d.train(0)
    d.admit()
    assert [s.step for s in d.steps()] == [0, 1]  # no step 2: the data has ended
    assert d.run().status == "running"
    assert d.train(1)
    run = d.run()
    assert (run.status, run.end_reason, run.error, run.weight_version) == ("completed", "end_of_data", None, 2)
    assert d.metrics(1).trained_groups == 3
    assert d.live() == []


def test_partial_batch_goes_to_the_pool_and_the_run_completes(ledger) -> None:  # type: ignore[no-untyped-def]
    # lookahead 0 and a mark of 1: step 1 is admitted after step 0 trains, and finds only
    # prompt 8 left; it cannot make a step, so the run ends after step 0.
    d = Driver(
        ledger,
        {"grpo": {"max_num_steps": 10}, "async_rl": {"max_lookahead_versions": 0}, "rollout_failure": {"replacement_reserve_prompts": 1}},
        num_prompts=9,
    )
    assert d.admit() == [0]
    assert d.spare_pool() == [4, 5, 6, 7]
    d.fill_step(0)
    assert d.train(0)
    d.admit()
    run = d.run()
    assert run.loader_exhausted and d.spare_pool() == [4, 5, 6, 7, 8]
    assert [s.step for s in d.steps()] == [0]
    assert (run.status, run.end_reason) == ("completed", "end_of_data")


def test_without_a_pool_a_partial_batch_is_dropped_and_the_run_completes(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(
        ledger,
        {
            "grpo": {"max_num_steps": 10, "use_dynamic_sampling": False},
            "async_rl": {"max_lookahead_versions": 0},
            "rollout_failure": {"on_dropped_prompt": "shrink"},
        },
        num_prompts=6,
    )
    assert d.admit() == [0]
    d.fill_step(0)
    assert d.train(0)
    d.admit()
    run = d.run()
    assert (run.status, run.end_reason, run.loader_exhausted) == ("completed", "end_of_data", True)
    assert d.spare_pool() == []


def test_max_num_epochs_null_cycles_the_data(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"grpo": {"max_num_epochs": None, "max_num_steps": 4}, "rollout_failure": {"replacement_reserve_prompts": 1}}, num_prompts=8)
    assert d.admit() == [0, 1]
    assert d.run().loader_epoch == 1 and not d.run().loader_exhausted
    for step in range(4):
        d.admit()
        d.fill_step(step)
        assert d.train(step)
    run = d.run()
    assert (run.status, run.end_reason, run.weight_version) == ("completed", "max_num_steps", 4)
    assert run.loader_epoch >= 2 and not run.loader_exhausted
    # unshuffled: every epoch serves the prompts in the same order
    assert [p for _, p in d.layout(2)] == [4, 5, 6, 7]


def test_shuffled_epochs_are_permutations_seeded_by_run_and_epoch(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"data": {"shuffle": True}, "grpo": {"max_num_epochs": None}}, num_prompts=8)
    d.admit()
    first_epoch = d.slot_prompts(0) + d.slot_prompts(1)
    assert sorted(first_epoch) == list(range(8)) and first_epoch != list(range(8))
    again = Driver(ledger, {"data": {"shuffle": True}, "grpo": {"max_num_epochs": None}}, num_prompts=8)
    again.admit()
    assert again.slot_prompts(0) + again.slot_prompts(1) == first_epoch
