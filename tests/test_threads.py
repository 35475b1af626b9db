"""The GNU OpenMP barrier-sleep watch (engine/threads.py): one warning, once, when the worker
thread's steps sleep far more than a healthy step does; silent otherwise and where /proc is absent."""

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from svrmad_local.engine import threads
from svrmad_local.engine.threads import SLEEPS_PER_STEP, BarrierSleepWatch, voluntary_switches


def drive(watch, per_step, steps):
    count = watch.__dict__.setdefault("count", [0])
    watch.read = lambda: count[0]
    for _ in range(steps):
        count[0] += per_step
        watch.step()


def test_warns_once_when_steps_sleep_on_barriers(caplog):
    w = BarrierSleepWatch(every=8)
    with caplog.at_level(logging.WARNING, "svrmad_local"):
        drive(w, 2, 64)
        assert not caplog.records  # a healthy rate
        drive(w, 300, 64)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "slept 300 times a step over its last 8 steps" in warned[0], warned
    # what it measured, and both causes, never one guessed (another process on the cores sleeps the worker too)
    assert "other processes on the machine" in warned[0] and "another thread of this process" in warned[0]
    assert "another thread is running" not in warned[0]


def test_the_threshold_is_per_step_and_silent_without_proc(caplog):
    w = BarrierSleepWatch(every=8)
    with caplog.at_level(logging.WARNING, "svrmad_local"):
        drive(w, SLEEPS_PER_STEP, 64)  # at the limit: not over it
        w2 = BarrierSleepWatch(every=8, read=lambda: None)
        for _ in range(64):
            w2.step()
    assert not caplog.records and w2.warned


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc")
def test_counts_the_calling_threads_own_sleeps():
    got = []

    def sleeper():
        before = voluntary_switches()
        for _ in range(5):
            time.sleep(0.002)
        got.append(voluntary_switches() - before)

    t = threading.Thread(target=sleeper)
    t.start()
    t.join()
    assert got[0] >= 5


def _tids() -> set[str]:
    return {t.name for t in Path("/proc/self/task").iterdir()}


def _team_work():
    torch.ones(1 << 22).add_(1)  # one parallel op: the calling thread gets a team


@pytest.mark.skipif(not Path("/proc/self/task").exists() or torch.get_num_threads() < 2
                    or threads._pause_all() is None,
                    reason="GNU OpenMP on Linux, 2+ threads")
def test_release_team_hands_back_the_calling_threads_idle_team():
    """The hazard's commonest source: a caller that ran one torch op keeps its team for good."""
    def on_a_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    def with_team():  # by thread id: an earlier test's engine thread may end meanwhile
        before = _tids()
        _team_work()
        team = _tids() - before
        assert threads.release_team()
        return team, team & _tids()

    team, left = on_a_thread(with_team)
    assert len(team) == torch.get_num_threads() - 1 and not left
    assert on_a_thread(threads.release_team)  # no team: a no-op that still succeeds


def test_the_engine_releases_its_callers_team_when_built_and_on_each_request(monkeypatch, tiny_model, tiny_tokenizer):
    from svrmad_local.engine.engine import Engine

    calls = []
    monkeypatch.setattr("svrmad_local.engine.engine.release_team", lambda: calls.append(threading.get_ident()))
    eng = Engine(tiny_model, tiny_tokenizer)
    try:
        assert calls == [threading.get_ident()]
        eng.generate_sync([[1, 2, 3], [4, 5]])
        assert len(calls) == 3
    finally:
        eng.close()


# -- the team's size: what the process gets of its cores ---------------------------------------------------


def test_fit_drops_to_the_cores_left_and_takes_them_back():
    """A busy loop on one of 2 cores: the team shrinks to 1 (never 0) and, once the core is free, grows back
    to torch's count, never above it; the gap between the two rules keeps it from flapping."""
    busy = threads.Share(cores=2, others=0.6, waited=0.5)  # measured at 2 threads beside one busy loop
    assert threads.fit(2, 2, busy) == 1
    assert threads.fit(1, 2, threads.Share(2, 1.0, 0.0)) == 1  # at 1 thread the loop has its core: stay
    assert threads.fit(1, 2, threads.Share(2, 0.05, 0.0)) == 2  # the loop ended
    assert threads.fit(2, 2, threads.Share(2, 0.05, 0.0)) == 2
    assert threads.fit(8, 8, threads.Share(8, 7.9, 2.0)) == 1  # floor, not zero
    assert threads.fit(4, 8, threads.Share(8, 0.0, 0.0)) == 8  # back to at most `most`
    assert threads.fit(2, 2, threads.Share(2, 0.2, 0.3)) == 2  # a light load (a shell, a monitor): kept
    assert threads.fit(1, 2, threads.Share(2, 0.5, 0.0)) == 1  # half a core taken: not enough to grow
    # others used cores, but this process's threads did not wait for them (it was idle): nothing to change
    assert threads.fit(2, 2, threads.Share(2, 1.0, 0.0)) == 2
    assert threads.fit(2, 2, threads.Share(2, 1.0, None)) == 1  # no schedstat: the load alone decides


def test_share_reads_the_window_between_two_samples():
    a = threads.Sample(wall=10.0, ours=5.0, busy=8.0, waited=1.0)
    b = threads.Sample(wall=10.5, ours=5.6, busy=9.5, waited=1.2)
    s = threads.share(a, b, 2)
    assert s.others == pytest.approx((1.5 - 0.6) / 0.5) and s.waited == pytest.approx(0.4) and s.cores == 2
    reaped = threads.Sample(wall=10.5, ours=40.0, busy=9.5, waited=None)  # a build child reaped in the window
    assert threads.share(a, reaped, 2).others == 0.0 and threads.share(a, reaped, 2).waited is None
    ended = threads.Sample(wall=10.5, ours=5.6, busy=9.5, waited=0.9)  # a thread ended: its wait left the sum
    assert threads.share(a, ended, 2).waited == 0.0


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux /proc")
def test_sample_reads_this_process_and_its_cores():
    cpus = frozenset(os.sched_getaffinity(0))
    a = threads.sample(cpus)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass  # this process's own work is not another process's
    b = threads.sample(cpus)
    assert a is not None and b is not None and b.wall > a.wall
    assert b.ours - a.ours >= 0.1 and b.busy - a.busy >= b.ours - a.ours - 0.05
    # the sum over the threads alive at each read: one that ends between them takes its wait with it, so
    # the sum can fall (seen: 4.197 -> 4.173 s in a full run; share clamps it, tested above)
    assert a.waited is None or (b.waited is not None and b.waited >= 0)


def scripted(shares: list[tuple[float, float]], most: int = 2):
    """A TeamSize over scripted windows (others, waited), each one window_s later; what it applied."""
    applied, clock = [], [1.0]
    it = iter(shares)

    def read(_cpus):
        step = next(it, None)
        clock[0] += 1.0
        if step is None:
            return threads.Sample(clock[0], 0.0, 0.0, 0.0)
        others, waited = step
        prev = read.last
        read.last = threads.Sample(clock[0], prev.ours, prev.busy + others, prev.waited + waited)
        return read.last

    read.last = threads.Sample(1.0, 0.0, 0.0, 0.0)
    team = threads.TeamSize.__new__(threads.TeamSize)
    team.most = team.now = most
    team.cpus, team.adapt, team.window_s, team.read, team.apply = frozenset(range(2)), True, 0.0, read, applied.append
    team.last, team.changes, team.share, team.said = read.last, 0, None, False
    return team, applied, clock


def test_the_team_shrinks_says_so_once_and_grows_back(monkeypatch, caplog):
    monkeypatch.setattr(threads.time, "monotonic", lambda: 1e9)  # every step closes a window
    team, applied, _ = scripted([(0.6, 0.5), (1.0, 0.0), (0.0, 0.0), (0.7, 0.4), (0.0, 0.0)])
    with pytest.warns(threads.ThreadsWarning) as said, caplog.at_level(logging.INFO, "svrmad_local"):
        for _ in range(5):
            team.step()
    assert applied == [1, 2, 1, 2]
    assert len(said) == 1  # the first shrink, in one line; the rest at info level
    line = str(said[0].message)
    assert line.startswith("other processes are using 0.6 of the 2 cores this process may run on: the engine's CPU "
                           "steps run on 1 of its 2 threads") and "\n" not in line
    assert team.info() == {"now": 2, "most": 2, "adapts": True, "changes": 4, "others_cores": 0.0,
                           "waiting_threads": 0.0}


def test_set_team_is_the_calling_threads_own():
    got = []

    def worker():
        threads.set_team(1)
        got.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    before = torch.get_num_threads()
    t.start()
    t.join()
    assert got == [1] and torch.get_num_threads() == before


@pytest.mark.skipif(torch.get_num_threads() < 2 or not Path("/proc/stat").exists(), reason="2+ threads, Linux")
def test_the_engine_runs_fewer_threads_beside_a_busy_core_and_says_so(monkeypatch, tiny_model, tiny_tokenizer):
    """A busy loop pinned to one of the cores: within a few windows the engine's steps run on fewer threads
    (Engine.info["threads"]), said in one line; the record names the policy. (Other processes of a shared
    machine only add to the load the loop makes.)"""
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.engine.params import SamplingParams

    monkeypatch.setattr(threads, "WINDOW_S", 0.2)
    # a new thread takes torch's last set_num_threads, whichever thread called it: start from every core
    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    eng = Engine(tiny_model, tiny_tokenizer, EngineConfig(adapt_threads=True))
    core = max(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        assert eng.execution.threads.value == f"up to {torch.get_num_threads()}"
        with pytest.warns(threads.ThreadsWarning, match="other processes are using"):
            deadline = time.monotonic() + 120
            while eng.info["threads"]["now"] == torch.get_num_threads() and time.monotonic() < deadline:
                eng.generate_sync([[3, 4, 5, 6]] * 4, SamplingParams(max_tokens=32, ignore_eos=True, seed=1))
        info = eng.info["threads"]
        assert info["now"] < info["most"] and info["changes"] >= 1 and info["others_cores"] > 0
    finally:
        loop.kill()
        loop.wait()
        eng.close()
        torch.set_num_threads(before)
    fixed = Engine(tiny_model, tiny_tokenizer, EngineConfig(adapt_threads=False))
    assert fixed.execution.threads.value == str(torch.get_num_threads()) and not fixed.info["threads"]["adapts"]
    fixed.close()
