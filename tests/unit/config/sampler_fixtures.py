"""Objects named by `async_rl.sampler.import_path` in the config tests."""

from __future__ import annotations


class GoodSampler:
    def place(self, group, own, open_slots):
        return own

    def lender(self, slot, candidates):
        return None


class PlaceOnly:
    def place(self, group, own, open_slots):
        return own


class NeedsArguments:
    def __init__(self, window: int) -> None:
        self.window = window

    def place(self, group, own, open_slots):
        return own

    def lender(self, slot, candidates):
        return None


not_a_sampler = 42


def reward_ok(completion: str, row: dict, *, scale: float = 1.0) -> float:
    return scale


reward_not_callable = "nope"
