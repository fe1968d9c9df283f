"""Samplers: which committed group trains in which step (SPEC §4).

The reference keys replacement on a step stamped by the sampler at dispatch, which only its
in-order sampler provides. refill assigns a group's step in the ledger when the group
commits, so every sampler works with dynamic sampling: the ledger offers a sampler the open
slots a group may fill (staleness already checked) and, for a slot that needs a replacement,
the committed groups it may borrow; the sampler only chooses.

A sampler is any object with `place` and `lender` (a custom one is named in config by
`async_rl.sampler.import_path`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

# Named tuples, not frozen dataclasses: as immutable, read the same way, and made about three
# times faster; a batch makes tens of thousands (an extra's placement offers up to 32 slots).


class SlotView(NamedTuple):
    step: int
    idx: int
    #: its own prompt was filtered or dropped, and it waits on a replacement
    needs_replacement: bool


class GroupView(NamedTuple):
    attempt_id: int
    weight_version: int
    #: where it sits now; None for parked surplus
    step: int | None
    idx: int | None


@runtime_checkable
class Sampler(Protocol):
    name: str

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        """The slot a newly committed group fills: `own` (the slot its attempt served, None for
        an over-dispatched extra), one of `open_slots` (open slots of earlier or equal steps
        the group may fill, sorted by step then index), or None to park it as surplus. Any
        other answer is taken as None, with a warning (`slots.place`)."""

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        """A committed group to move into `slot` (which needs a replacement), from
        `candidates` (parked groups and groups of later, unreleased steps, all within the
        staleness bound of `slot`), or None to dispatch a spare prompt instead. A group not
        among `candidates` is taken as None, with a warning (`slots.replace`)."""


def _prefer_parked_then_latest(candidates: Sequence[GroupView]) -> GroupView | None:
    # Parked surplus costs nothing to take. Otherwise lend from the latest step: it has the
    # longest to refill, while the next step to release keeps its groups.
    if not candidates:
        return None
    parked = [c for c in candidates if c.step is None]
    if parked:
        return min(parked, key=lambda c: (c.weight_version, c.attempt_id))
    return max(candidates, key=lambda c: (c.step, c.attempt_id))


class InOrder:
    """A group trains in the step it was dispatched for; the exception is a slot whose own
    prompt was filtered or dropped, which takes the next group committed for a later step
    rather than waiting a whole generation for its replacement (the replacement then serves
    the later step)."""

    name = "in_order"

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        ceiling = own.step if own is not None else None
        for slot in open_slots:
            if slot.needs_replacement and (ceiling is None or slot.step < ceiling):
                return slot
        if own is not None:
            return own
        return open_slots[0] if open_slots else None

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        return _prefer_parked_then_latest(candidates)


class ReadyFirst:
    """The earliest open step takes any committed group within the staleness bound."""

    name = "ready_first"

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        choices = list(open_slots) + ([own] if own is not None else [])
        return min(choices, key=lambda s: (s.step, not s.needs_replacement, s.idx), default=None)

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        return _prefer_parked_then_latest(candidates)


class WeightFifo:
    """Groups train in order of the weight version they were generated with: the earliest
    open step takes the group with the oldest weights."""

    name = "weight_fifo"

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        return ReadyFirst.place(self, group, own, open_slots)  # type: ignore[arg-type]

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        if not candidates:
            return None
        return min(candidates, key=lambda c: (c.weight_version, c.step is not None, c.attempt_id))


class Windowed:
    """Groups within `max_staleness_versions` of the step they train in; optionally the
    freshest group first when borrowing."""

    name = "windowed"

    def __init__(self, max_staleness_versions: int, freshest_first: bool = False) -> None:
        self.window = max_staleness_versions
        self.freshest_first = freshest_first

    def _fits(self, group: GroupView, slot: SlotView) -> bool:
        return slot.step - group.weight_version <= self.window

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        choices = [s for s in open_slots if self._fits(group, s)]
        if own is not None and self._fits(group, own):
            choices.append(own)
        return min(choices, key=lambda s: (s.step, not s.needs_replacement, s.idx), default=None)

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        fitting = [c for c in candidates if self._fits(c, slot)]
        if not fitting:
            return None
        if self.freshest_first:
            return max(fitting, key=lambda c: (c.weight_version, -c.attempt_id))
        return min(fitting, key=lambda c: (c.weight_version, c.attempt_id))


BUILTIN = ("in_order", "ready_first", "weight_fifo", "windowed")


class SamplerError(ValueError):
    pass


def load_custom(import_path: str, options: dict[str, Any] | None = None) -> Sampler:
    """Import `module:attr`; a class is instantiated (with `options` as keyword arguments)."""
    module_name, _, attr = import_path.partition(":")
    if not module_name or not attr:
        raise SamplerError(f"import_path {import_path!r} must look like 'package.module:Name'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise SamplerError(f"cannot import sampler {import_path!r}: {error}") from error
    if isinstance(obj, type):
        obj = obj(**(options or {}))
    missing = [m for m in ("place", "lender") if not callable(getattr(obj, m, None))]
    if missing:
        raise SamplerError(
            f"sampler {import_path!r} cannot assign steps: it has no callable "
            f"{' or '.join(missing)} (see refill.models.samplers.Sampler)"
        )
    return obj


def make_sampler(
    name: str,
    *,
    max_staleness_versions: int | None = None,
    freshest_first: bool = False,
    import_path: str | None = None,
    max_lookahead_versions: int = 0,
) -> Sampler:
    if name == "in_order":
        return InOrder()
    if name == "ready_first":
        return ReadyFirst()
    if name == "weight_fifo":
        return WeightFifo()
    if name == "windowed":
        window = max_lookahead_versions if max_staleness_versions is None else max_staleness_versions
        return Windowed(window, freshest_first)
    if name == "custom":
        if not import_path:
            raise SamplerError("async_rl.sampler.name is 'custom' but import_path is not set")
        return load_custom(import_path)
    raise SamplerError(f"unknown sampler {name!r}; choose one of {', '.join(BUILTIN)} or custom")
