"""kombu's Redis transport, with one guard that lets a worker live through a Redis restart.

When Redis goes away, Celery's consumer closes the broken connection before it reconnects.
kombu (5.x, up to at least 5.7) closes the channel twice on that path: the first close fails
inside its pending BRPOP read (the server is gone) after the transport was already detached
from its connection, and the second one tries to hand the worker's unacknowledged messages
back to Redis through that detached transport, which raises
`AttributeError: 'NoneType' object has no attribute 'hostname'`. Celery treats that as an
unrecoverable error and the worker process exits: a Redis restart would take down every
worker that was in the middle of a task (the fault suite's scenario 3 found it).

The same happens when a task that was running during the outage finishes after the worker
reconnected: its message is acknowledged through the old, detached channel, and the
`AttributeError` again stops the worker.

Here the QoS skips the hand-back and the acknowledgement when its channel has no connection
any more. Nothing is lost by skipping them: the messages stay in Redis's unacked set and come
back after the visibility timeout (a repeat that every refill receiver ignores), or, if Redis
lost them, the ledger's reaper re-dispatches their attempts. The worker reconnects and goes on.

Used for `redis://` broker URLs (refill.tasks.app); `rediss://` and `sentinel://` keep kombu's
own transport, whose URL handling (TLS defaults, sentinels) a class cannot take over.
"""

from __future__ import annotations

import logging

from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)


class QoS(kombu_redis.QoS):
    def _detached(self) -> bool:
        """True once the channel's connection was closed after the broker went away."""
        transport = self.channel.connection
        return transport is None or transport.client is None

    def restore_unacked(self, client=None):  # type: ignore[no-untyped-def]
        if client is None and self._detached():
            log.warning(
                "broker connection lost: %d unacknowledged message(s) stay in Redis and come "
                "back after the visibility timeout",
                len(self._delivered),
            )
            self._delivered.clear()
            return None
        return super().restore_unacked(client)

    def ack(self, delivery_tag):  # type: ignore[no-untyped-def]
        # A task that was running while the connection was lost finishes on the new one; its
        # message belongs to the old channel. It stays in Redis's unacked set and is delivered
        # again after the visibility timeout (a repeat every refill receiver ignores).
        if self._detached():
            log.info("message %s was delivered on a lost connection; not acknowledged", delivery_tag)
            self._delivered.pop(delivery_tag, None)
            return None
        return super().ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False):  # type: ignore[no-untyped-def]
        if self._detached():
            log.info("message %s was delivered on a lost connection; not rejected", delivery_tag)
            self._delivered.pop(delivery_tag, None)
            return None
        return super().reject(delivery_tag, requeue=requeue)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"
