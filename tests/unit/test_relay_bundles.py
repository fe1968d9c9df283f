"""The relay sends a run's generate messages in bundles (one Celery message for up to
GENERATE_BUNDLE attempts) and everything else as it is, in the order the outbox gave."""

from __future__ import annotations

from refill.models.outbox import Outgoing
from refill.tasks.relay import GENERATE_BUNDLE, _envelopes


def generate(row_id: int, run_id: int) -> Outgoing:
    return Outgoing(kind="generate", queue="generate", run_id=run_id, body={"run_id": run_id, "attempt_id": 100 + row_id})


def train(row_id: int, run_id: int, step: int) -> Outgoing:
    return Outgoing(outbox_id=row_id, kind="train_step", queue="train", run_id=run_id, body={"run_id": run_id, "step": step})


def ident(row: Outgoing) -> int | None:
    """The number a message was made with: a train_step's outbox row, a generate's attempt."""
    return row.attempt_id - 100 if row.attempt_id is not None else row.outbox_id


def test_generate_messages_of_a_run_share_bundles_of_at_most_the_bundle_size() -> None:
    rows = [generate(i, 1) for i in range(GENERATE_BUNDLE * 2 + 3)]
    envelopes = _envelopes(rows)
    assert [len(bundle) for _, bundle in envelopes] == [GENERATE_BUNDLE, GENERATE_BUNDLE, 3]
    assert [ident(row) for _, bundle in envelopes for row in bundle] == [ident(row) for row in rows]


def test_runs_are_never_mixed_and_train_messages_go_alone() -> None:
    rows = [generate(1, 1), generate(2, 2), train(3, 1, 0), generate(4, 1), generate(5, 2)]
    envelopes = [(queue, [ident(row) for row in bundle]) for queue, bundle in _envelopes(rows)]
    assert envelopes == [("generate", [1, 4]), ("generate", [2, 5]), ("train", [3])]
