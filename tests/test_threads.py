"""The GNU OpenMP barrier-sleep watch (engine/threads.py): one warning, once, when the worker
thread's steps sleep far more than a healthy step does; silent otherwise and where /proc is absent."""

import logging
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
