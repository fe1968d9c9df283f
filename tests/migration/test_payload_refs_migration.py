"""Migration 0009 (issue 17): downgrading reads the claim checks' stored payloads back into the
ledger, and refuses, changing nothing, when one is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import inspect, select, text, update

from refill.models import rollout_codec
from refill.models.db import Ledger
from refill.models.migrate import current_revision, downgrade, upgrade
from refill.models.payload import ClaimCheckResult, Completion
from refill.models.payload_store import FileStore
from refill.models.tables import Group, Run
from tests.support.databases import temporary_pg_database
from tests.support.driver import SPREAD, Driver


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/migrate.db"
    else:
        with temporary_pg_database("refill_migrate_0009") as found:
            yield found


def _claim_checked_run(url: str, run_dir: Path) -> tuple[Ledger, Driver, dict[int, tuple[list[int], list[Completion]]]]:
    """A run whose step 0 holds two claim-checked groups and two inline ones."""
    ledger = Ledger(url)
    # At the revision under test: a later one's downgrade would run (and roll back) with it.
    upgrade(ledger.engine, "0009")
    d = Driver(ledger, check=False)
    ledger.transaction(lambda s: s.execute(update(Run).where(Run.id == d.run_id).values(run_dir=str(run_dir))))
    d.admit()
    store = FileStore.of_run(run_dir)
    stored = {}
    for idx in range(4):
        attempt = d.live_of(0, idx).id
        if idx % 2:
            d.finish_one(attempt, SPREAD)
            continue
        d.start_all([attempt])
        prompt = [1, 2, idx]
        completions = [Completion([3, i], [-0.5, -0.125], f"t{i}", "length") for i in range(4)]
        rollout = rollout_codec.Rollout.build(prompt, completions)
        ref = store.put(attempt, rollout_codec.pack_payload(rollout, rollout_codec.texts(completions)))
        d.record(
            ClaimCheckResult(
                run_id=d.run_id, attempt_id=attempt, worker=d.worker, weight_version=0, rewards=SPREAD,
                payload=ref, prompt_length=3, lengths=[2] * 4,
            )
        )
        stored[attempt] = (prompt, completions)
    return ledger, d, stored


def test_downgrading_0009_reads_the_stored_payloads_back_into_the_ledger(url: str, tmp_path: Path) -> None:
    ledger, d, stored = _claim_checked_run(url, tmp_path / "run")
    with ledger.session() as session:
        before = {g.attempt_id: (g.rollout, g.completion_texts) for g in session.scalars(select(Group)) if g.payload_ref is None}
    assert len(stored) == 2 and len(before) == 2

    downgrade(ledger.engine, "0008")
    assert current_revision(ledger.engine) == "0008"
    assert "payload_ref" not in {c["name"] for c in inspect(ledger.engine).get_columns("groups")}
    with ledger.engine.connect() as connection:
        rows = connection.execute(text("SELECT attempt_id, rollout, completion_texts FROM groups")).all()
    assert len(rows) == 4
    for attempt_id, rollout, texts in rows:
        texts = json.loads(texts) if isinstance(texts, str) else texts  # JSON text on SQLite
        if attempt_id in stored:
            assert rollout_codec.decode(rollout, texts) == stored[attempt_id]
        else:
            assert (bytes(rollout), texts) == (before[attempt_id][0], before[attempt_id][1])

    upgrade(ledger.engine)
    with ledger.session() as session:
        assert all(g.payload_ref is None and g.rollout for g in session.scalars(select(Group)))
    ledger.dispose()


def test_downgrading_0009_refuses_when_a_payload_is_missing_and_changes_nothing(url: str, tmp_path: Path) -> None:
    ledger, d, stored = _claim_checked_run(url, tmp_path / "run")
    victim = min(stored)
    group = d.group(victim)
    assert group is not None and group.payload_ref is not None
    missing = FileStore.of_run(tmp_path / "run").path(group.payload_ref)
    missing.unlink()
    with pytest.raises(RuntimeError, match=f"group {victim}'s payload {missing} cannot be read back into the ledger"):
        downgrade(ledger.engine, "0008")
    ledger.dispose()
    ledger = Ledger(url)
    # It stopped before any row or column changed: the payloads are read before anything is
    # written, and the first one it reads is the missing one.
    assert current_revision(ledger.engine) == "0009"
    with ledger.session() as session:
        assert {g.attempt_id for g in session.scalars(select(Group)) if g.payload_ref is not None} == set(stored)
    ledger.dispose()
