"""Tensor parallelism over 2 CPU processes (gloo): the same tokens as one process.

Our own plan (models/shard.py) splits attention by heads and the MLP by columns/rows; the sums of the row-parallel
blocks are reduced in another order than one process adds them, so log-probs are compared within 1e-4 and greedy
tokens exactly (on this tiny model no near-tie flips them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from svrmad_local.dist import Dist
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.models.loader import load_model

from .conftest import make_model
from .test_dp import N, RUN, finish, launch, outcome, tiny  # noqa: F401 (tiny: the fixture)
from .tp_worker import workload

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama", layers=2).save_pretrained(path)
    return path


def test_tensor_parallel_matches_one_process(checkpoint, tmp_path):
    out = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           str(ROOT / "tests" / "tp_worker.py"), str(checkpoint), str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    tp = json.loads(out.read_text())
    lm = load_model(checkpoint, device="cpu")
    one = workload(Engine(lm.model, None, EngineConfig(block_size=4, kv_cache_memory=4 * 2**20)))
    assert tp["world"] == 2 and tp["kv_heads_here"] == 1  # each rank caches its own half of the 2 KV heads
    assert tp["greedy"] == one["greedy"] and tp["forks"] == one["forks"]
    for a, b in zip(tp["greedy_logprobs"], one["greedy_logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)
    assert tp["score"] == pytest.approx(one["score"], abs=1e-4)
    assert tp["computed"] == one["computed"]  # the same prefix reuse: rank 0 scheduled it all


def test_world_size_not_a_multiple_of_tp_is_refused():
    with pytest.raises(ValueError, match=r"^--tp 3 needs a number of processes that is a multiple of 3 .* this launch "
                                         r"has 4$"):
        Dist(rank=0, world_size=4).check_tp(3)
    Dist(rank=0, world_size=4).check_tp(2)  # 2 replicas of 2
    Dist(rank=0, world_size=4).check_tp(4)  # 1 replica of 4


def test_two_replicas_of_tp_2_share_the_questions(tiny):
    """torchrun with 4 processes and --tp 2: 2 replicas (ranks 0-1 and 2-3), each a TP-2 engine whose
    leader takes questions from the shared counter; one run folder, every question once, the same
    answers as one process."""
    ck, data, root = tiny
    out = root / "dp-tp"
    printed = finish(launch("torchrun", "run", "--model", str(ck), "--dataset", str(data), "--out", str(out),
                            "--tp", "2", *RUN, nproc=4))
    assert "2 processes" in printed  # the data-parallel workers: one per replica
    assert outcome(out) == outcome(root / "single")
    meta = json.loads((out / "run.json").read_text())
    assert meta["config"]["tp"] == 2 and [r["rank"] for r in meta["ranks"]] == [0, 1]
    assert sum(r["questions"] for r in meta["ranks"]) == N and all(r["questions"] > 0 for r in meta["ranks"])
