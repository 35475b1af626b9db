"""The KV budget's default comes from the machine (a share of free memory, capped by what the engine can
ever hold), an explicit value wins, and a large pool on the CPU costs no resident memory until used."""

import subprocess
import sys

import pytest
import torch

from svrmad_local.engine import memory
from svrmad_local.engine.config import EngineConfig
from svrmad_local.engine.engine import Engine
from svrmad_local.engine.memory import kv_budget, workload_cap
from tests.conftest import make_model

GiB = 2**30
CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def free_10gib(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 10 * GiB)


def test_the_default_is_a_share_of_the_free_memory(free_10gib):
    budget, why = kv_budget(None, CPU)
    assert budget == 5 * GiB, why  # half the RAM: the rest is headroom (docs/engine.md)
    assert why == "default: 5.00 GiB, 0.5 of the 10.00 GiB RAM available after loading"
    assert kv_budget(None, GPU)[0] == 9 * GiB


def test_the_default_is_capped_by_what_the_engine_can_hold(free_10gib):
    cap = workload_cap(max_num_seqs=4, max_model_len=1000, block_size=16, block_bytes=1024)
    assert cap == 4 * 63 * 1024  # 1000 tokens round up to 63 blocks
    budget, why = kv_budget(None, CPU, cap)
    assert budget == cap and "max_num_seqs x max_model_len" in why, why
    assert kv_budget(None, CPU, 6 * GiB)[0] == 5 * GiB  # a cap above the share changes nothing
    assert kv_budget(None, GPU, cap)[0] == 9 * GiB  # a GPU's memory is the engine's: 0.9, uncapped


@pytest.mark.parametrize("value, expected", [("2GiB", 2 * GiB), (0.25, GiB * 10 // 4), (12345, 12345)])
def test_an_explicit_value_wins_over_share_and_cap(free_10gib, value, expected):
    budget, why = kv_budget(value, CPU, cap=1024)
    assert budget == expected and why == f"kv_cache_memory={value!r}"


def test_the_engine_sizes_its_pool_from_the_machine(free_10gib):
    model = make_model("llama")  # 1,024 positions
    eng = Engine(model, None, EngineConfig(block_size=16, max_num_seqs=3))
    assert eng.kv_budget_bytes == 3 * (1024 // 16) * eng.block_bytes
    assert eng.blocks.num_blocks == 3 * 64 and "max_num_seqs x max_model_len" in eng.info["kv_budget"]
    explicit = Engine(model, None, EngineConfig(block_size=16, max_num_seqs=3, kv_cache_memory=500 * eng.block_bytes))
    assert explicit.blocks.num_blocks == 500 and explicit.info["kv_budget"].startswith("kv_cache_memory=")


RSS_PROBE = """
import torch
from svrmad_local.engine.kv_cache import KVCache
from svrmad_local.engine.memory import keep_freed_memory


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


keep_freed_memory()  # as the engine does on the CPU before it allocates the pool
before = rss()
cache = KVCache(2**14, 16, [type("S", (), {"k_shape": (4, 64), "v_shape": (4, 64)})()] * 8,
                [torch.device("cpu")] * 8, torch.float32)
pool = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
mid = rss()
cache.k[0][: 16 * 100] = 1.0  # 100 blocks of one layer written: only their pages become resident
after = rss()
print(pool, mid - before, after - mid, 16 * 100 * 4 * 64 * 4)
"""


def test_a_large_cpu_pool_is_not_resident_until_written():
    """4 GiB of pool must not touch its pages (no zero fill): resident memory grows by what is written."""
    out = subprocess.run([sys.executable, "-c", RSS_PROBE], capture_output=True, text=True, check=True).stdout
    pool, allocated, written, written_bytes = map(int, out.split())
    assert pool == 4 * GiB
    assert allocated < 64 * 2**20, f"allocating the pool made {allocated} bytes resident"
    assert written_bytes <= written < written_bytes + 16 * 2**20, (written, written_bytes)
