"""How a CLI command finds the ledger: `--database-url`, else REFILL_DATABASE_URL, else the
embedded default (`sqlite:///runs/refill.db`, where `refill demo` and embedded runs write).

Whatever is wrong with the URL or the server ends the command with one line naming it (exit 2),
never a traceback: `ledger_at` for the URL itself, `schema_revision` for reaching the server."""

from __future__ import annotations

import os
from typing import NoReturn

from refill.admin.console import EXIT_BAD_INPUT, fail, redact_url
from refill.models.db import Ledger

DEFAULT_LEDGER = "sqlite:///runs/refill.db"

#: What a ledger URL looks like, for the errors.
URL_FORMS = "postgresql+psycopg://USER@HOST:PORT/DATABASE or sqlite:///PATH"


def ledger_url(option: str | None) -> str:
    url = option or os.environ.get("REFILL_DATABASE_URL") or DEFAULT_LEDGER
    if url.startswith(("postgres://", "postgresql://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def ledger_at(url: str) -> Ledger:
    """A Ledger for `url` (nothing connects yet), or a one-line error saying what is wrong
    with the URL: not one, a scheme SQLAlchemy has no dialect for, a driver not installed."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    # Without a scheme the password cannot be told from the rest: such a string is not shown.
    from refill.config.urls import unencoded_at_problem

    shown = redact_url(url) if "://" in url else "the URL given (not shown: it has no scheme://)"
    if problem := unencoded_at_problem(url):
        _bad_url(problem)
    try:
        parsed = make_url(url)
        parsed.get_dialect()
        return Ledger(url)
    except NoSuchModuleError:
        _bad_url(f"{shown}: no database of scheme {url.split('://', 1)[0]!r}")
    except ArgumentError:
        # Its message quotes the whole string, a password with it.
        _bad_url(f"{shown} is not a database URL")
    except ModuleNotFoundError as error:
        _bad_url(f"{shown}: its driver {error.name!r} is not installed (refill talks to PostgreSQL through psycopg)")
    except ValueError as error:  # a port that is not a number
        _bad_url(f"{shown}: {error}")


def _bad_url(what: str) -> NoReturn:
    fail(f"{what}; a ledger URL is {URL_FORMS} (--database-url or REFILL_DATABASE_URL)", EXIT_BAD_INPUT)


def schema_revision(ledger: Ledger) -> str | None:
    """The ledger's schema revision (None: no schema), or a one-line error saying why the
    ledger cannot be read: the server refused or did not answer, a bad option in the URL, a
    file that is not a database."""
    from sqlalchemy.exc import DBAPIError

    from refill.models.migrate import current_revision

    try:
        return current_revision(ledger.engine)
    except DBAPIError as error:
        cannot_reach(ledger.url, error)


def cannot_reach(url: str, error: Exception) -> NoReturn:
    """The one-line error for a ledger that failed under a command (`DBAPIError`)."""
    cause = getattr(error, "orig", None) or error
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    fail(f"cannot reach the ledger at {redact_url(url)}: {first}", EXIT_BAD_INPUT)


def open_ledger(option: str | None, *, must_exist: bool = True) -> Ledger:
    """A ledger whose schema is current, or a one-line error saying what to do."""
    from refill.models.migrate import head_revision

    url = ledger_url(option)
    if url.startswith("sqlite:///") and must_exist:
        path = url[len("sqlite:///") :]
        if path and not os.path.exists(path):
            fail(
                f"no ledger at {redact_url(url)}; pass --database-url or set REFILL_DATABASE_URL "
                "(an embedded run writes runs/refill.db under its output_dir)",
                EXIT_BAD_INPUT,
            )
    ledger = ledger_at(url)
    revision = schema_revision(ledger)
    if must_exist and revision != head_revision():
        fail(
            f"the ledger at {redact_url(url)} is at schema revision {revision or 'none'}, not "
            f"{head_revision()}: run `refill db upgrade`",
            EXIT_BAD_INPUT,
        )
    return ledger
