"""The launch's start protocol (job/launch.Dist.announce) between two ranks in one process, over an in-memory
store: what rank 0 makes reaches every rank, and a failure on rank 0 stops the others without a message
of their own. The torchrun launches of tests/test_dp.py and tests/test_tp.py run it for real."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore

from svrmad_local.job.launch import Dist


def _two_ranks():
    store = HashStore()
    return Dist(0, 2, 0, store), Dist(1, 2, 0, store)


def _follow(d: Dist, got: list) -> threading.Thread:
    def run():
        got.append(d.announce(lambda: pytest.fail("only rank 0 makes the start")))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_rank_zero_makes_the_start_and_every_rank_gets_it():
    main, other = _two_ranks()
    got: list = []
    t = _follow(other, got)
    message = {"config": {"tp": 1}, "todo": [{"id": "q1"}], "model": "/m"}
    assert main.announce(lambda: message) == message
    t.join(10)
    assert got == [message]


def test_a_failure_on_rank_zero_is_raised_there_and_stops_the_others():
    main, other = _two_ranks()
    got: list = []
    t = _follow(other, got)

    def bad():
        raise ValueError("--tp 3 needs a multiple of 3")

    with pytest.raises(ValueError, match="--tp 3"):
        main.announce(bad)
    t.join(10)
    assert got == [None]


def test_a_single_process_runs_the_start_itself():
    assert Dist().announce(lambda: {"todo": []}) == {"todo": []}


def test_the_backend_is_nccl_on_gpus_gloo_on_cpus_or_as_asked(monkeypatch):
    """SVRMAD_DIST_BACKEND=gloo lets ranks share one GPU (the GPU check's tensor-parallel test); a
    backend torch.distributed would not know is one line naming the variable."""
    from svrmad_local.job.launch import BACKEND_ENV, backend_for

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for(cuda=True) == "nccl" and backend_for(cuda=False) == "gloo"
    monkeypatch.setenv(BACKEND_ENV, " Gloo ")
    assert backend_for(cuda=True) == "gloo"
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="SVRMAD_DIST_BACKEND='mpi': use nccl or gloo"):
        backend_for(cuda=True)
