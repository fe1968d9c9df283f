from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_refill_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's shell may export these; config checks and warnings read them.
    monkeypatch.delenv("REFILL_DATABASE_URL", raising=False)
    monkeypatch.delenv("REFILL_BROKER_URL", raising=False)
