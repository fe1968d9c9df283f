"""The invariant of the claim check: every group that may still be trained has its payload.

A group committed as a claim check (`groups.payload_ref`) is trained from the file its worker
stored under the run's directory (`refill.models.payload_store`). `refill check` proves each
committed, untrained group's file is there at the size its worker wrote (it stats the files;
the checksum is the trainer's claim's to verify, reading every byte). A completed or failed run
whose payload store is gone (its retention, `refill gc`) is not checked: it trains no more.
"""

from __future__ import annotations

from refill.admin.invariant_types import Context, Violation
from refill.models.payload_store import FileStore, missing_payloads
from refill.models.tables import RunStatus


def check_payloads(ctx: Context) -> list[Violation]:
    run = ctx.run
    finished = run.status in (RunStatus.COMPLETED.value, RunStatus.FAILED.value)
    if finished and not FileStore.of_run(run.run_dir).root.exists():
        return []
    return [
        ctx.violation("payloads", f"the payload of committed group {attempt_id}, {path}, {problem}", attempt=attempt_id)
        for attempt_id, path, problem in missing_payloads(ctx.session, run)
    ]
