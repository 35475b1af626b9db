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

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.models.loader import load_model

from .conftest import make_model
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
