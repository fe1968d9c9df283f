"""`refill config check`: output, exit codes, and the console helpers it is built on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from refill.admin import console
from refill.admin.cli import app

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_refill_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REFILL_DATABASE_URL", raising=False)
    monkeypatch.delenv("REFILL_BROKER_URL", raising=False)


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_ok_prints_resolved_yaml_with_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {builtin: arith}\ngrpo: {num_prompts_per_step: 12}\n")
    result = runner.invoke(app, ["config", "check", str(path), "--no-runtime"])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["run"]["name"] == "run"
    assert resolved["rollout_failure"]["replacement_reserve_prompts"] == 12
    assert resolved["loss"]["ratio_clip_max"] == 0.28
    assert "OK" in result.stderr


def test_json_output_parses(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {builtin: arith}\n")
    result = runner.invoke(app, ["config", "check", str(path), "--json", "--no-runtime"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["grpo"]["dynamic_sampling_max_replacements_per_slot"] == 32


def test_warnings_go_to_stderr_and_keep_exit_zero(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {builtin: arith}\ngrpo: {batch_multiplier: 2}\n")
    result = runner.invoke(app, ["config", "check", str(path), "--json", "--no-runtime"])
    assert result.exit_code == 0
    assert "warning: grpo.batch_multiplier" in result.stderr
    json.loads(result.stdout)


def test_problems_exit_one_with_each_key_path(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {builtin: arith}\ngrpo:\n  num_prompt_per_step: 4\n"
                           "  dynamic_sampling_max_replacements_per_slot: 0\n")
    result = runner.invoke(app, ["config", "check", str(path), "--no-runtime"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert "2 problems" in lines[0]
    assert any(line.startswith("grpo.num_prompt_per_step: unknown key. Fix: did you mean "
                               "grpo.num_prompts_per_step?") for line in lines)
    assert any(line.startswith("grpo.dynamic_sampling_max_replacements_per_slot: ") for line in lines)
    assert result.stdout == ""


def test_missing_file_exits_two_with_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["config", "check", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: ") and "no such file" in result.stderr
    assert "Traceback" not in result.output


def test_yaml_syntax_error_exits_two_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "grpo:\n  - a\n  b: c\n")
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "invalid YAML" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_environment_override_is_noted_without_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFILL_DATABASE_URL", "postgresql+psycopg://app:hunter2@db/refill")
    path = write(tmp_path, "data: {builtin: arith}\n")
    result = runner.invoke(app, ["config", "check", str(path), "--no-runtime"])
    assert result.exit_code == 0
    assert "REFILL_DATABASE_URL overrides it" in result.stderr
    assert "hunter2" not in result.output


def test_password_in_file_is_never_printed(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {builtin: arith}\ninfra:\n  database_url: postgresql+psycopg://a:hunter2@h/db\n")
    result = runner.invoke(app, ["config", "check", str(path), "--no-runtime"])
    assert result.exit_code == 0
    assert "hunter2" not in result.output
    assert "warning: infra.database_url" in result.stderr


@pytest.mark.parametrize("name", ["arith-tiny.yaml", "sim-fleet.yaml", "qwen-math-vllm.yaml"])
def test_shipped_configs_pass(name: str) -> None:
    result = runner.invoke(app, ["config", "check", str(CONFIGS / name), "--no-runtime"])
    assert result.exit_code == 0, result.output


def test_refill_script_runs_as_a_subprocess() -> None:
    script = Path(sys.executable).with_name("refill")
    assert script.exists(), "run `pip install -e . --no-deps` in the venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REFILL_")}
    ok = subprocess.run([str(script), "config", "check", str(CONFIGS / "sim-fleet.yaml")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["generation"]["backend"] == "sim"
    missing = subprocess.run([str(script), "config", "check", "/nonexistent/run.yaml"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: /nonexistent/run.yaml: no such file"


def test_fail_prints_one_error_line_and_exits_with_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as caught:
        console.fail("no run [7] named x", 2)
    assert caught.value.exit_code == 2
    assert capsys.readouterr().err == "error: no run [7] named x\n"


def test_print_table_keeps_brackets_and_blank_nones(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_table([{"slot": "[3, 1]", "reward": 0.5, "worker": None}], title="slots")
    out = capsys.readouterr().out
    assert "[3, 1]" in out and "0.5" in out and "None" not in out


def test_print_table_with_sequence_rows(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_table([(1, "a"), (2, "b")], ["step", "status"])
    out = capsys.readouterr().out
    assert "step" in out and "status" in out and "b" in out
    with pytest.raises(ValueError):
        console.print_table([(1, "a")])


def test_a_wide_table_piped_keeps_every_cell_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal (a log, `| less`) a table prints at its natural width: at rich's 80
    columns these 14 would each be cut to a few characters and an ellipsis."""
    console.print_table([{f"column_{i}": 1000.25 + i for i in range(14)}])
    out = capsys.readouterr().out
    assert "…" not in out
    assert all(f"column_{i}" in out and f"{1000.25 + i:.4g}" in out for i in range(14))


def test_a_large_float_prints_without_an_exponent(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_table([{"seconds": 12345.6, "loss": 0.000123456, "reward": 0.5, "tokens": 9999.7}])
    out = capsys.readouterr().out
    assert "12346" in out and "10000" in out and "e+" not in out
    assert "0.0001235" in out and "0.5" in out


def test_numbers_formatted_as_text_are_right_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    """`num` formats a figure to fixed decimals (a run's seconds `49.0` and `11.4`, a step's fill
    time): its column aligns on the right as a number's does; a column of words stays left."""
    console.print_table([{"seconds": "49.0", "steps": "3/10"}, {"seconds": "1234.5", "steps": "10/10"}])
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if "49.0" in line)
    assert re.search(r"│ {2,}49\.0 │ 3/10 +│", row), row


def test_print_json_is_plain_json(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_json({"a": [1, "[b]"]})
    assert json.loads(capsys.readouterr().out) == {"a": [1, "[b]"]}


def test_console_reexports_redact_url() -> None:
    assert console.redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"


def test_help_reflows_each_docstring_instead_of_keeping_its_source_line_breaks() -> None:
    """A command's docstring is wrapped at 96 columns in the source; its help reads as prose at the
    terminal's width, not broken where the source line ended (rich markup keeps single newlines;
    Markdown, the CLI's markup, joins them)."""
    listing = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert listing.exit_code == 0
    assert "last heartbeat per worker, and how the running runs share it." in listing.output
    detail = runner.invoke(app, ["budget", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert detail.exit_code == 0
    # `**` in a formula is kept (as code), not taken for bold.
    prose = " ".join(detail.output.split())
    assert "1 - (1 - p**(budget+1))**(N * max_num_steps)" in prose and "is p**(budget+1) * N * max_num_steps" in prose
