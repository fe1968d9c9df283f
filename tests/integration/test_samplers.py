"""SPEC §4: every sampler works with dynamic sampling; where the groups land."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from refill.models.results import Outcome
from tests.support.driver import Driver


def run_with(ledger, name: str, **sampler):  # type: ignore[no-untyped-def]
    return Driver(ledger, {"async_rl": {"sampler": {"name": name, **sampler}}})


@pytest.mark.parametrize("name", ["ready_first", "weight_fifo"])
def test_earliest_step_takes_any_group(ledger, name: str) -> None:  # type: ignore[no-untyped-def]
    d = run_with(ledger, name)
    d.admit()
    d.filter_slot(0, 3)  # (0, 3) waits on spare prompt 8
    # a group of step 1 goes to the earliest open step, to the slot waiting on a replacement first
    g6 = d.commit_slot(1, 2)
    assert d.slot(0, 3).group_attempt_id == g6.attempt_id
    assert d.position(d.live_of(1, 2).prompt_id) == 8  # the replacement now serves (1, 2)
    # then to the lowest index of the earliest step, whose own attempt moves to step 1
    g4 = d.commit_slot(1, 0)
    assert d.slot(0, 0).group_attempt_id == g4.attempt_id
    assert d.position(d.live_of(1, 0).prompt_id) == 0
    d.fill_step(0)
    assert d.layout(0) == [("committed", 4), ("committed", 1), ("committed", 2), ("committed", 6)]
    d.fill_step(1)
    assert d.layout(1) == [("committed", 0), ("committed", 5), ("committed", 8), ("committed", 7)]
    assert d.train(0) and d.train(1)
    assert d.metrics(0).promoted_prompt_groups == 2
    assert (d.metrics(1).staleness_max, d.metrics(1).staleness_mean) == (1, 1.0)


@pytest.mark.parametrize("name", ["in_order", "ready_first", "weight_fifo", "windowed"])
def test_every_sampler_borrows_a_later_group(ledger, name: str) -> None:  # type: ignore[no-untyped-def]
    # Step 1's attempts all run on v0, so step 2's groups (v1) cannot take their place: they
    # commit in step 2. A filtered slot of step 1 then borrows one.
    d = run_with(ledger, name)
    d.admit()
    d.fill_step(0)
    for idx in range(4):
        d.start(d.live_of(1, idx).id, engine_version=0)
    assert d.train(0)
    d.admit()
    g = d.commit_slot(2, 3, version=1)
    assert d.slot(2, 3).group_attempt_id == g.attempt_id
    assert d.filter_slot(1, 1).outcome is Outcome.FILTERED
    assert d.slot(1, 1).group_attempt_id == g.attempt_id
    assert d.live_of(2, 3).reason == "respawn"
    for idx in (0, 2, 3):
        d.commit_slot(1, idx, version=0)
    assert d.step(1).status == "released"
    batch = d.claim(1)
    assert batch is not None and sorted(gr.weight_version for gr in batch.groups) == [0, 0, 0, 1]


def test_windowed_trains_only_within_its_window(ledger) -> None:  # type: ignore[no-untyped-def]
    # lookahead 1 admits step 1 on v0, but the window of 0 trains only on-policy groups
    d = run_with(ledger, "windowed", max_staleness_versions=0)
    assert d.admit() == [0, 1]
    d.filter_slot(0, 1)  # spare prompt 8 for (0, 1)
    # a group of step 1 made with v0 fits step 0 only: it takes the earliest slot
    g = d.commit_slot(1, 3, version=0)
    assert d.slot(0, 1).group_attempt_id == g.attempt_id
    d.fill_step(0)
    assert d.step(0).status == "released"
    # step 0 is full: a v0 group of step 1 fits nowhere and is parked, and its slot gets its
    # prompt again, to be generated with v1
    parked = d.commit_slot(1, 0, version=0)
    assert parked.outcome is Outcome.COMMITTED
    group = d.group(parked.attempt_id)
    assert group is not None and group.parked
    assert d.slot(1, 0).status == "open"
    again = d.live_of(1, 0)
    assert again.prompt_id == d.attempt(parked.attempt_id).prompt_id
    assert (again.reason, again.min_weight_version) == ("retry", 1)
    assert d.train(0)
    d.admit()
    for idx in range(4):
        d.commit_slot(1, idx, version=1)
    assert d.step(1).status == "released"
    assert d.metrics(1).staleness_max == 0
    assert all(d.group(s.group_attempt_id).weight_version == 1 for s in d.slots(1))  # type: ignore[union-attr]


def test_windowed_freshest_first_lends_the_newest_group(ledger) -> None:  # type: ignore[no-untyped-def]
    d = run_with(ledger, "windowed", max_staleness_versions=1, freshest_first=True)
    d.admit()
    d.fill_step(0)
    for idx in range(4):
        d.start(d.live_of(1, idx).id, engine_version=0)
    assert d.train(0)
    d.admit()
    older = d.commit_slot(2, 0, version=1)
    newer = d.commit_slot(2, 1, version=1)
    d.filter_slot(1, 0)
    # same version: the lower attempt id first, as the freshest_first key says
    assert d.slot(1, 0).group_attempt_id == older.attempt_id
    assert d.slot(2, 1).group_attempt_id == newer.attempt_id


@pytest.fixture
def custom_sampler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"never_lends_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            class OwnSlotOnly:
                name = "own_slot_only"

                def place(self, group, own, open_slots):
                    return own

                def lender(self, slot, candidates):
                    return None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:OwnSlotOnly"


def test_custom_sampler_from_the_config(ledger, custom_sampler: str) -> None:  # type: ignore[no-untyped-def]
    d = Driver(ledger, {"async_rl": {"sampler": {"name": "custom", "import_path": custom_sampler}}})
    d.admit()
    g = d.commit_slot(1, 0)
    d.filter_slot(0, 0)
    # it never lends: the filtered slot gets a spare prompt, the later group stays
    assert d.slot(1, 0).group_attempt_id == g.attempt_id
    assert d.live_of(0, 0).reason == "filter_replacement"
    d.fill_step(0)
    assert d.layout(0) == [("committed", 8), ("committed", 1), ("committed", 2), ("committed", 3)]


def test_a_custom_sampler_answering_outside_its_offer_is_not_followed(ledger, caplog) -> None:  # type: ignore[no-untyped-def]
    """`place` only checked that the slot it named was open: a custom sampler could put a group
    in a step beyond the staleness bound, and `lender` could name any group. Such an answer is
    taken as None (the group parks; the slot takes a spare prompt), with a warning."""
    d = run_with(ledger, "custom", import_path="tests.support.samplers:BeyondTheOffer")
    d.admit()
    with caplog.at_level("WARNING", logger="refill.models.slots"):
        g = d.commit_slot(0, 0)
        assert d.group(g.attempt_id).parked and d.slot(0, 0).group_attempt_id is None
        d.filter_slot(0, 1)
    warnings = [r.getMessage() for r in caplog.records if "was not among what it was offered" in r.getMessage()]
    assert any("sampler's place answered" in w for w in warnings), warnings
    assert any("sampler's lender answered" in w for w in warnings), warnings
    assert d.live_of(0, 1).reason == "filter_replacement"  # a spare prompt, not a phantom loan
