"""Run-time checks: what cannot work when the run starts is rejected at setup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import build, problem_at, problems

FIXTURES = "tests.unit.config.sampler_fixtures"


def test_pure_validation_does_not_import_the_reward() -> None:
    cfg = build({"reward": {"function": "no_such_module_xyz:score"}}, runtime=False)
    assert cfg.reward.function == "no_such_module_xyz:score"


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        ("no_such_module_xyz:score", "cannot be found"),
        ("refill.rewards.arith:no_such_function", "has no attribute"),
        (f"{FIXTURES}:reward_not_callable", "not a function"),
        ("tests.unit.config.broken_module:score", "boom at import"),
    ],
)
def test_reward_function_that_does_not_load(function: str, expected: str) -> None:
    p = problem_at("reward.function", {"reward": {"function": function}}, runtime=True)
    assert expected in p.message


def test_reward_kwargs_that_the_function_does_not_take() -> None:
    p = problem_at("reward.kwargs",
                   {"reward": {"function": f"{FIXTURES}:reward_ok", "kwargs": {"scael": 2.0}}}, runtime=True)
    assert "scael" in p.message


def test_reward_with_matching_kwargs_is_accepted() -> None:
    cfg = build({"reward": {"function": f"{FIXTURES}:reward_ok", "kwargs": {"scale": 2.0}},
                 "generation": {"backend": "sim"}, "infra": {"trainer": "null"}}, runtime=True)
    assert cfg.reward.kwargs == {"scale": 2.0}


def test_missing_data_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    p = problem_at("data.train_path", {"data": {"builtin": None, "train_path": str(missing)}}, runtime=True)
    assert "does not exist" in p.message


def test_bad_data_rows_are_reported_by_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1="}\nnot json\n{"question": "x"}\n')
    found = [p for p in problems({"data": {"builtin": None, "train_path": str(path)},
                                  "generation": {"backend": "sim"}, "infra": {"trainer": "null"}},
                                 runtime=True) if p.path == "data.train_path"]
    assert len(found) == 2
    assert "line 2 is not valid JSON" in found[0].message
    assert "line 3 has no 'prompt' field" in found[1].message


def _sim_null() -> dict:
    return {"generation": {"backend": "sim"}, "infra": {"trainer": "null"}}


def test_model_path_that_does_not_exist(tmp_path: Path) -> None:
    p = problem_at("model.name_or_path", {"model": {"name_or_path": str(tmp_path / "absent")}}, runtime=True)
    assert "does not exist" in p.message
    assert "huggingface-cli download" in p.fix


def test_model_directory_without_config_json(tmp_path: Path) -> None:
    p = problem_at("model.name_or_path", {"model": {"name_or_path": str(tmp_path)}}, runtime=True)
    assert "no config.json" in p.message


def test_model_directory_with_broken_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    p = problem_at("model.name_or_path", {"model": {"name_or_path": str(tmp_path)}}, runtime=True)
    assert "not readable JSON" in p.message


def test_unknown_builtin_model() -> None:
    p = problem_at("model.name_or_path", {"model": {"name_or_path": "builtin:huge"}}, runtime=True)
    assert "tiny-arith" in p.message


def test_model_check_is_skipped_when_nothing_loads_a_model(tmp_path: Path) -> None:
    cfg = build({"model": {"name_or_path": str(tmp_path / "absent")}, **_sim_null()}, runtime=True)
    assert cfg.model.name_or_path.endswith("absent")
    # Either side loading a model brings the check back.
    problem_at("model.name_or_path", {"model": {"name_or_path": str(tmp_path / "absent")},
                                      "generation": {"backend": "sim"}}, runtime=True)


def test_model_directory_that_transformers_cannot_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    p = problem_at("model.name_or_path", {"model": {"name_or_path": str(tmp_path)}}, runtime=True)
    assert "transformers cannot load" in p.message


def test_environment_url_is_checked_at_run_time() -> None:
    p = problem_at("infra.database_url", runtime=True,
                   environ={"REFILL_DATABASE_URL": "mysql://u:pw@h/db"}, overrides=_sim_null())
    assert "REFILL_DATABASE_URL" in p.message
    assert ":***@" in p.message and ":pw@" not in p.message
