#!/usr/bin/env python3
"""Container health check for `refill worker ROLE`: the worker answers a Celery ping.

The image's HEALTHCHECK runs this inside the container, with the container's environment, so it
reaches the same broker (REFILL_BROKER_URL, REFILL_BROKER_PREFIX) as the worker. A worker started
with the default node name is `ROLE@<container hostname>`, so the candidates are one per role and
the ping is sent to those nodes only, never broadcast to the fleet. A worker started with
`--hostname NAME` sets REFILL_HEALTHCHECK_NODE=NAME (`%h` is expanded as Celery does).

Healthy means: connected to the broker and consuming its control messages. It does not say that
an engine has loaded a model (that happens per run, on the first task). One-shot containers
(`refill db upgrade`, `refill run start`) run no worker: compose disables the check there.

Exit 0 healthy, 1 unhealthy (Docker's convention).
"""

from __future__ import annotations

import os
import socket
import sys


def candidate_nodes(environ: dict[str, str] | None = None, host: str | None = None) -> list[str]:
    """The Celery node names a worker in this container may have."""
    from celery.utils.nodenames import default_nodename, host_format

    env = os.environ if environ is None else environ
    host = host or socket.gethostname()
    explicit = env.get("REFILL_HEALTHCHECK_NODE")
    if explicit:
        return [host_format(default_nodename(explicit), host=host)]
    from refill.tasks.workers import ROLES

    # The same expansion `celery worker --hostname ROLE@%h` applies (celery.bin.worker.Hostname).
    return [host_format(default_nodename(f"{role}@%h"), host=host) for role in ROLES]


def main() -> int:
    nodes = candidate_nodes()
    if not os.environ.get("REFILL_BROKER_URL"):
        print("REFILL_BROKER_URL is not set: no worker here can be reached", file=sys.stderr)
        return 1
    from refill.tasks.app import app

    timeout = float(os.environ.get("REFILL_HEALTHCHECK_TIMEOUT", "5"))
    try:
        # limit=1: at most one of the candidates is this container's worker; stop at its reply.
        replies = app.control.ping(destination=nodes, timeout=timeout, limit=1)
    except Exception as error:  # noqa: BLE001 - any failure to ask is "unhealthy"
        print(f"ping failed: {error.__class__.__name__}: {error}", file=sys.stderr)
        return 1
    answered = sorted(name for reply in replies for name in reply)
    if not answered:
        print(f"no reply within {timeout:g}s from {', '.join(nodes)}", file=sys.stderr)
        return 1
    print(f"ok: {', '.join(answered)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
