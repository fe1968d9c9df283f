"""Play a run to its end through the ledger API (`tests.support.driver.Driver`): each move
finishes the oldest live attempt with the rewards its prompt's data-set position gives, or,
with nothing live, trains the earliest released step."""

from __future__ import annotations

from collections.abc import Callable

from refill.models.tables import Run
from tests.support.driver import FLAT, SPREAD, Driver


def solved_if_even(position: int) -> list[float]:
    """Even positions always solved (zero-variance), odd ones with spread."""
    return FLAT if position % 2 == 0 else SPREAD


def play(
    d: Driver,
    rewards_of: Callable[[int], list[float]] = solved_if_even,
    *,
    after: Callable[[Driver], None] | None = None,
    moves: int = 5000,
) -> Run:
    """Drive the run until it ends; `after` looks at the ledger after each move."""
    for _ in range(moves):
        d.admit()
        if d.run().status != "running":
            break
        live = d.live()
        if live:
            attempt = min(live, key=lambda a: a.id)
            d.finish_one(attempt.id, rewards_of(d.position(attempt.prompt_id)))
        else:
            released = [s.step for s in d.steps() if s.status == "released"]
            assert released, "nothing live, nothing to train, and the run goes on"
            assert d.train(released[0])
        if after is not None:
            after(d)
    return d.run()
