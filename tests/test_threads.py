"""The GNU OpenMP barrier-sleep watch (engine/threads.py): one warning, once, when the worker
thread's steps sleep far more than a healthy step does; silent otherwise and where /proc is absent."""

import logging
import threading
import time
from pathlib import Path

import pytest

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
    assert len(warned) == 1 and "another thread is running torch CPU ops" in warned[0] and "300" in warned[0]


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
