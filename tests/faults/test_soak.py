"""The chaos soak of issue 20, two minutes of it: runs back to back on a fleet of several
worker processes per role while a random fault (every kind of this suite's scenarios and of
issue 20's) is injected every few seconds, overlapping the ones still in progress
(bench/soak.py; `python -m bench soak --minutes M` runs a longer one on servers of its own).

Every run completes, `refill check` passes on each, no committed group is lost and none is
trained twice."""

from __future__ import annotations

import pytest

from bench.soak import KINDS, soak_on
from tests.support.chaos_fleet import ChaosFleet

pytestmark = pytest.mark.faults


def test_two_minute_chaos_soak(chaos_fleet: ChaosFleet, faults_db: str) -> None:
    report = soak_on(chaos_fleet, faults_db, minutes=2, seed=20)
    lines = "\n".join(record.line() for record in report.runs)
    assert report.runs and all(record.clean for record in report.runs), lines
    assert {kind for _, kind, _ in report.faults} == set(KINDS), report.faults
