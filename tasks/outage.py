"""Living through an outage of the ledger's database (a restart, a failover, a network cut).

The unit of work (`Ledger.transaction`) runs a transaction again after a dropped connection,
a few times within seconds: enough for a connection killed under it, not for a database that
is gone for a while. A fleet process must outlive such an outage without a restart and without
turning it into lost work: a generation worker that gave up on a lease handshake would drop
its message, a consumer would send its results round again, a controller would die. So the
fleet's processes wait for the database to come back (`PatientLedger`), and the controller
treats an unreachable ledger as it treats an unreachable broker: it says so and keeps ticking.

Nothing is judged on the outage itself: leases that ran out while nobody could renew them get
a whole lease after the database's return (refill.models.leases.expire_leases).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError

from refill.models.db import Ledger, is_retryable

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a fleet process waits for an unreachable ledger before a transaction fails after
#: all (its task then fails as it would have without waiting).
OUTAGE_PATIENCE_SECONDS = 600.0
#: Seconds between two tries while it is unreachable, and between two warnings about it.
RETRY_SECONDS = 0.5
WARN_EVERY_SECONDS = 10.0

#: SQLSTATEs that are retryable but say nothing about reachability: a conflict that persists
#: through the unit of work's retries is not an outage to wait out.
_CONFLICTS = {"40001", "40P01"}


def is_outage(error: BaseException) -> bool:
    """True when `error` says the database could not be reached or dropped the connection."""
    if not isinstance(error, (OperationalError, DBAPIError)) or not is_retryable(error):
        return False
    orig = getattr(error, "orig", None)
    if getattr(orig, "sqlstate", None) in _CONFLICTS:
        return False
    return "database is locked" not in str(orig or error).lower()


class PatientLedger(Ledger):
    """A fleet process's ledger: a transaction that fails because the database is unreachable
    is run again once it is back, for up to OUTAGE_PATIENCE_SECONDS."""

    patience_seconds = OUTAGE_PATIENCE_SECONDS
    #: Tries every half second at most, from the first failure: a lease is judged a whole lease
    #: after the database's return (refill.models.leases.expire_leases), so a worker must renew
    #: within less than that; the unit of work's own pauses grew to 4 s, and a worker asleep in
    #: one when the database came back lost its 3 s leases (the fault suite's PostgreSQL restart).
    max_retry_delay = RETRY_SECONDS / 2

    def transaction(self, fn: Callable[..., T], *, attempts: int = 8, what: str = "ledger write") -> T:
        down_since: float | None = None
        warned = 0.0
        while True:
            try:
                result = super().transaction(fn, attempts=attempts, what=what)
            except (OperationalError, DBAPIError) as error:
                now = time.monotonic()
                if down_since is None:
                    down_since = now
                if not is_outage(error) or now - down_since >= self.patience_seconds:
                    raise
                if now - warned >= WARN_EVERY_SECONDS:
                    warned = now
                    log.warning(
                        "%s: the ledger's database is unreachable (%s); waiting for it (%.0fs so far)",
                        what, type(getattr(error, "orig", error)).__name__, now - down_since,
                    )
                time.sleep(RETRY_SECONDS)
                continue
            if down_since is not None:
                log.warning("%s: the ledger's database is back after %.0fs", what, time.monotonic() - down_since)
            return result


class OutageClock:
    """The controller's view of the ledger's reachability: when it came back after an outage
    (this process's monotonic clock), and when to warn again while it is down."""

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.back_at: float | None = None
        self._warned = 0.0

    def down(self, error: BaseException, what: str) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
        if now - self._warned >= WARN_EVERY_SECONDS:
            self._warned = now
            log.warning(
                "%s: cannot reach the ledger's database (%s); waiting for it (%.0fs so far)",
                what, type(getattr(error, "orig", error)).__name__, now - self.down_since,
            )

    def up(self, what: str) -> None:
        if self.down_since is not None:
            now = time.monotonic()
            log.warning("%s: the ledger's database is back after %.0fs", what, now - self.down_since)
            self.down_since, self.back_at = None, now

    def reachable_for(self) -> float | None:
        """Seconds since the ledger came back after the last outage this process saw; None
        if it saw none."""
        return None if self.back_at is None else time.monotonic() - self.back_at
