"""Answer verification for GSM8K/MATH-style data with ``math-verify``.

``verify(completion, row)`` parses the gold answer (``row["answer"]``: a number, a bare LaTeX
answer, a ``\\boxed{}`` solution or a GSM8K ``#### 42`` solution) and the completion with
``math_verify.parse`` and compares them with ``math_verify.verify``. No LaTeX is matched by hand.

What counts as a wrong answer and what as a failure of the verifier
------------------------------------------------------------------
math-verify's defaults (``raise_on_error=False``) turn every internal problem into "not equal":
a crash, a timeout and a wrong answer all read 0.0. In GRPO that is harmful, because a group in
which the verifier broke on every completion looks like a zero-variance group and is filtered
away without a trace (SPEC's "filters that silently never fire" hazard, the other way round). So
this function calls math-verify with ``raise_on_error=True`` and decides itself:

- 0.0: the completion contains no parsable answer, or its answer is not equal to the gold one.
  Malformed LaTeX in a completion is handled inside math-verify (it falls back to the string) and
  also ends here: the model wrote something that is not the answer.
- ``VerifierError`` (raised): the gold answer does not parse (the data set row is broken), or
  math-verify raised. ``score_group`` turns it into a data failure of the attempt, visible in the
  ledger with the reason.
- ``VerifierTimeout`` (a ``VerifierError``) by default when parsing or comparing exceeds
  ``timeout_seconds``: the verifier could not decide, which is not evidence that the answer is
  wrong. ``on_timeout="zero"`` scores it 0.0 instead, the common choice of RL recipes that would
  rather penalise pathological outputs than fail the attempt.

Timeouts and threads
--------------------
math-verify enforces its timeouts with ``SIGALRM``, which works only in a process's main thread,
while a generation worker scores rewards on its pool threads. The default
``isolation="process"`` therefore runs verification in a small pool of helper processes
(``python -m refill.rewards.math``, POSIX only), where math-verify's own timeouts work; a helper
that does not answer within a hard deadline is killed and replaced, so a runaway SymPy
simplification can never wedge a worker thread. ``isolation="inline"`` runs in the calling thread: with a timeout it must be the main
thread (it raises otherwise), and with ``timeout_seconds=None`` there is no timeout at all.

Keyword arguments (``reward.kwargs`` in the run config): ``answer_key`` ["answer"],
``gold_format`` ["auto" | "raw", see ``gold_expression``], ``timeout_seconds`` [5],
``on_timeout`` ["raise" | "zero"], ``isolation`` ["process" | "inline"], ``float_rounding`` [6],
``strict`` [True], ``max_processes`` [min(4, cpu count)].
"""

from __future__ import annotations

import gc
import json
import math
import os
import queue
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

_STARTUP_SECONDS = 120.0


class VerifierError(RuntimeError):
    """math-verify could not judge the completion (not a wrong answer)."""


class VerifierTimeout(VerifierError):
    """Parsing or comparing took longer than the configured timeout."""


_ANCHORS = ("\\boxed", "$", "\\(", "\\[")


def gold_expression(gold_text: str, gold_format: str = "auto") -> str:
    """The text to hand to ``math_verify.parse`` for a gold answer.

    math-verify looks for answers inside anchors (``$...$``, ``\\boxed{}``); a bare LaTeX answer,
    the usual MATH ``answer`` field, is otherwise read piecemeal (``\\{2, 3\\}`` parses as ``3``,
    ``\\frac{\\sqrt{2}}{2}`` not at all). ``auto`` therefore wraps a bare answer in ``$...$``, takes
    the part after GSM8K's ``####`` marker, and leaves text that already has anchors (a full
    solution with ``\\boxed{}``) as it is. ``raw`` passes the text unchanged.
    """
    if gold_format == "raw":
        return gold_text
    if gold_format != "auto":
        raise ValueError(f"gold_format must be 'auto' or 'raw', not {gold_format!r}")
    if "####" in gold_text:
        return f"${gold_text.rsplit('####', 1)[1].strip()}$"
    if any(anchor in gold_text for anchor in _ANCHORS):
        return gold_text
    return f"${gold_text.strip()}$"


def _check(
    completion: str, gold_text: str, timeout_seconds: float | None, options: dict[str, Any]
) -> float:
    """Parse and compare in this thread, with math-verify's own (SIGALRM) timeouts."""
    from math_verify import parse
    from math_verify import verify as math_verify
    from math_verify.errors import TimeoutException

    seconds = None if timeout_seconds is None else max(1, math.ceil(timeout_seconds))
    # math-verify's SIGALRM handler raises its timeout in whatever Python code runs when the
    # alarm fires. Inside a callback of the garbage collector (a weakref's, a finalizer's: CI
    # saw SQLAlchemy's) the exception is reported as unraisable and dropped, and the
    # verification runs on past its timeout. No collection runs while it verifies.
    collecting = gc.isenabled()
    gc.disable()
    try:
        gold = parse(
            gold_expression(gold_text, options.get("gold_format", "auto")),
            parsing_timeout=seconds,
            raise_on_error=True,
        )
        if not gold:
            raise VerifierError(
                f"the gold answer {gold_text!r} does not parse; fix the data set row or the "
                "answer_key of the reward"
            )
        predicted = parse(completion, parsing_timeout=seconds, raise_on_error=True)
        if not predicted:
            return 0.0
        equal = math_verify(
            gold,
            predicted,
            float_rounding=options.get("float_rounding", 6),
            strict=options.get("strict", True),
            timeout_seconds=seconds,
            raise_on_error=True,
        )
    except TimeoutException as exc:
        raise VerifierTimeout(f"math-verify timed out after {seconds} s: {exc}") from exc
    except VerifierError:
        raise
    except Exception as exc:
        raise VerifierError(f"math-verify failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if collecting:
            gc.enable()
    return 1.0 if equal else 0.0


# ---------------------------------------------------------------------------- helper processes
#
# A helper is `python -m refill.rewards.math` speaking one JSON object per line on its stdin and
# stdout. A plain subprocess (rather than multiprocessing) neither re-imports the parent's
# `__main__` nor forks a process that holds threads and CUDA state.

_MESSAGE_LIMIT = 2000


def _serve() -> None:
    """Helper main loop: answer each request line with a status line."""
    # Anything a library prints must not corrupt the protocol: stdout becomes stderr.
    protocol, sys.stdout = sys.stdout, sys.stderr
    import math_verify  # noqa: F401 - imported before "ready" so a call's deadline excludes it

    def reply(status: str, value: Any) -> None:
        protocol.write(json.dumps({"status": status, "value": value}) + "\n")
        protocol.flush()

    reply("ready", None)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = _check(
                request["completion"], request["gold"], request["timeout"], request["options"]
            )
        except VerifierTimeout as exc:
            reply("timeout", str(exc)[:_MESSAGE_LIMIT])
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            reply("error", f"{type(exc).__name__}: {exc}"[:_MESSAGE_LIMIT])
        else:
            reply("ok", value)


class _Helper:
    """One helper process and its pipes."""

    def __init__(self) -> None:
        import refill

        env = dict(os.environ)
        # The helper must import this package even when it is used from a source checkout.
        root = str(Path(refill.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "refill.rewards.math"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        status, _ = self._read(_STARTUP_SECONDS)
        if status != "ready":
            self.kill()
            raise VerifierError(f"the verifier process sent {status!r} instead of 'ready'")

    def _read(self, deadline: float) -> tuple[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], deadline)
        if not ready:
            self.kill()
            raise VerifierTimeout(f"the verifier process did not answer within {deadline:.1f} s")
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(5)
            raise VerifierError(f"the verifier process exited with status {code}")
        answer = json.loads(line)
        return answer["status"], answer["value"]

    def call(self, request: dict[str, Any], deadline: float) -> tuple[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read(deadline)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


class _HelperPool:
    def __init__(self, size: int) -> None:
        self._slots = threading.Semaphore(size)
        self._idle: queue.LifoQueue[_Helper] = queue.LifoQueue()

    def run(self, request: dict[str, Any], deadline: float) -> tuple[str, Any]:
        with self._slots:
            try:
                helper = self._idle.get_nowait()
            except queue.Empty:
                helper = _Helper()
            try:
                answer = helper.call(request, deadline)
            except BaseException:
                # Stuck, dead or interrupted: its state is unknown, so it is not reused.
                helper.kill()
                raise
            self._idle.put(helper)
            return answer


_pool: _HelperPool | None = None
_pool_lock = threading.Lock()


def _get_pool(max_processes: int | None) -> _HelperPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _HelperPool(max_processes or min(4, os.cpu_count() or 1))
        return _pool


def _hard_deadline(timeout_seconds: float) -> float:
    # Each of math-verify's steps (two parses, a handful of pairwise comparisons) has its own
    # alarm; the backstop only has to catch a helper that no longer reacts to it.
    return 6 * max(1, math.ceil(timeout_seconds)) + 2.0


# ---------------------------------------------------------------------------- reward


def verify(
    completion: str,
    row: dict[str, Any],
    *,
    answer_key: str = "answer",
    timeout_seconds: float | None = 5,
    on_timeout: str = "raise",
    isolation: str = "process",
    gold_format: str = "auto",
    float_rounding: int = 6,
    strict: bool = True,
    max_processes: int | None = None,
) -> float:
    """1.0 if the completion's final answer equals the gold answer, 0.0 if it does not.

    Raises ``VerifierError`` when the verifier cannot judge (see the module docstring).
    """
    if on_timeout not in ("raise", "zero"):
        raise ValueError(f"on_timeout must be 'raise' or 'zero', not {on_timeout!r}")
    if isolation not in ("process", "inline"):
        raise ValueError(f"isolation must be 'process' or 'inline', not {isolation!r}")
    if answer_key not in row:
        raise KeyError(
            f"the row has no {answer_key!r} field holding the gold answer (fields: {sorted(row)})"
        )
    gold_text = str(row[answer_key])
    gold_expression(gold_text, gold_format)  # rejects a bad gold_format before any work
    options = {"gold_format": gold_format, "float_rounding": float_rounding, "strict": strict}
    try:
        # Without a timeout there is nothing a helper process would enforce.
        if isolation == "inline" or timeout_seconds is None:
            if (
                timeout_seconds is not None
                and threading.current_thread() is not threading.main_thread()
            ):
                raise VerifierError(
                    "isolation='inline' with a timeout only works in the main thread (math-verify "
                    "uses SIGALRM); use isolation='process' or timeout_seconds=None"
                )
            return _check(completion, gold_text, timeout_seconds, options)
        status, value = _get_pool(max_processes).run(
            {
                "completion": completion,
                "gold": gold_text,
                "timeout": timeout_seconds,
                "options": options,
            },
            _hard_deadline(timeout_seconds),
        )
    except VerifierTimeout:
        if on_timeout == "zero":
            return 0.0
        raise
    if status == "ok":
        return float(value)
    if status == "timeout":
        if on_timeout == "zero":
            return 0.0
        raise VerifierTimeout(value)
    raise VerifierError(value)


if __name__ == "__main__":
    _serve()
