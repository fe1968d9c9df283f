"""What an invariant check of `refill.admin.invariants` is made of: the `Context` it reads (one
session, the run, its settings), the `Violation`s it returns, and the `Report` of a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from refill.models.settings import LedgerSettings
from refill.models.tables import AttemptState, Run

LIVE = tuple(s.value for s in AttemptState.live())


@dataclass(frozen=True)
class Violation:
    """One broken invariant, located as precisely as the ledger allows."""

    check: str
    message: str
    run_id: int
    step: int | None = None
    slot: int | None = None
    attempt: int | None = None

    @property
    def where(self) -> str:
        parts = [f"run {self.run_id}"]
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.slot is not None:
            parts.append(f"slot {self.slot}")
        if self.attempt is not None:
            parts.append(f"attempt {self.attempt}")
        return ", ".join(parts)

    def __str__(self) -> str:
        return f"{self.check}: {self.where}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    session: Session
    run: Run
    settings: LedgerSettings

    def violation(self, check: str, message: str, **where: int | None) -> Violation:
        return Violation(check, message, self.run.id, **where)


CheckFn = Callable[[Context], list[Violation]]


@dataclass(frozen=True)
class Check:
    name: str
    description: str
    fn: CheckFn


@dataclass
class CheckResult:
    name: str
    description: str
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class Report:
    run_id: int
    results: list[CheckResult]

    @property
    def violations(self) -> list[Violation]:
        return [v for r in self.results for v in r.violations]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "ok": self.ok,
            "violations": len(self.violations),
            "checks": [
                {
                    "name": r.name,
                    "description": r.description,
                    "ok": r.ok,
                    "violations": [v.as_dict() for v in r.violations],
                }
                for r in self.results
            ],
        }
