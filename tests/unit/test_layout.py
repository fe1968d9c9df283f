"""The house rules of the design card's layout, checked on the source tree: no import circles
(imports inside functions included: a lazy import that dodges a circle is still one; imports
for type checking only are not imports), no product
module over 600 lines, no bare import of a folder that installs as refill.<name>, and no
`datetime.now` outside refill.models.clock (ruff's banned APIs, pyproject.toml)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Must agree with [tool.setuptools] package-dir in pyproject.toml.
PACKAGE_DIRS = {
    "refill": "refill",
    "refill.tasks": "tasks",
    "refill.trainer": "trainer",
    "refill.models": "models",
    "refill.admin": "admin",
    "refill.migrations": "migrations",
}
MAX_LINES = 600


def product_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The product module an imported dotted name lives in (a name imported from a module
    counts as an import of that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _runtime_nodes(tree: ast.AST):  # type: ignore[no-untyped-def]
    """Every node except those under `if TYPE_CHECKING:`, which never run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for other in node.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        if name.startswith("refill.migrations.versions."):
            continue  # loaded by Alembic by path, never imported by the product
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [_target(alias.name, modules) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [_target(f"{node.module}.{alias.name}", modules) for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_code_folder_is_a_package_of_refill() -> None:
    modules = product_modules()
    for package in PACKAGE_DIRS:
        assert package in modules, f"{PACKAGE_DIRS[package]}/__init__.py is missing"
    assert "refill.tasks.app" in modules and "refill.models.tables" in modules


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles (imports inside functions included): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_no_product_module_over_600_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in product_modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job (over {MAX_LINES} lines): {long}"


def test_no_bare_imports_of_the_code_folders() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in the dev extra: pip install -e '.[dev]'"
    done = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "TID251", "--output-format", "concise", "."],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
