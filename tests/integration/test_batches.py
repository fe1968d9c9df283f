"""Several results in one transaction: a decision may use what an earlier result of the same
batch did before anything is flushed (the consumer commits results in groups)."""

from __future__ import annotations

from refill.models.results import Outcome
from tests.support.driver import FLAT, SPREAD, Driver


def test_a_group_committed_earlier_in_the_batch_can_be_borrowed(ledger) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger)
    d.admit()
    later, earlier = d.live_of(1, 2), d.live_of(0, 0)
    d.start(later.id)
    d.start(earlier.id)
    batch = d.record(d.result(later.id, SPREAD), d.result(earlier.id, FLAT))
    assert [r.outcome for r in batch.outcomes] == [Outcome.COMMITTED, Outcome.FILTERED]
    # The group committed for step 1 moved into step 0's filtered slot within the batch.
    assert d.slot(0, 0).group_attempt_id == later.id
    assert d.slot(1, 2).status == "open" and d.live_of(1, 2).reason == "respawn"
    assert (d.step(0).committed, d.step(1).committed) == (1, 0)


def test_a_batch_with_over_dispatch_places_extras_in_open_slots(ledger) -> None:  # type: ignore[no-untyped-def]
    # Without lookahead nothing can be borrowed from a later step, so the margin is above the
    # expected need and extras go out with the admission.
    d = Driver(ledger, {"async_rl": {"max_lookahead_versions": 0, "over_dispatch": {"enabled": True, "safety_sigmas": 1.0}}})
    d.admit()
    extras = [a for a in d.live(0) if a.slot_idx is None]
    assert extras and all(a.reason == "extra" for a in extras)
    assert d.step(0).extras == len(extras)
    first = extras[0]
    d.start(first.id)
    assert d.record(d.result(first.id, SPREAD)).outcomes[0].outcome is Outcome.COMMITTED
    # The extra filled an open slot of its step; that slot's own attempt became an extra.
    holder = [s for s in d.slots(0) if s.group_attempt_id == first.id]
    assert len(holder) == 1 and d.step(0).committed == 1
    live_extras = [a for a in d.live(0) if a.slot_idx is None]
    assert len(live_extras) == len(extras)  # one finished, the displaced slot attempt joined
    assert all(a.slot_idx is not None for a in d.live(0) if a.id not in {x.id for x in live_extras})


def test_a_repeated_filtered_result_keeps_its_slot_when_an_extra_fills_the_slot(ledger) -> None:  # type: ignore[no-untyped-def]
    """The repeat loads the filtered attempt into the batch's session; the extra that fills its
    slot hands the slot's live replacement to the step, and only that one."""
    d = Driver(ledger, {"async_rl": {"max_lookahead_versions": 0, "over_dispatch": {"enabled": True, "safety_sigmas": 1.0}}})
    d.admit()
    filtered = d.live_of(0, 1)
    assert d.finish_one(filtered.id, FLAT).outcome is Outcome.FILTERED
    replacement = d.live_of(0, 1)
    assert replacement.id != filtered.id
    extra = next(a for a in d.live(0) if a.slot_idx is None)
    d.start(extra.id)
    batch = d.record(d.result(filtered.id, FLAT), d.result(extra.id, SPREAD))
    assert [r.outcome for r in batch.outcomes] == [Outcome.DUPLICATE, Outcome.COMMITTED]
    assert d.slot(0, 1).group_attempt_id == extra.id
    assert (d.attempt(filtered.id).step, d.attempt(filtered.id).slot_idx) == (0, 1)
    assert d.attempt(replacement.id).slot_idx is None and d.attempt(replacement.id).reason == "extra"
    assert d.slot(0, 1).filtered == 1
