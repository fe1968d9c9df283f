"""The ports the test session's own servers take (tests/support/services.py)."""

from __future__ import annotations

import pytest

from tests.support import services


def test_xdist_workers_never_draw_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker names a port at import and may bind it minutes later (the fault suite's
    Redis): workers draw from disjoint sets, so none can take a port another named."""
    drawn: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        monkeypatch.setattr(services, "_handed_out", set())  # as a fresh worker process
        drawn[worker] = {services.free_port() for _ in range(40)}
        assert {port % 3 for port in drawn[worker]} == {int(worker[2:])}
        assert len(drawn[worker]) == 40  # never the same port twice in one process
    assert not (drawn["gw0"] & drawn["gw1"] or drawn["gw0"] & drawn["gw2"] or drawn["gw1"] & drawn["gw2"])
