"""`refill worker train --nproc N`: N processes, the ranks of one trainer, on this machine.

Each rank is the same `refill worker train` command line with the environment torchrun gives
its workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a
trainer across machines is the same command under torchrun instead:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m refill.admin.cli worker train

Rank 0 is the Celery worker (it claims steps, heartbeats the lease, records the result); the
other ranks take their orders from it (`refill.trainer.ranks`).

The ranks live and die together, as torchrun's do: when one exits, for any reason, the
launcher kills the others and exits with the first one's status. A trainer short of a rank
can only hang in its next collective, holding a step's lease; dying instead lets the lease
expire and the step go to the next trainer. The children die with the launcher too (Linux's
parent-death signal), so a launcher killed by SIGKILL leaves no rank behind.

Like torchrun's agent, the launcher serves the ranks' c10d store itself, on a port the system
picks when the store binds it: a port chosen first and bound later by rank 0 could be taken by
anything in between. torch is imported only for that, when the ranks start.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: A rank that stops its trainer because the ranks can no longer run in step (one of them
#: failed inside a collective) exits with this status.
EXIT_RANK_FAILED = 70
#: Seconds a rank has to finish after SIGTERM before the launcher kills it.
TERM_GRACE_SECONDS = 10.0
#: How long rank 0 may take to end after another rank ended cleanly: ranks leave together
#: (`World.close`: a barrier, then each tears its process group down), so a follower may exit
#: a moment before the leader does.
FOLLOWER_EXIT_GRACE_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankEnv:
    """Where this process stands in a trainer's world, as torchrun's environment says."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def rank_env(environ: dict[str, str] | None = None) -> RankEnv | None:
    """This process's rank, or None when it is not one rank of several (no WORLD_SIZE above 1).
    A partial or contradictory environment is refused, naming the variable."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        raw = env.get(name, "0" if name == "LOCAL_RANK" else None)
        if raw is None:
            raise ValueError(f"WORLD_SIZE is set but {name} is not: start the ranks with torchrun or --nproc")
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"RANK={rank}, LOCAL_RANK={local}, WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    if world == 1:
        return None
    return RankEnv(rank=rank, local_rank=local, world_size=world)


def rank_environment(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of local rank `rank` of `nproc` on this machine (torchrun's names),
    the store at `port` being the launcher's."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # Every rank is a client of the launcher's store (torchrun's agent store, by name).
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # N ranks on the CPU each taking every core would run N times over-subscribed (torchrun
    # sets 1 for the same reason); an explicit setting wins.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _death_signal() -> Any:
    """What makes a child die with its parent (Linux's prctl), looked up in the parent: the
    child, between fork and exec, only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return die_with_parent


class RankGroup:
    """The ranks' processes, watched together."""

    def __init__(self, argv: Sequence[str], nproc: int, environ: dict[str, str] | None = None) -> None:
        if nproc < 2:
            raise ValueError(f"--nproc {nproc}: a trainer of several ranks needs at least 2")
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = int(self.store.port)
        base = dict(os.environ if environ is None else environ)
        die_with_parent = _death_signal()
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(nproc):
            self.processes.append(
                subprocess.Popen(
                    list(argv),
                    env=rank_environment(base, rank, nproc, port),
                    # Their own session: a Ctrl-C in the terminal reaches the launcher alone,
                    # which stops rank 0 first (a warm shutdown needs the other ranks).
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            )
            print(f"refill: trainer rank {rank} of {nproc} is pid {self.processes[-1].pid}", flush=True)

    def wait(self, poll_seconds: float = 0.1) -> int:
        """Until a rank exits; then stop the others. The first exit status (a signal as 128+N)."""
        stopping = False

        def on_signal(signum: int, _frame: object) -> None:
            nonlocal stopping
            if stopping:  # asked twice: do not wait for anything
                self.kill_all()
                return
            stopping = True
            # Celery's warm shutdown finishes the step in hand, which needs every rank.
            self._signal(0, signal.SIGTERM)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                for rank, process in enumerate(self.processes):
                    code = process.poll()
                    if code is None:
                        continue
                    status = 128 - code if code < 0 else code
                    if rank == 0 and (stopping or code == 0):
                        self.stop_all()  # rank 0 finished a warm shutdown: nothing is in hand
                        return status
                    if rank != 0 and code == 0:
                        # Ended cleanly: the world was closing, unless rank 0 goes on without it.
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            leader = self.processes[0].wait(FOLLOWER_EXIT_GRACE_SECONDS)
                            self.stop_all()
                            return 128 - leader if leader < 0 else leader
                    # A rank died on its own: the trainer cannot finish anything without it.
                    print(f"refill: trainer rank {rank} exited with status {status}; killing the other ranks", flush=True)
                    self.kill_all()
                    return status or EXIT_RANK_FAILED
                time.sleep(poll_seconds)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _signal(self, rank: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.processes[rank].send_signal(signum)

    def stop_all(self) -> None:
        """SIGTERM to every rank still running, SIGKILL to those still there after the grace."""
        for rank, process in enumerate(self.processes):
            if process.poll() is None:
                self._signal(rank, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_SECONDS
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        self.kill_all()

    def kill_all(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.poll() is None:
                self._signal(rank, signal.SIGKILL)
        for process in self.processes:
            process.wait()


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run `argv` as `nproc` ranks of one trainer until one exits; the exit status."""
    return RankGroup(argv, nproc).wait()
