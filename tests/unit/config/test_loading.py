"""Reading YAML files: names, `${VAR}` expansion, duplicate keys, unreadable files."""

from __future__ import annotations

from pathlib import Path

import pytest

from refill.config import ConfigError, ConfigFileError, load_config

from .helpers import build, problem_at


def write(tmp_path: Path, text: str, name: str = "my-run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_run_name_defaults_to_file_stem(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "data: {builtin: arith}\n"), check_runtime=False, environ={})
    assert cfg.run.name == "my-run"


def test_explicit_run_name_wins(tmp_path: Path) -> None:
    path = write(tmp_path, "run: {name: mine}\ndata: {builtin: arith}\n")
    assert load_config(path, check_runtime=False, environ={}).run.name == "mine"


def test_empty_section_means_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "grpo:\ndata: {builtin: arith}\n"), check_runtime=False, environ={})
    assert cfg.grpo.num_prompts_per_step == 8


def test_missing_file_is_a_file_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as caught:
        load_config(tmp_path / "absent.yaml")
    assert "no such file" in caught.value.message


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as caught:
        load_config(write(tmp_path, "grpo:\n  a: [1\n"))
    assert ":3:1: invalid YAML" in caught.value.message
    assert "\n" not in caught.value.message


def test_python_tags_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError):
        load_config(write(tmp_path, "run: !!python/object/apply:os.system ['true']\n"))


def test_duplicate_keys_are_reported_with_lines(tmp_path: Path) -> None:
    text = "data: {builtin: arith}\ngrpo:\n  max_num_steps: 5\n  max_num_steps: 7\n"
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text), check_runtime=False, environ={})
    [p] = caught.value.problems
    assert p.path == "grpo.max_num_steps"
    assert "lines 3 and 4" in p.message


def test_env_default_used_when_unset() -> None:
    cfg = build({"model": {"name_or_path": "${MODEL_DIR:-/models/x}"}})
    assert cfg.model.name_or_path == "/models/x"


def test_env_value_used_when_set() -> None:
    cfg = build({"model": {"name_or_path": "${MODEL_DIR:-/models/x}"}}, environ={"MODEL_DIR": "/m/y"})
    assert cfg.model.name_or_path == "/m/y"


def test_env_expansion_inside_text() -> None:
    cfg = build({"run": {"output_dir": "${BASE:-/tmp}/runs/${USER_X:-me}"}}, environ={"BASE": "/data"})
    assert cfg.run.output_dir == "/data/runs/me"


def test_unset_env_without_default_is_a_problem() -> None:
    p = problem_at("model.name_or_path", {"model": {"name_or_path": "${NOT_SET_ANYWHERE}"}})
    assert "NOT_SET_ANYWHERE" in p.message
    assert "${NOT_SET_ANYWHERE:-" in p.fix


def test_whole_value_env_keeps_numbers_numbers() -> None:
    cfg = build({"grpo": {"max_num_steps": "${STEPS:-20}", "use_dynamic_sampling": "${DS:-false}"},
                 "optimizer": {"lr": "${LR:-1e-4}"}})
    assert cfg.grpo.max_num_steps == 20
    assert cfg.grpo.use_dynamic_sampling is False
    assert cfg.optimizer.lr == pytest.approx(1e-4)


def test_whole_value_env_keeps_text_fields_text() -> None:
    cfg = build({"model": {"name_or_path": "${M:-1234}"}})
    assert cfg.model.name_or_path == "1234"


def test_dollar_dollar_brace_is_literal() -> None:
    cfg = build({"data": {"prompt_template": "$${x} {prompt}"}})
    assert cfg.data.prompt_template == "${x} {prompt}"


def test_unterminated_reference_is_a_problem() -> None:
    p = problem_at("run.output_dir", {"run": {"output_dir": "${OOPS"}})
    assert "unterminated" in p.message


def test_tilde_paths_are_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/tester")
    cfg = build({"run": {"output_dir": "~/runs"}})
    assert cfg.run.output_dir == "/home/tester/runs"


def test_prompt_key_alone_sets_the_template() -> None:
    cfg = build({"data": {"prompt_key": "question"}})
    assert cfg.data.prompt_template == "{question}"
    explicit = build({"data": {"prompt_key": "question", "prompt_template": "Q: {question}\nA:"}})
    assert explicit.data.prompt_template == "Q: {question}\nA:"


def test_config_hash_is_stable_and_sensitive(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {builtin: arith}\ngrpo: {max_num_steps: 7}\n")
    first = load_config(path, check_runtime=False, environ={}).config_hash()
    again = load_config(path, check_runtime=False, environ={}).config_hash()
    assert first == again and len(first) == 64
    other = write(tmp_path, "data: {builtin: arith}\ngrpo: {max_num_steps: 8}\n", name="my-run.yaml")
    assert load_config(other, check_runtime=False, environ={}).config_hash() != first


def test_snapshot_round_trips_through_run_config() -> None:
    # The ledger stores the snapshot; code that rebuilds a RunConfig from it must get the same run.
    from refill.config import RunConfig

    cfg = build({"grpo": {"num_prompts_per_step": 5}, "optimizer": {"betas": [0.8, 0.95]}})
    again = RunConfig.model_validate(cfg.snapshot())
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
