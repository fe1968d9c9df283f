"""The reward of the ``sim`` generation back-end.

The simulated engine decides, per completion, whether the model "solved" the prompt and writes
that into the completion text. Scoring it through this ordinary reward function keeps the path
of a simulated run identical to a real one: engine -> text -> reward function -> ledger.
"""

from __future__ import annotations

from typing import Any

#: Text of a simulated completion that solved its prompt.
SOLVED_MARKER = "<sim:solved>"
#: Text of a simulated completion that did not.
UNSOLVED_MARKER = "<sim:unsolved>"


def solved(completion: str, row: dict[str, Any], **kwargs: Any) -> float:
    """1.0 for a completion that carries the success marker, 0.0 for anything else."""
    return 1.0 if completion.strip() == SOLVED_MARKER else 0.0
