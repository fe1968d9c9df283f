"""Files shipped inside the package: the tiny demo model's config and tokenizer."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent

#: `model.name_or_path` value that selects the shipped tiny model.
TINY_ARITH = "builtin:tiny-arith"


def tiny_arith_path() -> Path:
    """Directory with the tiny model's `config.json` and tokenizer files."""
    return ASSETS / "tiny-arith"


def resolve_model_path(name_or_path: str) -> str:
    """Map `builtin:NAME` to the shipped directory; anything else is returned unchanged."""
    if name_or_path.startswith("builtin:"):
        name = name_or_path.split(":", 1)[1]
        path = ASSETS / name
        if not path.is_dir():
            known = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and not p.name.startswith("_"))
            raise FileNotFoundError(
                f"there is no builtin model {name!r}; the shipped ones are: {', '.join(known)}"
            )
        return str(path)
    return name_or_path
