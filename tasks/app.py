"""The Celery app: queues, routing and the settings that make the fleet safe to crash.

- JSON only, on the wire and in what a worker will accept: a pickle message is refused
  before any code of ours sees it.
- `task_acks_late` + `task_reject_on_worker_lost`: a message is acknowledged after its task
  returned, so a worker that dies mid-task leaves it to be delivered again. Receivers are
  idempotent (the ledger keys every effect by attempt id or step), so a repeat is harmless.
- Prefetch 1: a generation worker never hoards groups another worker could be running.
- The Redis visibility timeout is far above any lease: an unacknowledged message comes back
  only after its work is certainly abandoned, and the ledger's reaper has usually
  re-dispatched it long before (the repeat is then refused by the lease handshake).
- No result backend, no chords or groups: nothing depends on Celery results (SPEC §2).
- Task events are off unless asked for (`refill worker ROLE --events`, or REFILL_WORKER_EVENTS=1
  in the environment, as docker/compose.yaml passes it): Flower shows tasks only with them, and
  they cost a broker publish per task state change (README, "Watching a run").
- A worker lives through a Redis restart: it reconnects (kombu's Redis transport, with the
  guard in refill.tasks.redis_transport), and what the lost connection held comes back by the
  visibility timeout or the ledger's reaper.

`celery -A refill.tasks.app worker ...` finds `app` here (built from REFILL_BROKER_URL); the
embedded runner and tests build their own with `make_app`. `refill worker ROLE` builds the
right command line for each role (refill.tasks.workers).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from refill.config.environment import positive_int
from refill.tasks.queues import CONTROL, QUEUES, ROUTES

EMBEDDED_BROKER = "memory://"
#: Seconds an unacknowledged message stays invisible on Redis before it is delivered again.
DEFAULT_VISIBILITY_TIMEOUT = 6 * 3600
#: Set to 1 to send Celery task events (what Flower shows); `refill worker --events` sets it.
EVENTS_ENV = "REFILL_WORKER_EVENTS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def broker_url_from_env() -> str:
    return os.environ.get("REFILL_BROKER_URL") or EMBEDDED_BROKER


def events_from_env() -> bool:
    value = os.environ.get(EVENTS_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{EVENTS_ENV}={os.environ[EVENTS_ENV]!r}: set it to 1 (task events on) or 0 (off)")
    return value in _TRUE


def event_settings(enabled: bool) -> dict[str, bool]:
    """Task events from workers (received, started, succeeded...) and from whatever sends tasks
    (sent): what Flower and `celery events` show."""
    return {"worker_send_task_events": enabled, "task_send_sent_event": enabled}


def visibility_timeout_seconds() -> int:
    """REFILL_VISIBILITY_TIMEOUT (seconds), or its default; a value that is not a positive
    integer is refused, naming it."""
    return positive_int(
        "REFILL_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT, "seconds a message taken by a worker that died stays invisible"
    )


def celery_settings(broker_url: str, key_prefix: str | None = None) -> dict[str, Any]:
    visibility_timeout = visibility_timeout_seconds()
    # kombu looks for messages whose visibility timeout passed only every interval * throttle
    # seconds (10 * 10 by default), so a lowered timeout would take up to 100 s more to act;
    # sweep at least four times per timeout (at most every 10 s).
    sweep_seconds = max(1, min(10, visibility_timeout // 4))
    transport_options: dict[str, Any] = {
        "visibility_timeout": visibility_timeout,
        "unacked_restore_interval": sweep_seconds,
        "unacked_restore_throttle": 1,
        # Each sweep holds a lock in Redis for its milliseconds, and a consumer killed inside
        # one leaves the lock until it expires: every other consumer skips its sweeps until
        # then (kombu's 5 minutes held the fault suite's redelivered results past their
        # leases). Sweeps that meet are safe: kombu moves each message back in a transaction
        # that watches the unacknowledged set, and a repeat is one every receiver ignores.
        "unacked_mutex_expire": sweep_seconds,
    }
    prefix = key_prefix or os.environ.get("REFILL_BROKER_PREFIX")
    if prefix:
        # Several fleets (or test sessions) can share one Redis without seeing each other.
        transport_options["global_keyprefix"] = prefix
    if broker_url.startswith("memory://"):
        # kombu's in-memory transport polls; its default of 1 s would make every hop slow.
        transport_options = {"polling_interval": 0.005}
    exchange = Exchange("refill", type="direct")
    settings: dict[str, Any] = {}
    if broker_url.startswith("redis://"):
        # kombu's transport with a guard that keeps a worker alive through a Redis restart.
        from refill.tasks.redis_transport import TRANSPORT

        settings["broker_transport"] = TRANSPORT
    return settings | {
        "broker_url": broker_url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        # Every role runs a threads pool, which cannot cancel a running task: asking it to on a
        # connection loss only logs a traceback per task in flight. Such a task finishes; its
        # message comes back after the visibility timeout (a repeat the receivers ignore) or,
        # if Redis lost it, the ledger re-dispatches its attempt.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_default_queue": CONTROL,
        "task_default_exchange": "refill",
        "task_queues": [Queue(name, exchange, routing_key=name) for name in QUEUES],
        "task_routes": {name: {"queue": queue, "routing_key": queue} for name, queue in ROUTES.items()},
        "task_create_missing_queues": False,
        **event_settings(events_from_env()),
    }


def make_app(broker_url: str | None = None, name: str = "refill", key_prefix: str | None = None) -> Celery:
    """A configured app with every refill task registered."""
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_settings(broker_url or broker_url_from_env(), key_prefix))
    from refill.tasks import definitions

    definitions.register(app)
    return app


app = make_app()
