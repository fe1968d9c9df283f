"""Loading and validating a run's data set.

A data set is either the builtin arithmetic task or a JSONL file with one JSON object per line.
Every bad row is collected and reported with its line number before anything else happens, so a
user fixes the file once instead of once per launch.

Rows are returned in file order. Shuffling is the data loader's job (`refill.models.dataloader`),
because the order must change per epoch and be reproducible on resume.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: How many bad rows a `DatasetError` lists before it only counts the rest.
MAX_LISTED_ROWS = 20

_FIELD_BASE = re.compile(r"^[^.\[]+")


@dataclass(frozen=True)
class RowProblem:
    line: int | None  # 1-based line in the file; None for a problem with the whole source
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line is not None else self.message


class DatasetError(ValueError):
    """A data set that cannot be used; `problems` lists every bad row found."""

    def __init__(self, source: str, problems: list[RowProblem]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self._render())

    def _render(self) -> str:
        rows = [p for p in self.problems if p.line is not None]
        if not rows:
            return f"{self.source}: " + "; ".join(str(p) for p in self.problems)
        lines = [f"{self.source}: {len(rows)} bad row{'s' if len(rows) != 1 else ''}"]
        lines += [f"  {p}" for p in rows[:MAX_LISTED_ROWS]]
        if len(rows) > MAX_LISTED_ROWS:
            lines.append(f"  ... and {len(rows) - MAX_LISTED_ROWS} more")
        return "\n".join(lines)


def template_fields(template: str) -> list[str]:
    """Row fields a prompt template reads, in order of first use.

    Raises ValueError for a template that cannot be formatted at all (an unmatched brace, a
    positional `{}`), which is a config error rather than a row error.
    """
    fields: list[str] = []
    for _literal, field, _spec, _conversion in string.Formatter().parse(template):
        if field is None:
            continue
        base = _FIELD_BASE.match(field)
        if field == "" or base is None or base.group(0).isdigit():
            raise ValueError(
                "positional fields like {} or {0} have no row field to read; name the field, "
                "e.g. {prompt}"
            )
        if base.group(0) not in fields:
            fields.append(base.group(0))
    return fields


def format_prompt(template: str, row: dict[str, Any]) -> str:
    """The prompt text of one row: `data.prompt_template` formatted with the row's fields."""
    return template.format(**row)


def _check_row(row: Any, prompt_key: str, template: str, fields: list[str]) -> str | None:
    """Why `row` cannot be used, or None when it can."""
    if not isinstance(row, dict):
        return f"is a JSON {_json_kind(row)}, not an object"
    if prompt_key not in row:
        present = ", ".join(sorted(row)) or "none"
        return f"has no {prompt_key!r} field (data.prompt_key); its fields are: {present}"
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        return f"field {prompt_key!r} is a JSON {_json_kind(prompt)}, not a string"
    if not prompt.strip():
        return f"field {prompt_key!r} is empty"
    missing = [f for f in fields if f not in row]
    if missing:
        return (
            f"lacks field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
            "used by data.prompt_template"
        )
    try:
        format_prompt(template, row)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        return f"cannot be formatted with data.prompt_template: {type(exc).__name__}: {exc}"
    return None


def prompt_id_of(row: dict[str, Any], field: str) -> str:
    """A row's id under `data.prompt_id_field`, as text (an integer id 7 is "7")."""
    return str(row[field])


def _check_id(row: dict[str, Any], field: str, line: int, seen: dict[str, int]) -> str | None:
    """Why a row's `data.prompt_id_field` cannot identify it, or None; `seen` maps the ids met
    so far to their lines (a prompt's history is kept by its identity, so two rows must not
    share one)."""
    if field not in row:
        return f"has no {field!r} field (data.prompt_id_field names each row's id)"
    value = row[field]
    if isinstance(value, bool) or not isinstance(value, str | int):
        return f"field {field!r} (data.prompt_id_field) is a JSON {_json_kind(value)}; an id is a string or an integer"
    key = prompt_id_of(row, field)
    if not key.strip():
        return f"field {field!r} (data.prompt_id_field) is empty"
    if key in seen:
        return f"has the id {key!r} (data.prompt_id_field) of line {seen[key]}; ids must be distinct"
    seen[key] = line
    return None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON; a row holding one could not be stored in the ledger.
    raise ValueError(f"{name} is not valid JSON")


def _read_jsonl(path: Path, max_rows: int | None) -> tuple[list[tuple[int, Any]], list[RowProblem]]:
    rows: list[tuple[int, Any]] = []
    problems: list[RowProblem] = []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if max_rows is not None and len(rows) + len(problems) >= max_rows:
                break
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                problems.append(RowProblem(number, f"is not UTF-8 text ({exc.reason})"))
                continue
            if not text.strip():
                continue
            try:
                rows.append((number, json.loads(text, parse_constant=_reject_constant)))
            except json.JSONDecodeError as exc:
                problems.append(RowProblem(number, f"is not valid JSON: {exc.msg} (column {exc.colno})"))
            except ValueError as exc:
                problems.append(RowProblem(number, f"is not valid JSON: {exc}"))
    return rows, problems


def load_dataset(config: Any) -> list[dict[str, Any]]:
    """Rows of the run's data set, validated; raises `DatasetError` listing every bad row.

    `config` is a `RunConfig` (anything with `.data`, and `.run.seed` for builtin data).
    """
    data = config.data
    try:
        fields = template_fields(data.prompt_template)
    except ValueError as exc:
        raise DatasetError("data.prompt_template", [RowProblem(None, str(exc))]) from exc
    if data.builtin == "arith":
        from refill.data import arith

        source = f"builtin:{data.builtin}"
        size = data.builtin_size if data.max_rows is None else min(data.builtin_size, data.max_rows)
        numbered = list(enumerate(arith.generate(size, seed=config.run.seed), start=1))
        problems: list[RowProblem] = []
    elif data.train_path:
        source = str(data.train_path)
        path = Path(data.train_path)
        if not path.is_file():
            what = "is a directory, not a JSONL file" if path.is_dir() else "does not exist"
            if not path.is_absolute():
                what += f" (relative to the working directory {Path.cwd()})"
            raise DatasetError(source, [RowProblem(None, what)])
        numbered, problems = _read_jsonl(path, data.max_rows)
    else:
        raise DatasetError("data", [RowProblem(None, "set data.train_path or data.builtin")])

    rows: list[dict[str, Any]] = []
    seen_ids: dict[str, int] = {}
    # A duck-typed `data` of ledger code may predate the knob; lacking it means no id field.
    id_field = getattr(data, "prompt_id_field", None)
    for number, row in numbered:
        why = _check_row(row, data.prompt_key, data.prompt_template, fields)
        if why is None and id_field is not None:
            why = _check_id(row, id_field, number, seen_ids)
        if why is None:
            rows.append(row)
        else:
            problems.append(RowProblem(number, why))
    if problems:
        problems.sort(key=lambda p: p.line or 0)
        raise DatasetError(source, problems)
    if not rows:
        raise DatasetError(source, [RowProblem(None, "has no rows")])
    return rows


def data_source_fingerprint(rows: list[dict[str, Any]]) -> str:
    """sha256 (hex) of the rows in order; equal data sets give equal fingerprints on any machine."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()

