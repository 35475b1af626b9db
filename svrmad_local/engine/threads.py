"""A warning when the engine's CPU steps start sleeping on GNU OpenMP barriers.

Torch's CPU parallel ops run on GNU OpenMP, which keeps one thread team per thread that starts a
parallel op. The engine runs every forward on its one worker thread for that reason, but a caller
can still start torch work on another thread (a `model.generate` beside the engine, a big op in a
callback): once more OpenMP threads are kept than there are cores, every team stops spinning at its
barriers and sleeps on a futex instead, tens of times per layer, and the steps slow down (by how
much, on which machine: docs/engine.md, "One worker thread for every forward"). Another process busy
on the same cores does the same from outside. Nothing fails, so nobody would know; this watch reads
the worker thread's voluntary context switches every `every` steps (one small /proc read) and says
once, in one line, what it measured and the two things that cause it: it cannot tell which.

The commonest such thread is the caller's own: loading or preparing a model there (a cast, an
init, a warm-up) leaves it an idle team for the rest of the process. `release_team()` hands that team
back (OpenMP 5's `omp_pause_resource_all`, which GNU OpenMP implements for the calling thread only);
the engine calls it on the caller's thread when it is built and on each request.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("svrmad_local")

# A healthy step sleeps under once (waiting for its next submission; 0.3-0.5 measured); a step over
# oversubscribed teams sleeps at most barriers of every layer: ~50-230 times on the default model.
SLEEPS_PER_STEP = 25


def voluntary_switches() -> int | None:
    """The calling thread's voluntary context switches (Linux), else None."""
    try:
        text = Path(f"/proc/self/task/{threading.get_native_id()}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return None


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the GNU OpenMP torch loaded, or None (another runtime, no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]})
    if len(paths) != 1:
        return None  # none (Intel or LLVM OpenMP) or two runtimes: leave them alone
    try:
        fn = ctypes.CDLL(paths[0]).omp_pause_resource_all
    except (OSError, AttributeError):  # a GNU OpenMP older than GCC 9
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_team() -> bool:
    """Hand back the calling thread's idle GNU OpenMP team (its next parallel op makes a new one).
    True when there was a runtime to ask and it agreed; a no-op where the thread has no team."""
    fn = _pause_all()
    return fn is not None and fn(1) == 0  # 1: omp_pause_soft


class BarrierSleepWatch:
    """Call `step()` on the worker thread after each CPU step."""

    def __init__(self, every: int = 64, read: Callable[[], int | None] = voluntary_switches,
                 limit: float = SLEEPS_PER_STEP):
        self.every, self.read, self.limit = every, read, limit
        self.steps, self.last, self.warned = 0, None, False

    def step(self) -> None:
        self.steps += 1
        if self.warned or self.steps % self.every:
            return
        now = self.read()
        if now is None:
            self.warned = True  # nothing to read here: stop looking
            return
        if self.last is not None and (now - self.last) / self.every > self.limit:
            self.warned = True
            log.warning(
                f"the engine's worker thread slept {(now - self.last) / self.every:.0f} times a step over its last "
                f"{self.every} steps (a healthy step: under 1): its GNU OpenMP threads are waiting at their "
                f"barriers instead of spinning, and steps can be 1.7x slower. Two things do this: more threads "
                f"wanting these cores than there are (other processes on the machine, or torch CPU work on another "
                f"thread of this process beside the engine); give the run its cores, or run such torch work "
                f"before or after the engine (docs/engine.md, 'One worker thread').")
        self.last = now
