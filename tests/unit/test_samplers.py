"""Every sampler of SPEC §4 and the custom-sampler loader, without a database."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from refill.models.samplers import (
    BUILTIN,
    GroupView,
    InOrder,
    ReadyFirst,
    Sampler,
    SamplerError,
    SlotView,
    WeightFifo,
    Windowed,
    load_custom,
    make_sampler,
)


def slot(step: int, idx: int, needs: bool = False) -> SlotView:
    return SlotView(step, idx, needs)


def group(attempt_id: int, version: int, step: int | None = None, idx: int | None = None) -> GroupView:
    return GroupView(attempt_id, version, step, idx)


G = group(100, 1)


# --- in_order ----------------------------------------------------------------------------


def test_in_order_keeps_a_group_in_its_own_slot() -> None:
    own = slot(3, 1)
    assert InOrder().place(G, own, []) == own
    # an earlier open slot that does not wait on a replacement is not taken
    assert InOrder().place(G, own, [slot(2, 0), slot(2, 3)]) == own


def test_in_order_fills_the_first_earlier_slot_waiting_on_a_replacement() -> None:
    own = slot(3, 1)
    candidates = [slot(1, 0), slot(1, 2, needs=True), slot(2, 0, needs=True)]
    assert InOrder().place(G, own, candidates) == slot(1, 2, True)


def test_in_order_never_moves_a_group_to_its_own_step_or_later() -> None:
    own = slot(2, 1)
    assert InOrder().place(G, own, [slot(2, 0, needs=True), slot(3, 0, needs=True)]) == own


def test_in_order_places_an_extra_in_the_first_slot_or_parks_it() -> None:
    assert InOrder().place(G, None, [slot(1, 3), slot(2, 0, needs=True)]) == slot(2, 0, True)
    assert InOrder().place(G, None, [slot(1, 3), slot(2, 0)]) == slot(1, 3)
    assert InOrder().place(G, None, []) is None


def test_in_order_lender_prefers_parked_oldest_then_latest_step() -> None:
    sampler = InOrder()
    committed = [group(10, 1, 2, 0), group(11, 1, 3, 0), group(12, 1, 3, 1)]
    parked = [group(20, 2), group(21, 1), group(19, 1)]
    assert sampler.lender(slot(1, 0, True), committed + parked) == group(19, 1)
    # no parked group: the latest step lends, its newest group first
    assert sampler.lender(slot(1, 0, True), committed) == group(12, 1, 3, 1)
    assert sampler.lender(slot(1, 0, True), []) is None


# --- ready_first -------------------------------------------------------------------------


def test_ready_first_takes_the_earliest_open_step() -> None:
    own = slot(3, 0)
    assert ReadyFirst().place(G, own, [slot(1, 2), slot(2, 0, needs=True)]) == slot(1, 2)
    assert ReadyFirst().place(G, own, []) == own


def test_ready_first_prefers_a_slot_waiting_on_a_replacement_within_a_step() -> None:
    assert ReadyFirst().place(G, slot(3, 0), [slot(1, 0), slot(1, 3, needs=True)]) == slot(1, 3, True)
    # then the lowest index
    assert ReadyFirst().place(G, slot(3, 0), [slot(1, 2), slot(1, 1)]) == slot(1, 1)


def test_ready_first_own_slot_wins_only_when_nothing_earlier() -> None:
    own = slot(1, 3)
    assert ReadyFirst().place(G, own, [slot(1, 0)]) == slot(1, 0)
    assert ReadyFirst().place(G, None, []) is None


def test_ready_first_lender_is_the_in_order_one() -> None:
    candidates = [group(10, 0, 2, 0), group(11, 0, 4, 1)]
    assert ReadyFirst().lender(slot(1, 0, True), candidates) == group(11, 0, 4, 1)
    assert ReadyFirst().lender(slot(1, 0, True), candidates + [group(3, 0)]) == group(3, 0)


# --- weight_fifo -------------------------------------------------------------------------


def test_weight_fifo_places_like_ready_first() -> None:
    own = slot(3, 0)
    candidates = [slot(2, 1), slot(1, 2), slot(1, 0, needs=True)]
    assert WeightFifo().place(G, own, candidates) == slot(1, 0, True)
    assert WeightFifo().place(G, own, []) == own


def test_weight_fifo_lends_the_oldest_weights_first() -> None:
    candidates = [group(10, 2, 3, 0), group(11, 1, 4, 0), group(12, 2)]
    assert WeightFifo().lender(slot(2, 0, True), candidates) == group(11, 1, 4, 0)


def test_weight_fifo_breaks_version_ties_parked_first_then_attempt() -> None:
    candidates = [group(10, 1, 3, 0), group(14, 1), group(12, 1)]
    assert WeightFifo().lender(slot(2, 0, True), candidates) == group(12, 1)
    assert WeightFifo().lender(slot(2, 0, True), [group(10, 1, 3, 0), group(9, 1, 4, 0)]) == group(9, 1, 4, 0)
    assert WeightFifo().lender(slot(2, 0, True), []) is None


# --- windowed ----------------------------------------------------------------------------


def test_windowed_places_only_within_the_window() -> None:
    sampler = Windowed(max_staleness_versions=1)
    g = group(1, 2)  # generated with v2: fits steps <= 3
    assert sampler.place(g, slot(3, 0), [slot(2, 1)]) == slot(2, 1)
    assert sampler.place(g, slot(4, 0), []) is None  # 4 - 2 = 2 > 1, own slot too stale
    assert sampler.place(g, slot(4, 0), [slot(3, 2), slot(3, 0, needs=True)]) == slot(3, 0, True)


def test_windowed_zero_window_is_on_policy() -> None:
    sampler = Windowed(0)
    assert sampler.place(group(1, 1), slot(1, 0), []) == slot(1, 0)
    assert sampler.place(group(1, 1), slot(2, 0), [slot(1, 3)]) == slot(1, 3)
    assert sampler.place(group(1, 0), slot(1, 0), []) is None


def test_windowed_lender_oldest_fitting_or_freshest_first() -> None:
    candidates = [group(10, 0, 3, 0), group(11, 2, 4, 0), group(12, 1), group(13, 2)]
    target = slot(2, 0, True)  # window 1: versions >= 1 fit
    assert Windowed(1).lender(target, candidates) == group(12, 1)
    assert Windowed(1, freshest_first=True).lender(target, candidates) == group(11, 2, 4, 0)
    assert Windowed(0).lender(target, candidates) == group(11, 2, 4, 0)
    assert Windowed(0).lender(slot(5, 0, True), candidates) is None


# --- loading -----------------------------------------------------------------------------


def test_make_sampler_builtins() -> None:
    assert isinstance(make_sampler("in_order"), InOrder)
    assert isinstance(make_sampler("ready_first"), ReadyFirst)
    assert isinstance(make_sampler("weight_fifo"), WeightFifo)
    windowed = make_sampler("windowed", max_lookahead_versions=3)
    assert isinstance(windowed, Windowed) and windowed.window == 3 and not windowed.freshest_first
    narrow = make_sampler("windowed", max_staleness_versions=1, freshest_first=True, max_lookahead_versions=3)
    assert isinstance(narrow, Windowed) and narrow.window == 1 and narrow.freshest_first
    for name in BUILTIN:
        sampler = make_sampler(name)
        assert isinstance(sampler, Sampler) and sampler.name == name


def test_make_sampler_errors() -> None:
    with pytest.raises(SamplerError, match="unknown sampler 'fifo'; choose one of in_order, ready_first, weight_fifo, windowed or custom"):
        make_sampler("fifo")
    with pytest.raises(SamplerError, match="'custom' but import_path is not set"):
        make_sampler("custom")


@pytest.fixture
def sampler_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"custom_samplers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            class Last:
                name = "last"

                def __init__(self, offset=0):
                    self.offset = offset

                def place(self, group, own, open_slots):
                    return own

                def lender(self, slot, candidates):
                    return candidates[-1] if candidates else None

            class NoPlace:
                def lender(self, slot, candidates):
                    return None

            class Nothing:
                pass

            class NotCallable:
                place = 3
                lender = None

            INSTANCE = Last(offset=5)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_custom_instantiates_a_class_with_options(sampler_module: str) -> None:
    sampler = load_custom(f"{sampler_module}:Last", {"offset": 2})
    assert type(sampler).__name__ == "Last" and sampler.offset == 2  # type: ignore[attr-defined]
    assert sampler.lender(slot(0, 0, True), [group(1, 0), group(2, 0)]) == group(2, 0)
    assert make_sampler("custom", import_path=f"{sampler_module}:Last").place(G, slot(1, 1), []) == slot(1, 1)


def test_load_custom_takes_an_instance_as_is(sampler_module: str) -> None:
    sampler = load_custom(f"{sampler_module}:INSTANCE")
    assert sampler.offset == 5  # type: ignore[attr-defined]


def test_load_custom_missing_module() -> None:
    with pytest.raises(SamplerError, match=r"cannot import sampler 'no_such_module_xyz:S': No module named 'no_such_module_xyz'"):
        load_custom("no_such_module_xyz:S")


def test_load_custom_missing_attribute(sampler_module: str) -> None:
    with pytest.raises(SamplerError, match=rf"cannot import sampler '{sampler_module}:Missing'"):
        load_custom(f"{sampler_module}:Missing")


@pytest.mark.parametrize("path", ["just_a_module", ":Name", "module:"])
def test_load_custom_malformed_path(path: str) -> None:
    with pytest.raises(SamplerError, match="must look like 'package.module:Name'"):
        load_custom(path)


@pytest.mark.parametrize(
    ("attr", "missing"),
    [("NoPlace", "place"), ("Nothing", "place or lender"), ("NotCallable", "place or lender")],
)
def test_load_custom_without_place_or_lender_cannot_assign_steps(sampler_module: str, attr: str, missing: str) -> None:
    with pytest.raises(SamplerError) as raised:
        load_custom(f"{sampler_module}:{attr}")
    assert str(raised.value) == (
        f"sampler '{sampler_module}:{attr}' cannot assign steps: it has no callable {missing} "
        "(see refill.models.samplers.Sampler)"
    )
