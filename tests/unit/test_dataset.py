"""Loading and validating data sets: every bad row reported with its line number."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from refill.config import config_from_dict
from refill.data import arith
from refill.models.dataset import (
    MAX_LISTED_ROWS,
    DatasetError,
    data_source_fingerprint,
    format_prompt,
    load_dataset,
    template_fields,
)


def file_config(path: Path, **data: object):
    return config_from_dict({"data": {"train_path": str(path), **data}}, environ={})


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_builtin_arith_rows_follow_the_seed() -> None:
    cfg = config_from_dict({"data": {"builtin": "arith", "builtin_size": 50}, "run": {"seed": 3}}, environ={})
    rows = load_dataset(cfg)
    assert rows == arith.generate(50, seed=3)


def test_builtin_honours_max_rows() -> None:
    cfg = config_from_dict({"data": {"builtin": "arith", "max_rows": 7}}, environ={})
    assert len(load_dataset(cfg)) == 7


def test_jsonl_rows_in_file_order_blank_lines_skipped(tmp_path: Path) -> None:
    path = write(tmp_path, ['{"prompt": "a", "answer": "1"}', "", "   ", '{"prompt": "b", "answer": "2"}'])
    assert [r["prompt"] for r in load_dataset(file_config(path))] == ["a", "b"]


def test_every_bad_row_is_reported_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, [
        '{"prompt": "ok", "answer": "1"}',      # 1
        "{not json",                             # 2
        '["a", "list"]',                         # 3
        '{"question": "x"}',                     # 4
        '{"prompt": ""}',                        # 5
        '{"prompt": 12}',                        # 6
        '{"prompt": "fine"}',                    # 7: lacks "answer" the template uses
        '{"prompt": "x", "answer": NaN}',        # 8
    ])
    with pytest.raises(DatasetError) as caught:
        load_dataset(file_config(path, prompt_template="{prompt} = ? ({answer})"))
    lines = {p.line: p.message for p in caught.value.problems}
    assert sorted(lines) == [2, 3, 4, 5, 6, 7, 8]
    assert "not valid JSON" in lines[2]
    assert "array, not an object" in lines[3]
    assert "no 'prompt' field" in lines[4] and "question" in lines[4]
    assert "is empty" in lines[5]
    assert "number, not a string" in lines[6]
    assert "'answer'" in lines[7] and "prompt_template" in lines[7]
    assert "NaN" in lines[8]
    assert "7 bad rows" in str(caught.value)
    assert "line 2:" in str(caught.value)


def test_error_lists_twenty_rows_then_counts(tmp_path: Path) -> None:
    path = write(tmp_path, ["nope"] * (MAX_LISTED_ROWS + 5))
    with pytest.raises(DatasetError) as caught:
        load_dataset(file_config(path))
    text = str(caught.value)
    assert f"line {MAX_LISTED_ROWS}:" in text
    assert f"line {MAX_LISTED_ROWS + 1}:" not in text
    assert "... and 5 more" in text
    assert len(caught.value.problems) == MAX_LISTED_ROWS + 5


def test_max_rows_stops_reading(tmp_path: Path) -> None:
    path = write(tmp_path, ['{"prompt": "a"}', '{"prompt": "b"}', "broken line beyond the limit"])
    rows = load_dataset(file_config(path, max_rows=2))
    assert [r["prompt"] for r in rows] == ["a", "b"]


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, ["", "  "])
    with pytest.raises(DatasetError) as caught:
        load_dataset(file_config(path))
    assert "no rows" in str(caught.value)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as caught:
        load_dataset(file_config(tmp_path / "absent.jsonl"))
    assert "does not exist" in str(caught.value)


def test_non_utf8_line_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError) as caught:
        load_dataset(file_config(path))
    assert [p.line for p in caught.value.problems] == [2]


def test_utf8_bom_on_first_line_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')
    assert load_dataset(file_config(path)) == [{"prompt": "a"}]


def test_prompt_key_sets_the_template_for_other_field_names(tmp_path: Path) -> None:
    path = write(tmp_path, [json.dumps({"problem": "2+2?", "answer": "4"})])
    cfg = file_config(path, prompt_key="problem")
    [row] = load_dataset(cfg)
    assert format_prompt(cfg.data.prompt_template, row) == "2+2?"


def test_template_fields() -> None:
    assert template_fields("{problem}\nUse \\boxed{{}}: {problem} {hint.x} {meta[0]}") == ["problem", "hint", "meta"]
    with pytest.raises(ValueError):
        template_fields("{0}")


def test_fingerprint_is_stable_and_content_sensitive() -> None:
    rows = [{"prompt": "a", "answer": "1"}, {"answer": "2", "prompt": "b"}]
    same = [{"answer": "1", "prompt": "a"}, {"prompt": "b", "answer": "2"}]
    assert data_source_fingerprint(rows) == data_source_fingerprint(same)
    assert data_source_fingerprint(rows) != data_source_fingerprint(rows[::-1])
    assert data_source_fingerprint(rows) != data_source_fingerprint([{"prompt": "a", "answer": "1"}])
    assert len(data_source_fingerprint(rows)) == 64


def test_duck_typed_config_is_accepted(tmp_path: Path) -> None:
    # Ledger code may hold only the resolved sections (e.g. from a snapshot), not a RunConfig.
    data = SimpleNamespace(train_path=None, builtin="arith", builtin_size=3, prompt_key="prompt",
                           prompt_template="{prompt}", max_rows=None)
    assert len(load_dataset(SimpleNamespace(data=data, run=SimpleNamespace(seed=0)))) == 3
