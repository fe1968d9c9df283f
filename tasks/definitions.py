"""The Celery tasks. Each one decodes its message, calls a plain function, and returns.

The decisions live in the ledger (refill.models), the work in the services
(refill.tasks.generation, refill.tasks.consumer, refill.trainer.service,
refill.tasks.controller); nothing here depends on a task's result.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject

from refill.models.payload import GenerateMessage, PayloadError
from refill.tasks.queues import TASK_DRIVE_RUN, TASK_GENERATE, TASK_RECORD_RESULT, TASK_TRAIN_STEP

log = logging.getLogger(__name__)


def register(app: Celery) -> None:
    from refill.tasks.runtime import runtime_for

    @app.task(name=TASK_GENERATE, bind=True, shared=False)
    def generate(self: Task, body: dict[str, Any]) -> str:
        # One attempt, or a bundle of a run's attempts the relay sent together.
        bundle = body.get("bundle") if isinstance(body, dict) else None
        items = bundle if isinstance(bundle, list) else [body]
        messages = []
        for item in items:
            try:
                messages.append(GenerateMessage.from_json(item))
            except PayloadError as error:
                # A malformed message can never succeed; acknowledge it and say why. Its
                # attempt (if any) is re-dispatched by the reaper when its lease runs out.
                log.error("refused generate message: %s", error)
                if len(items) == 1:
                    raise Reject(str(error), requeue=False) from error
        if not messages:
            raise Reject("a generate bundle with no valid attempt", requeue=False)
        return runtime_for(self.app).generation().run_all(messages)

    @app.task(name=TASK_RECORD_RESULT, bind=True, shared=False, max_retries=None)
    def record_result(self: Task, body: dict[str, Any]) -> str:
        try:
            return runtime_for(self.app).consumer().submit(body)
        except Exception as error:
            # The ledger could not be reached even after the unit of work's own retries: send
            # the result round again rather than acknowledge a result that was never recorded.
            delay = min(60, 2 ** min(self.request.retries, 6))
            log.warning("could not record result (%s); retrying in %ss", error, delay)
            raise self.retry(exc=error, countdown=delay) from error

    @app.task(name=TASK_TRAIN_STEP, bind=True, shared=False, max_retries=None)
    def train_step(self: Task, body: dict[str, Any]) -> str:
        run_id, step = int(body["run_id"]), int(body["step"])
        return runtime_for(self.app).trainer().train(run_id, step)

    @app.task(name=TASK_DRIVE_RUN, bind=True, shared=False)
    def drive_run(self: Task, body: dict[str, Any]) -> str:
        from refill.tasks.controller import drive_slice

        return drive_slice(runtime_for(self.app), body)
