"""URL redaction and the URLs in effect (environment over file over embedded default)."""

from __future__ import annotations

import pytest

from refill.config import is_embedded, redact_url, resolved_urls

from .helpers import build


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://refill:hunter2@db:5432/refill", "postgresql+psycopg://refill:***@db:5432/refill"),
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://user:s3cret@redis:6380/1", "rediss://user:***@redis:6380/1"),
        ("amqp://guest:guest@rabbit:5672//", "amqp://guest:***@rabbit:5672//"),
        ("postgresql://u:pa/ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:s3c@ret@h/db", "postgresql://u:***@h/db"),  # an '@' not written %40
        ("postgresql://u:pw@h/db?application_name=a@b", "postgresql://u:***@h/db?application_name=a@b"),
        ("postgresql://h/db?user=u&password=pw&sslmode=require", "postgresql://h/db?user=u&password=***&sslmode=require"),
        ("redis://:a@h1:6379/0;redis://:b@h2:6379/0", "redis://:***@h1:6379/0;redis://:***@h2:6379/0"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/refill", "postgresql+psycopg://postgres@127.0.0.1:5432/refill"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("sqlite:///runs/refill.db", "sqlite:///runs/refill.db"),
        ("memory://", "memory://"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_redact_none_and_empty() -> None:
    assert redact_url(None) is None
    assert redact_url("") == ""


def test_embedded_defaults() -> None:
    cfg = build({"run": {"output_dir": "/srv/runs"}})
    assert resolved_urls(cfg, {}) == ("sqlite:////srv/runs/refill.db", "memory://")
    assert is_embedded(cfg, {})


def test_file_urls_are_used() -> None:
    cfg = build({"infra": {"database_url": "postgresql+psycopg://p@h/db", "broker_url": "redis://h:6379/0"}})
    assert resolved_urls(cfg, {}) == ("postgresql+psycopg://p@h/db", "redis://h:6379/0")
    assert not is_embedded(cfg, {})


def test_environment_overrides_the_file() -> None:
    cfg = build({"infra": {"database_url": "postgresql+psycopg://p@h/db", "broker_url": "redis://h:6379/0"}})
    env = {"REFILL_DATABASE_URL": "postgresql+psycopg://q:pw@other/db", "REFILL_BROKER_URL": "redis://other:6379/2"}
    assert resolved_urls(cfg, env) == ("postgresql+psycopg://q:pw@other/db", "redis://other:6379/2")


def test_empty_environment_value_does_not_override() -> None:
    cfg = build({"infra": {"broker_url": "redis://h:6379/0"}})
    assert resolved_urls(cfg, {"REFILL_BROKER_URL": ""})[1] == "redis://h:6379/0"


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_bare_postgres_scheme_uses_psycopg3(scheme: str) -> None:
    cfg = build()
    db, _ = resolved_urls(cfg, {"REFILL_DATABASE_URL": f"{scheme}://u@h:5432/db"})
    assert db == "postgresql+psycopg://u@h:5432/db"
