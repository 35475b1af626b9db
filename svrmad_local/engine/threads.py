"""The CPU steps' threads: how many the engine's worker runs, and a warning when they sleep on barriers.

Torch's CPU parallel ops run on GNU OpenMP: a parallel op splits its work over a team of threads and
waits at a barrier for the slowest one. When another process is busy on one of the cores the team
runs on, the thread there gets a share of that core and every op of every step waits for it (one
busy core made the steps of a 2-core machine 4.5-25x slower, not 2x). `TeamSize` measures what the
process gets of its cores, and sizes the worker thread's team to it: the cores the process may run
on (its affinity) less what other processes used of them over the last half second (/proc/stat
less this process's own CPU time), counted only while its threads wait on a run queue for a core
(/proc/self/task/*/schedstat). It takes threads back when the cores are free again, never runs more
than torch's thread count, and says the first change in one line (docs/engine.md, "Threads").

The same barriers hurt from inside the process: GNU OpenMP keeps one thread team per thread that
starts a parallel op, so a caller that starts torch work on another thread (a `model.generate` beside
the engine, a big op in a callback) keeps more threads than there are cores, and every team stops
spinning at its barriers and sleeps on a futex instead, tens of times per layer. `BarrierSleepWatch`
reads the worker thread's voluntary context switches every `every` steps (one small /proc read) and
says once, in one line, what it measured. The commonest such thread is the caller's own: loading or
preparing a model there leaves it an idle team for the rest of the process. `release_team()` hands
that team back (OpenMP 5's `omp_pause_resource_all`, which GNU OpenMP implements for the calling
thread only); the engine calls it on the caller's thread when it is built and on each request.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .execution import Choice

log = logging.getLogger("svrmad_local")

# A healthy step sleeps under once (waiting for its next submission; 0.3-0.5 measured); a step over
# oversubscribed teams sleeps at most barriers of every layer: ~50-230 times on the default model.
SLEEPS_PER_STEP = 25
WINDOW_S = 0.5  # how often the team size is reconsidered: a few dozen steps, one /proc read each
# A thread fewer when what other processes leave is a quarter of a core short of the team; one more when
# three quarters of a core more is free (the gap between the two keeps a team from flapping).
DOWN_MARGIN, UP_MARGIN = 0.25, 0.75
WAITING = 0.05  # this process's threads waiting on a run queue (threads, on average): the cores are contended


class ThreadsWarning(UserWarning):
    """The engine runs fewer threads than torch's count, because other processes take cores."""


# -- what this process gets of its cores ------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """Counters at one instant: seconds since an arbitrary start."""

    wall: float
    ours: float  # CPU time of this process and of its children it has reaped (a kernel build)
    busy: float  # CPU time spent on this process's cores, by anyone
    waited: float | None  # time this process's threads spent runnable but waiting for a core; None: unreadable


@dataclass(frozen=True)
class Share:
    """What a window measured: the cores this process may run on, what other processes used of them
    (cores, on average), and how many of this process's threads waited for a core (on average)."""

    cores: int
    others: float
    waited: float | None

    @property
    def free(self) -> float:
        return self.cores - self.others


def _ticks(text: str, fields: tuple[int, ...]) -> int:
    parts = text.split()
    return sum(int(parts[i]) for i in fields)


def sample(cpus: frozenset[int], task_dir: Path = Path("/proc/self/task")) -> Sample | None:
    """The counters now (Linux /proc), or None where they cannot be read."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        stat = Path("/proc/self/stat").read_text()
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    # after the command name (which may hold spaces): state is field 3, utime..cstime are 14..17
    ours = _ticks(stat.rsplit(")", 1)[1], (11, 12, 13, 14))
    busy = 0  # user nice system [idle iowait] irq softirq steal (guest time is inside user)
    for line in lines:
        name = line.split(maxsplit=1)[0]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            busy += _ticks(line, (1, 2, 3, 6, 7, 8))
    waited = 0
    try:
        for task in task_dir.iterdir():
            try:
                waited += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
                continue
    except OSError:
        waited = None
    return Sample(time.monotonic(), ours / hz, busy / hz, None if waited is None else waited / 1e9)


def share(a: Sample, b: Sample, cores: int) -> Share:
    wall = max(b.wall - a.wall, 1e-9)
    others = max(0.0, (b.busy - a.busy) - (b.ours - a.ours)) / wall
    waited = None if a.waited is None or b.waited is None else max(0.0, b.waited - a.waited) / wall
    return Share(cores, min(others, cores), waited)


def fit(now: int, most: int, s: Share) -> int:
    """The team size for the next window, from `now` (at most `most`, at least 1): fewer threads when the
    cores other processes leave are short of the team and this process's threads waited for them; more
    when a core is free again."""
    if now > 1 and s.free < now - DOWN_MARGIN and (s.waited is None or s.waited > WAITING):
        return max(1, math.floor(s.free + DOWN_MARGIN))
    if now < most and s.free >= now + UP_MARGIN:
        return min(most, math.floor(s.free + DOWN_MARGIN))
    return now


# -- the OpenMP runtime torch loaded ------------------------------------------------------------------
@functools.cache
def _gomp() -> ctypes.CDLL | None:
    """The GNU OpenMP torch loaded, or None (another runtime, two of them, no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]})
    if len(paths) != 1:
        return None  # none (Intel or LLVM OpenMP) or two runtimes: leave them alone
    try:
        return ctypes.CDLL(paths[0])
    except OSError:
        return None


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the GNU OpenMP torch loaded, or None."""
    lib = _gomp()
    fn = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None  # None before GCC 9
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_team() -> bool:
    """Hand back the calling thread's idle GNU OpenMP team (its next parallel op makes a new one).
    True when there was a runtime to ask and it agreed; a no-op where the thread has no team."""
    fn = _pause_all()
    return fn is not None and fn(1) == 0  # 1: omp_pause_soft


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's MKL (linked into libtorch_cpu), or None."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        lib.mkl_set_num_threads_local, lib.mkl_get_max_threads  # noqa: B018  (both there, or none)
    except (OSError, AttributeError):  # another build of torch (no MKL, or MKL as its own library)
        return None
    return lib


def _mkl_local(n: int) -> bool:
    """MKL's count for the calling thread (its exported name takes the count by reference, checked)."""
    lib = _mkl()
    if lib is None:
        return False
    lib.mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(n)))
    return lib.mkl_get_max_threads() == n


def set_team(n: int) -> None:
    """The calling thread's parallel ops run on n threads from now on; other threads keep theirs (an
    OpenMP thread count is per thread, and MKL's is set for this thread only). Where the runtime is not
    GNU OpenMP, torch's process-wide set_num_threads."""
    torch.get_num_threads()  # torch sets a thread's count on its first use: before ours, not over it
    lib = _gomp()
    if lib is None:
        torch.set_num_threads(n)
        return
    lib.omp_set_num_threads(ctypes.c_int(n))
    _mkl_local(n)


# -- the watches ----------------------------------------------------------------------------------
class TeamSize:
    """The worker thread's team, sized every `window_s` of steps to the cores this process gets (built and
    stepped on the worker thread). `adapt=False` keeps torch's count: a step's arithmetic, and so the
    log-probs' last bits, do not change with the machine's load."""

    def __init__(self, adapt: bool = True, window_s: float = WINDOW_S,
                 read: Callable[[frozenset[int]], Sample | None] = sample, apply: Callable[[int], None] = set_team):
        self.most = self.now = torch.get_num_threads()
        self.cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.adapt = adapt and self.most > 1 and bool(self.cpus)
        self.window_s, self.read, self.apply = window_s, read, apply
        self.last = read(self.cpus) if self.adapt else None
        self.adapt = self.last is not None
        self.changes, self.share, self.said = 0, None, False

    def step(self) -> None:
        if self.last is None or time.monotonic() - self.last.wall < self.window_s:
            return
        now = self.read(self.cpus)
        if now is None:
            self.last = None
            return
        self.share, self.last = share(self.last, now, len(self.cpus)), now
        n = fit(self.now, self.most, self.share)
        if n != self.now:
            self.apply(n)
            self.now, self.changes = n, self.changes + 1
            self._say()

    def _say(self) -> None:
        s = self.share
        if self.now < self.most and not self.said:
            self.said = True
            warnings.warn(
                f"other processes are using {s.others:.1f} of the {s.cores} cores this process may run on: the "
                f"engine's CPU steps run on {self.now} of its {self.most} threads while they do (a step waits for its "
                f"slowest thread), and take the others back when the cores are free", ThreadsWarning, stacklevel=2)
        else:
            log.info("svrmad: the engine's CPU steps run on %d of %d threads (other processes use %.1f of %d cores)",
                     self.now, self.most, s.others, s.cores)

    def choice_value(self) -> tuple[str, str]:
        """(value, reason) of the record's threads choice (engine/execution.py)."""
        if self.adapt:
            return f"up to {self.most}", ("torch's thread count, fewer while other processes take cores "
                                          "(engine/threads.py)")
        why = "adapt_threads=False" if self.most > 1 else "torch's thread count"
        return str(self.most), why

    def info(self) -> dict:
        """Engine.info["threads"]: the team now, at most, how often it changed, and the last window's figures."""
        s = self.share
        return {"now": self.now, "most": self.most, "adapts": self.adapt, "changes": self.changes,
                "others_cores": round(s.others, 2) if s else None,
                "waiting_threads": round(s.waited, 2) if s and s.waited is not None else None}


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


class StepWatch:
    """What the engine calls after each CPU step (on its worker thread): the team's size, then the
    barrier-sleep warning (quiet once the team has shrunk: its line has named the cause)."""

    def __init__(self, adapt: bool = True):
        self.team, self.sleeps = TeamSize(adapt), BarrierSleepWatch()

    def step(self) -> None:
        self.team.step()
        if not self.team.said:
            self.sleeps.step()


def threads_choice(watch: StepWatch | None) -> Choice:
    """The record's threads choice (engine/execution.py): what the team may be; `Engine.info["threads"]` has
    what it is now."""
    if watch is None:
        return Choice("threads", "none", "the steps run on an accelerator")
    value, why = watch.team.choice_value()
    return Choice("threads", value, why)
