"""`refill prompts RUN` and the `prompt_history` view (migration 0007) on both ledgers, migrated
by Alembic like `refill db upgrade`: a run played through three epochs with pre-rollout
skipping, its prompts known by their row's `i` (`data.prompt_id_field`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from refill.admin.cli import app
from refill.admin.prompt_queries import COLUMNS
from refill.models.db import Ledger
from refill.models.migrate import upgrade
from tests.support.databases import temporary_pg_database
from tests.support.driver import Driver
from tests.support.play import play

runner = CliRunner()

CONFIG = {
    "grpo": {"max_num_steps": 50, "max_num_epochs": 3, "dynamic_sampling_max_replacements_per_slot": 16},
    "data": {"prompt_id_field": "i", "prompt_skipping": {"enabled": True, "exploration_rate": 0.05}},
}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def played(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    def setup(url: str) -> tuple[str, int]:
        upgrade(url)
        ledger = Ledger(url)
        d = Driver(ledger, CONFIG, num_prompts=16, check=False)
        assert play(d).status == "completed"
        ledger.dispose()
        return url, d.run_id

    if request.param == "sqlite":
        yield setup(f"sqlite:///{tmp_path_factory.mktemp('prompts')}/refill.db")
    else:
        with temporary_pg_database("refill_prompts") as url:
            yield setup(url)


def invoke(url: str, *args: str) -> Any:
    return runner.invoke(app, [*args, "--database-url", url])


def as_json(url: str, *args: str) -> Any:
    result = invoke(url, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def view(url: str, run: int) -> list[dict[str, Any]]:
    ledger = Ledger(url)
    try:
        with ledger.engine.connect() as connection:
            rows = connection.execute(
                text("SELECT * FROM prompt_history WHERE run_id = :r ORDER BY position"), {"r": run}
            ).mappings()
            return [dict(row) for row in rows]
    finally:
        ledger.dispose()


def test_the_command_and_the_view_agree(played: tuple[str, int]) -> None:
    url, run = played
    shown = as_json(url, "prompts", str(run))
    assert shown["skipping"]["enabled"] and shown["skipping"]["skipped"] > 0
    rows, in_sql = shown["prompts"], view(url, run)
    assert [r["position"] for r in rows] == list(range(16))
    assert [r["prompt_key"] for r in rows] == [str(i) for i in range(16)]  # the row's "i"
    assert len(in_sql) == len(rows)
    for mine, theirs in zip(rows, in_sql, strict=True):
        for column in COLUMNS:
            expected = theirs[column]
            if column == "skip_state" or column == "streak_kind" or column == "prompt_key":
                assert mine[column] == expected, (column, mine, theirs)
            elif expected is None:
                assert mine[column] is None, (column, mine, theirs)
            else:
                assert mine[column] == pytest.approx(float(expected)), (column, mine, theirs)
    # Even prompts are always solved: a streak of all-solved groups; odd ones never have one.
    assert all(r["streak_kind"] == "solved" and r["zero_variance_streak"] >= 1 for r in rows if r["position"] % 2 == 0 and r["scored"])
    assert all(r["zero_variance_streak"] == 0 and r["skips"] == 0 for r in rows if r["position"] % 2 == 1)
    assert all(r["draws"] == 3 for r in rows)  # three epochs, every prompt reached in each


def test_skipped_lists_the_prompts_skipped_at_their_last_draw(played: tuple[str, int]) -> None:
    url, run = played
    everything = as_json(url, "prompts", str(run))["prompts"]
    skipped = as_json(url, "prompts", str(run), "--skipped")["prompts"]
    assert skipped == [r for r in everything if r["skip_state"] == "skipped"]
    assert skipped and all(r["position"] % 2 == 0 for r in skipped)
    table = invoke(url, "prompts", str(run), "--skipped")
    assert table.exit_code == 0, table.output
    assert "skipped at their last draw" in table.stdout and "skipping on" in table.stderr


def test_the_run_checks_and_shows_its_costs(played: tuple[str, int], tmp_path: Path) -> None:
    url, run = played
    check = invoke(url, "check", str(run))
    assert check.exit_code == 0, check.output
    metrics = as_json(url, "metrics", str(run))
    assert sum(m["skipped_prompts"] for m in metrics) > 0
    assert all(m["rollouts_per_trained_group"] >= 1.0 for m in metrics)
    once = invoke(url, "tail", str(run), "--once")
    assert once.exit_code == 0 and "gen/grp" in once.stdout
    assert invoke(url, "plot", str(run), "-o", str(tmp_path / "p.png")).exit_code == 0


def test_an_unknown_run(played: tuple[str, int]) -> None:
    url, _ = played
    result = invoke(url, "prompts", "999")
    assert result.exit_code == 2 and "999" in result.stderr
