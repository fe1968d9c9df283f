"""Reading a config: YAML (with duplicate keys reported), `${VAR}` expansion, validation
section by section, the cross-field checks; and rebuilding a run's stored snapshot.

`load_config(path)` returns a `RunConfig` or raises `ConfigError` whose `problems` list every
problem found (not only the first), each as `key.path: message. Fix: ...`. Validation runs in
three passes so that one mistake does not hide the others:
1. each section is validated on its own (types, ranges, unknown keys);
2. cross-field checks run over every section that passed 1 (the SPEC §5 setup errors);
3. run-time checks (`check_runtime=True`) import the reward function, read the data set and load
   the model's config; unit tests of pure validation switch them off to stay fast.

Values may use `${VAR}` / `${VAR:-default}` to read the environment (see `_expand_env`), so a
shipped template can name machine-specific paths without being edited.

`from_snapshot(run.config)` is how everything after setup reads a run's config: the snapshot
the ledger stored, validated by the schema, every knob it lacks at the schema's default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import ValidationError

from refill.config.checks import CHECKS, RUNTIME_CHECKS, can_run
from refill.config.errors import ConfigError, ConfigFileError, Problem
from refill.config.hints import describe, error_to_problem, unknown_key
from refill.config.schema import SECTIONS, RunConfig, join_path, model_at, resolve_sections
from refill.config.warnings import password_warnings

# ---------------------------------------------------------------------------------------------
# Reading YAML

_ENV_TOKEN = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_ENV_BODY = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?$", re.DOTALL)
_NULLS = {"null", "Null", "NULL", "~"}


def _expand_env(
    value: Any,
    path: str,
    environ: Mapping[str, str],
    problems: list[Problem],
    origins: dict[str, str] | None = None,
) -> Any:
    """Expand `${VAR}` and `${VAR:-default}` in string values (`$${` is a literal `${`).

    `:-` takes the default when the variable is unset or empty, as in the shell. A value that is
    exactly one `${...}` and expands to a number, boolean or null is read as that type, so
    `max_num_steps: ${STEPS:-20}` stays an integer.
    """
    if isinstance(value, dict):
        return {k: _expand_env(v, join_path(path, k), environ, problems, origins) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{path}[{i}]", environ, problems, origins) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    if origins is not None:
        origins[path] = value

    def replace(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "$${":
            return "${"
        if match.group(1) is None:
            problems.append(Problem(path, "has an unterminated '${'", "close it: ${NAME} or ${NAME:-default}"))
            return token
        body = _ENV_BODY.match(match.group(1))
        if body is None:
            problems.append(
                Problem(path, f"'{token}' is not a variable reference", "write ${NAME} or ${NAME:-default}")
            )
            return token
        name, default = body.group("name"), body.group("default")
        current = environ.get(name)
        if default is not None:
            return current if current else default
        if current is None:
            problems.append(
                Problem(path, f"environment variable {name} is not set",
                        f"export {name}=..., or give a default: ${{{name}:-value}}")
            )
            return token
        return current

    expanded = _ENV_TOKEN.sub(replace, value)
    if _ENV_TOKEN.fullmatch(value) and value != "$${" and not _takes_text(path):
        return _scalar(expanded)
    return expanded


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)", re.IGNORECASE)


def _scalar(text: str) -> Any:
    """`text` read as a YAML-ish scalar: null, boolean, integer or number, else the text itself."""
    stripped = text.strip()
    if stripped in _NULLS or stripped == "":
        return None
    if stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if _INT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    return text


def _takes_text(path: str) -> bool:
    """Whether the field at `path` holds a string, so an expanded value must stay text."""
    parts = [p for p in re.split(r"\.|\[\d+\]", path) if p]
    model = model_at(parts[:-1]) if parts else None
    if model is None or parts[-1] not in model.model_fields:
        return True  # unknown key: leave it as written; validation reports it
    return _accepts_str(model.model_fields[parts[-1]].annotation)


def _accepts_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    if get_origin(annotation) is Annotated:
        return _accepts_str(get_args(annotation)[0])
    return any(_accepts_str(a) for a in get_args(annotation) if get_origin(annotation) is not tuple)


def _duplicate_keys(node: yaml.Node, path: str = "") -> list[Problem]:
    """Keys given twice in one mapping: PyYAML keeps the last one silently, losing settings."""
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or key == "<<":
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(
                    Problem(join_path(path, key), f"is given twice (lines {seen[key]} and {line}); the "
                            "second would silently replace the first", "keep one of them")
                )
            else:
                seen[key] = line
            problems += _duplicate_keys(value_node, join_path(path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, f"{path}[{i}]")
    return problems


def read_yaml(path: str | os.PathLike[str]) -> tuple[Any, list[Problem]]:
    """The parsed YAML document and any duplicate-key problems; raises `ConfigFileError`."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"{source}: no such file", source) from None
    except IsADirectoryError:
        raise ConfigFileError(f"{source}: is a directory, not a YAML file", source) from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})", source) from None
    except OSError as exc:
        raise ConfigFileError(f"{source}: cannot be read ({exc.strerror})", source) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigFileError(f"{source}{where}: invalid YAML: {what}", source) from None
    return data, (_duplicate_keys(node) if node is not None else [])

# ---------------------------------------------------------------------------------------------
# Entry points


def config_from_dict(
    raw: Any,
    *,
    name: str | None = None,
    check_runtime: bool = False,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
    _problems: list[Problem] | None = None,
) -> RunConfig:
    """Validate a parsed config (`${VAR}` expanded, every check run); raises `ConfigError`.

    `name` is the default for `run.name`. Run-time checks are off by default here: this is the
    entry point for tests and for code that builds configs in memory.
    """
    env = os.environ if environ is None else environ
    problems: list[Problem] = list(_problems or [])
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            problems + [Problem("", f"the config must be a mapping of sections, got {describe(raw)}",
                                "start the file with sections such as `grpo:` and `data:`")],
            source,
        )
    load_warnings = password_warnings(raw)
    env_problems: list[Problem] = []
    origins: dict[str, str] = {}
    raw = _expand_env(raw, "", env, env_problems, origins)
    problems += env_problems
    # Keys whose value is unusable; checks that read them are skipped (see _can_run).
    failed: set[str] = {".".join(re.split(r"[.\[]", p.path)[:2]) for p in env_problems}

    sections: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in SECTIONS:
            problems.append(unknown_key([str(key)]))
            continue
        if value is None:
            value = {}  # an empty section (`grpo:` with nothing under it) means its defaults
        if key == "run" and name is not None and isinstance(value, dict) and value.get("name") is None:
            value = {**value, "name": name}
        section, section_problems, bad_keys = _validate_section(key, value)
        problems += section_problems
        failed |= {f"{key}.{k}" for k in bad_keys}
        if section is not None:
            sections[key] = section
        else:
            failed.add(key)
    for key, cls in SECTIONS.items():
        if key not in raw:
            sections[key] = cls(name=name) if key == "run" else cls()

    ns = SimpleNamespace(**sections, environ=env)
    resolve_sections(ns)
    checks = CHECKS + (RUNTIME_CHECKS if check_runtime else [])
    for reads, check in checks:
        if can_run(reads, sections, failed):
            problems.extend(check(ns))
    if problems:
        raise ConfigError(
            _dedupe([p if p in env_problems else _with_origin(p, origins) for p in problems]), source
        )
    cfg = RunConfig.model_validate(sections)
    cfg._load_warnings = load_warnings
    return cfg


def _with_origin(problem: Problem, origins: Mapping[str, str]) -> Problem:
    """Name the `${VAR}` a bad value came from, since the file alone does not show the value."""
    written = origins.get(problem.path)
    if written is None:
        return problem
    names = [m.group(1).split(":-", 1)[0] for m in _ENV_TOKEN.finditer(written) if m.group(1)]
    if not names:
        return problem
    return Problem(
        problem.path,
        f"{problem.message} (the file says {written})",
        f"{problem.fix}; or set {' / '.join(names)} in the environment",
    )


def _validate_section(key: str, value: Any) -> tuple[Any | None, list[Problem], set[str]]:
    """(section or None, problems, keys that failed).

    A section with bad keys is validated again without them, so that cross-field checks on its
    good keys still run; the bad keys are reported once, from the first pass.
    """
    cls = SECTIONS[key]
    try:
        return cls.model_validate(value), [], set()
    except ValidationError as exc:
        errors = exc.errors()
    problems = [error_to_problem(err, [key]) for err in errors]
    if not isinstance(value, dict) or any(not err["loc"] for err in errors):
        return None, problems, set()
    bad = {str(err["loc"][0]) for err in errors}
    try:
        return cls.model_validate({k: v for k, v in value.items() if str(k) not in bad}), problems, bad
    except ValidationError:
        # Only a validator that couples two keys could fail here; treat the section as unusable.
        return None, problems, bad


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    return [p for p in problems if not (p in seen or seen.add(p))]


def load_config(
    path: str | os.PathLike[str],
    *,
    check_runtime: bool = True,
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Read, expand and validate a YAML config; `run.name` defaults to the file's stem.

    Raises `ConfigFileError` (a `ConfigError`) when the file cannot be read or parsed, and
    `ConfigError` listing every problem otherwise.
    """
    raw, duplicates = read_yaml(path)
    return config_from_dict(
        raw,
        name=Path(path).stem,
        check_runtime=check_runtime,
        environ=environ,
        source=str(path),
        _problems=duplicates,
    )


def from_snapshot(snapshot: Mapping[str, Any], *, source: str = "the run's stored config") -> RunConfig:
    """A run's stored config snapshot (`RunConfig.snapshot()`, as the ledger keeps it) rebuilt
    through the schema.

    Every reader of a run's config after setup (the ledger's settings, the workers, the trainer)
    goes through here, so each knob is read with the schema's type and its one default: a
    snapshot written before a knob existed gets that knob's default. No cross-field or run-time
    check runs again: they ran when the run was set up. Raises `ConfigError` naming each value
    the schema does not accept.
    """
    if not isinstance(snapshot, Mapping):
        raise ConfigError(
            [Problem("", f"must be a mapping of sections, got {describe(snapshot)}",
                     "store RunConfig.snapshot() as the run's config")],
            source,
        )
    try:
        return RunConfig.model_validate(dict(snapshot))
    except ValidationError as exc:
        problems = [error_to_problem(err, []) for err in exc.errors()]
    raise ConfigError(_dedupe(problems), source)
