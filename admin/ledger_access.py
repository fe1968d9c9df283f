"""How a CLI command finds the ledger: `--database-url`, else REFILL_DATABASE_URL, else the
embedded default (`sqlite:///runs/refill.db`, where `refill demo` and embedded runs write)."""

from __future__ import annotations

import os

from refill.admin.console import EXIT_BAD_INPUT, fail, redact_url
from refill.models.db import Ledger

DEFAULT_LEDGER = "sqlite:///runs/refill.db"


def ledger_url(option: str | None) -> str:
    url = option or os.environ.get("REFILL_DATABASE_URL") or DEFAULT_LEDGER
    if url.startswith(("postgres://", "postgresql://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def open_ledger(option: str | None, *, must_exist: bool = True) -> Ledger:
    """A ledger whose schema is current, or a one-line error saying what to do."""
    from sqlalchemy.exc import OperationalError

    from refill.models.migrate import current_revision, head_revision

    url = ledger_url(option)
    if url.startswith("sqlite:///") and must_exist:
        path = url[len("sqlite:///") :]
        if path and not os.path.exists(path):
            fail(
                f"no ledger at {redact_url(url)}; pass --database-url or set REFILL_DATABASE_URL "
                "(an embedded run writes runs/refill.db under its output_dir)",
                EXIT_BAD_INPUT,
            )
    ledger = Ledger(url)
    try:
        revision = current_revision(ledger.engine)
    except OperationalError as error:
        fail(f"cannot reach the ledger at {redact_url(url)}: {str(error.orig).splitlines()[0]}", EXIT_BAD_INPUT)
    if must_exist and revision != head_revision():
        fail(
            f"the ledger at {redact_url(url)} is at schema revision {revision or 'none'}, not "
            f"{head_revision()}: run `refill db upgrade`",
            EXIT_BAD_INPUT,
        )
    return ledger
