"""The grading worker: a child process that does the comparisons needing sympy (or math-verify).

Why a process: sympy work holds the GIL, so in a thread it would still stall the event loop that
feeds the engine; and a process can be killed, a thread cannot. The child is started on first
use with `python -c "...serve()"` (not multiprocessing, which would re-import the caller's
__main__), speaks one JSON line per request over its stdin/stdout (each request numbered, its reply
echoing the number), and serves requests one at a time.

Budget: the work of each request is bounded before it starts (symbolic.py), so a request takes
the same path to the same verdict on an idle or a saturated machine. The wall-clock budget is only
a safety net: a request whose reply is not read within BUDGETS[0] seconds of its sending kills the
child and is retried in a fresh one with BUDGETS[1], and so on; past the last budget the call raises
GradingTimeout. The budget runs from the sending to the reading, whatever the caller did between
(descheduled on a busy machine, a GC pause): a reply found only after the deadline is not taken. An
expiry is never turned into a verdict here (the caller decides what to do, and caches nothing).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["GradingTimeout", "WorkerError", "Worker", "call"]

BUDGETS = (20.0, 120.0)  # seconds per try; read at each call
START_TIMEOUT = 120.0  # the child imports sympy before it says it is ready: not part of a budget


class GradingTimeout(RuntimeError):
    """A request ran past every budget (a bound in symbolic.py proved too loose for it)."""


class WorkerError(RuntimeError):
    """The worker could not be started, or failed on a request."""


class _Lost(Exception):
    pass


class Worker:
    """A client for one worker process; thread-safe (requests are served one at a time)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0
        self._sent = 0  # requests written: each carries its number, which its reply echoes

    def call(self, op: str, *args):
        with self._lock:
            for budget in BUDGETS:
                try:
                    return self._roundtrip(op, args, budget)
                except _Lost as exc:
                    self.stop()
                    log.warning("grading worker: %s on %s %.200r; retrying in a fresh worker", exc, op, args)
            raise GradingTimeout(f"{op} {args!r:.200} ran past every budget {BUDGETS} s")

    def _roundtrip(self, op: str, args: tuple, budget: float):
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self._sent += 1
        request = json.dumps([op, list(args), self._sent]).encode() + b"\n"
        # set before the sending: a caller held up after it once found, past the deadline, a reply the budget had
        # not allowed (stalled 8 ms on a busy 2-core machine, it read a 1e-4 s request's verdict as in time)
        deadline = time.monotonic() + budget
        try:
            self._proc.stdin.write(request)
            self._proc.stdin.flush()
        except OSError as exc:
            raise _Lost(f"worker gone ({exc})") from None
        # a reply to an earlier request left unread (a call stopped between its write and its read, by an
        # exception other than an expiry) is skipped, never taken for this one's
        while True:
            reply = json.loads(self._readline(deadline, f"no reply within {budget} s"))
            if reply.get("id") == self._sent:
                break
            log.warning("grading worker: skipped an unread reply to an earlier request (%s)", reply.get("id"))
        if "error" in reply:
            raise WorkerError(f"grading worker failed on {op}: {reply['error']}")
        return reply["value"]

    def _readline(self, deadline: float, what: str) -> bytes:
        """The next line, read by `deadline` (time.monotonic()): one there only after it counts as none."""
        ready, _, _ = select.select([self._proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise _Lost(what)
        line = self._proc.stdout.readline()
        if not line:
            raise _Lost("worker exited")
        if time.monotonic() > deadline:  # select polls once more when woken late: a reply that came meanwhile
            raise _Lost(what)
        return line

    def _start(self) -> None:
        self.stop()
        root = str(Path(__file__).resolve().parents[2])  # this checkout's svrmad_local, not another
        code = f"import sys; sys.path.insert(0, {root!r}); from svrmad_local.grading.worker import serve; serve()"
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._readline(time.monotonic() + START_TIMEOUT, f"not ready within {START_TIMEOUT} s")
        except (OSError, _Lost) as exc:
            self.stop()
            raise WorkerError(f"grading worker could not start: {exc}") from None
        self.restarts += 1

    def forget(self) -> None:
        """In a forked child: the parent's worker, pipes and lock are not this process's."""
        self._proc = None
        self._lock = threading.Lock()
        self._sent = 0

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


_WORKER = Worker()
os.register_at_fork(after_in_child=_WORKER.forget)


def call(op: str, *args):
    """Run `op` in the shared worker (started on first use)."""
    return _WORKER.call(op, *args)


# ----------------------------------------------------------------------------- the child


def _math(na: str, nb: str) -> bool:
    from svrmad_local.grading.equivalence import FULL, decide

    try:
        return decide(na, nb, FULL)
    except Exception:  # a sympy failure is deterministic: the same pair fails the same way
        log.debug("equivalence failed: %.200r vs %.200r", na, nb, exc_info=True)
        return False


def _math_verify(answer: str, gold: str) -> bool:
    from svrmad_local.grading.mathverify import verify_answer

    return verify_answer(answer, gold)


OPS = {"math": _math, "math-verify": _math_verify, "ping": lambda: True}


def serve() -> None:
    out = os.fdopen(os.dup(1), "wb")  # the protocol channel; whatever a library prints goes to stderr
    os.dup2(2, 1)
    import sympy  # noqa: F401  (imported before "ready", so no request pays for it)

    out.write(b'{"value": "ready"}\n')
    out.flush()
    for line in sys.stdin.buffer:
        rid = None
        try:
            op, args, *rest = json.loads(line)
            rid = rest[0] if rest else None
            reply = {"value": OPS[op](*args)}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        reply["id"] = rid
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
