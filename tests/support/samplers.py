"""A custom sampler, as a user would write one (named by async_rl.sampler.import_path)."""

from __future__ import annotations

from collections.abc import Sequence

from refill.models.samplers import GroupView, SlotView


class LatestFirst:
    """Place a group in its own slot; borrow the group committed most recently."""

    name = "latest_first"

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        return own if own is not None else (open_slots[0] if open_slots else None)

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        return max(candidates, key=lambda c: c.attempt_id, default=None)


class BeyondTheOffer:
    """A sampler that breaks its contract: it places every group four steps ahead, and names a
    lender that does not exist. The ledger must not follow it."""

    name = "beyond_the_offer"

    def place(self, group: GroupView, own: SlotView | None, open_slots: Sequence[SlotView]) -> SlotView | None:
        anchor = own or (open_slots[0] if open_slots else None)
        return None if anchor is None else SlotView(anchor.step + 4, 0, False)

    def lender(self, slot: SlotView, candidates: Sequence[GroupView]) -> GroupView | None:
        return GroupView(10**9, 0, slot.step + 1, 0)
