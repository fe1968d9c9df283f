"""The ledger's and the broker's URLs: which ones are in effect, whether they are usable, and the
same URLs with their passwords hidden (for logs, the stored snapshot and the CLI)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refill.config.schema import RunConfig

DATABASE_URL_ENV = "REFILL_DATABASE_URL"
BROKER_URL_ENV = "REFILL_BROKER_URL"
EMBEDDED_BROKER_URL = "memory://"

# The password runs from the first ':' after the user to the '@' before the host, as in
# SQLAlchemy's grammar (so one holding '/' is hidden whole), and on across any further '@' of
# the authority: a password with an '@' that was not percent-encoded is hidden whole too.
# SQLAlchemy takes the text after its first '@' for the host, so hiding only that far showed
# the password's tail in every error that named the host. An '@' in the query is not crossed.
_URL_USERINFO = re.compile(
    r"(?P<head>[A-Za-z][\w+.\-]*://[^:/@\s;,]*:)(?P<secret>[^@\s;,]*(?:@[^@\s;,/?#]*(?=@))*)(?P<at>@)"
)
_URL_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:password|passwd|pass|sslpassword|secret|token|api_key)=)(?P<secret>[^&#\s]*)",
    re.IGNORECASE,
)
REDACTED = "***"


def redact_url(url: str | None) -> str | None:
    """`url` with any password replaced by `***` (SQLAlchemy, redis, amqp and kombu URL lists)."""
    if not url:
        return url

    def hide(match: re.Match[str]) -> str:
        if not match.group("secret"):
            return match.group(0)
        return match.group("head") + REDACTED + (match.groupdict().get("at") or "")

    return _URL_QUERY_SECRET.sub(hide, _URL_USERINFO.sub(hide, url))


def url_has_password(url: str | None) -> bool:
    return bool(url) and redact_url(url) != url


def resolved_urls(config: RunConfig, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(database URL, broker URL) in effect: environment, then config, then the embedded default.

    `postgresql://` and `postgres://` become `postgresql+psycopg://`: refill ships psycopg 3,
    while SQLAlchemy's bare scheme means psycopg2, and a URL copied from elsewhere should work.
    """
    env = os.environ if environ is None else environ
    db = env.get(DATABASE_URL_ENV) or config.infra.database_url
    broker = env.get(BROKER_URL_ENV) or config.infra.broker_url
    if not db:
        db = f"sqlite:///{config.run.output_dir}/refill.db"
    db = re.sub(r"^postgres(?:ql)?://", "postgresql+psycopg://", db)
    return db, broker or EMBEDDED_BROKER_URL


def is_embedded(config: RunConfig, environ: Mapping[str, str] | None = None) -> bool:
    """True when neither a database nor a broker URL is set: every role runs in one process."""
    env = os.environ if environ is None else environ
    return not (
        env.get(DATABASE_URL_ENV) or env.get(BROKER_URL_ENV)
        or config.infra.database_url or config.infra.broker_url
    )


_BROKER_SCHEMES = ("redis", "rediss", "memory", "amqp", "amqps", "pyamqp", "sentinel")


def unencoded_at_problem(url: str) -> str | None:
    """A URL whose user or password holds a raw '@': SQLAlchemy takes the text after its first
    '@' for the host, so the connection goes nowhere and its errors show the password's tail."""
    if url.split("?", 1)[0].count("@") > 1:
        return f"{redact_url(url)!r} has '@' in its user or password: write it as %40"
    return None


def database_url_problem(url: str) -> str | None:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    base = scheme.split("+", 1)[0]
    if base not in ("sqlite", "postgresql", "postgres"):
        return f"{redact_url(url)!r} is not a PostgreSQL or SQLite URL"
    if problem := unencoded_at_problem(url):
        return problem
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ArgumentError as exc:
        return f"{redact_url(url)!r} cannot be parsed: {redact_url(str(exc))}"
    return None


def broker_url_problem(url: str) -> str | None:
    for part in re.split(r"[;]", url):
        scheme = part.split("://", 1)[0] if "://" in part else ""
        if scheme not in _BROKER_SCHEMES:
            return f"{redact_url(url)!r} is not a broker URL refill supports ({', '.join(_BROKER_SCHEMES)})"
    return None

