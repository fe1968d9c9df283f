"""Redelivery of a message a consumer took and never acknowledged, with the broker options
refill's workers run with (`tasks/app.py`), against a real Redis."""

from __future__ import annotations

import os
import time
import uuid

from kombu import Connection, Consumer, Exchange, Producer, Queue

from refill.tasks.app import celery_settings
from tests.support.fleet import purge_prefix
from tests.support.services import REDIS_ENV


def test_a_held_message_comes_back_though_its_consumer_died_holding_the_sweep_lock(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """kombu finds the messages whose visibility timeout passed in sweeps that each take a lock
    in Redis. A consumer killed inside a sweep leaves that lock behind, and every other
    consumer skips its sweeps until the lock expires: after kombu's 5 minutes a message the
    dead consumer held would come back 5 minutes late. refill's lock lasts one sweep interval."""
    monkeypatch.setenv("REFILL_VISIBILITY_TIMEOUT", "2")
    url = os.environ[REDIS_ENV]
    prefix = f"redelivery-{uuid.uuid4().hex}:"
    try:
        _held_message_comes_back(url, celery_settings(url, key_prefix=prefix))
    finally:
        purge_prefix(prefix, url)


def _held_message_comes_back(url: str, settings: dict) -> None:  # type: ignore[type-arg]
    options = settings["broker_transport_options"]
    exchange = Exchange("redelivery", type="direct")
    queue = Queue("redelivery", exchange, routing_key="redelivery")
    got: list[dict] = []  # type: ignore[type-arg]

    def take(body: dict, message) -> None:  # type: ignore[no-untyped-def, type-arg]
        got.append(body)  # and never acknowledged

    with Connection(url, transport=settings["broker_transport"], transport_options=options) as dead:
        channel = dead.default_channel
        Producer(channel).publish({"n": 1}, exchange=exchange, routing_key="redelivery", declare=[queue], serializer="json")
        with Consumer(channel, [queue], callbacks=[take], accept=["json"]):
            dead.drain_events(timeout=5)
        assert got == [{"n": 1}]
        # Killed inside a sweep: the sweep's lock stays, and nothing hands the message back.
        expire = channel.unacked_mutex_expire
        lock = channel.client.lock(channel.unacked_mutex_key, timeout=expire)
        assert lock.acquire(blocking=False)
        channel.qos.restore_at_shutdown = False

    with Connection(url, transport=settings["broker_transport"], transport_options=options) as after:
        with Consumer(after.default_channel, [queue], callbacks=[take], accept=["json"]):
            deadline = time.monotonic() + 20
            while len(got) < 2 and time.monotonic() < deadline:
                try:
                    after.drain_events(timeout=0.2)
                except TimeoutError:
                    continue  # each empty poll is a sweep
    assert len(got) == 2, f"the held message did not come back within 20 s (the sweep lock lasts {expire} s)"
    # Its visibility timeout (2 s), then a sweep once the dead consumer's lock expired (1 s):
    # about 3 s after it was held, where kombu's own lock would have held it back 5 minutes.
    assert got[1] == {"n": 1}
