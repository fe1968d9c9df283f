"""The design card's folders (tasks/, trainer/, models/, migrations/, admin/) install as refill.*,
from the editable install and from a plain wheel, and never as top-level packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("tasks", "trainer", "models", "migrations", "admin")

# Run in a fresh interpreter whose working directory is outside the repository, so the
# repository root is not on sys.path the way pytest's rootdir is.
PROBE = """
import importlib.util, sys
import refill.tasks.app, refill.models.tables, refill.trainer.loss, refill.admin.cli
import refill.migrations
from refill.models.migrate import MIGRATIONS
assert (MIGRATIONS / "alembic.ini").is_file(), MIGRATIONS
assert (MIGRATIONS / "versions" / "0006_packed_rollouts.py").is_file(), MIGRATIONS
for name in {folders!r}:
    assert importlib.util.find_spec(name) is None, f"a top-level {{name}} is importable"
print(refill.tasks.app.__file__)
"""


def _probe(cwd: Path, prelude: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-c", prelude + PROBE.format(folders=FOLDERS)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_installed_refill_imports_from_anywhere(tmp_path: Path) -> None:
    assert Path(_probe(tmp_path)) == REPO / "tasks" / "app.py"


@pytest.mark.slow
def test_a_wheel_maps_the_folders_under_refill(tmp_path: Path) -> None:
    # setuptools leaves build/ beside pyproject.toml: build from a copy, not the checkout.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("refill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.startswith("refill-")}
    assert tops == {"refill"}, tops
    for name in ("refill/tasks/app.py", "refill/migrations/alembic.ini",
                 "refill/migrations/script.py.mako", "refill/migrations/versions/0001_ledger.py",
                 "refill/assets/tiny-arith/tokenizer.json"):
        assert name in names, name
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Import refill from the unpacked wheel instead of the editable install of this checkout.
    prelude = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "sys.path_hooks[:] = [h for h in sys.path_hooks if 'editable' not in repr(h).lower()]\n"
        "sys.path_importer_cache.clear()\n"
        f"sys.path.insert(0, {str(site)!r})\n"
    )
    assert Path(_probe(tmp_path, prelude)) == site / "refill" / "tasks" / "app.py"
