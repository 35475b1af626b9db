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
    assert eng.built.budget.bytes == 3 * (1024 // 16) * eng.built.budget.block_bytes
    assert eng.blocks.num_blocks == 3 * 64 and "max_num_seqs x max_model_len" in eng.info["kv_budget"]
    explicit = Engine(model, None, EngineConfig(block_size=16, max_num_seqs=3, kv_cache_memory=500 * eng.built.budget.block_bytes))
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


class FakeCuda:
    """Stands in for torch.cuda's allocator figures (memory.CUDA): what a profiled forward would show."""

    def __init__(self, free: dict, took: dict, outside: dict | None = None):
        self.free_now, self.took, self.outside = dict(free), took, outside or {}
        self.base = 123  # bytes allocated before the forward

    def attach(self, monkeypatch):
        for name in ("free", "allocated", "reserved", "peak_allocated", "reset_peak", "synchronize"):
            monkeypatch.setattr(memory.CUDA, name, getattr(self, name))

    def free(self, d):
        return self.free_now[torch.device(d)]

    def allocated(self, d):
        return self.base

    def reserved(self, d):
        return 0

    def peak_allocated(self, d):
        return self.base + self.took[torch.device(d)]

    def reset_peak(self, d):
        pass

    def synchronize(self, d):
        pass


def two_gpus(monkeypatch, model, free: dict, held: dict, split: int):
    """The engine built as if `model`'s first `split` layers sat on cuda:0 and the rest on cuda:1 (a device
    map): the GPUs' free memory and what the profiled forward takes there faked, their caches on the meta
    device (nothing to allocate on), the forward measured but not run (nothing to run it on)."""
    from svrmad_local.engine import build, kv_cache

    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    monkeypatch.setattr(build, "layer_device", lambda m, layers, i: gpus[i >= split])
    monkeypatch.setattr(memory, "available_memory", lambda d: free[d])
    monkeypatch.setattr(build, "available_memory", lambda d: free[d])
    ran = []
    monkeypatch.setattr(build, "measure", lambda devices, fn: ran.append(list(dict.fromkeys(devices))) or held)
    real_empty = torch.empty
    monkeypatch.setattr(kv_cache.torch, "empty",
                        lambda *a, device=None, **k: real_empty(*a, device="meta" if device in gpus else device, **k))
    monkeypatch.setattr(kv_cache.torch, "zeros",
                        lambda *a, device=None, **k: real_empty(*a, device="meta" if device in gpus else device, **k))
    eng = Engine(model, None, EngineConfig(block_size=16, max_num_seqs=4))
    return eng, gpus, ran


def test_a_device_maps_budget_covers_each_gpu_from_its_own_memory(monkeypatch):
    """Layers on two GPUs, the second with less free memory and more layers: each GPU's part of the pool
    fits 0.9 of its own free memory less what the profiled forward took there, the tightest one sets
    the pool, and the forward was measured on both. (Sized from the first GPU's memory and spent over
    every layer, the pool would overflow the second.)"""
    model = make_model("llama")  # 2 layers: the first on cuda:0, the second on cuda:1
    free = {torch.device("cuda", 0): 10 * GiB, torch.device("cuda", 1): 3 * GiB}
    held = {torch.device("cuda", 0): GiB, torch.device("cuda", 1): GiB // 2}
    eng, gpus, ran = two_gpus(monkeypatch, model, free, held, split=1)
    assert ran == [gpus]
    layer_block = eng.built.budget.block_bytes // 2  # both layers cache the same K/V shapes
    blocks = eng.blocks.num_blocks
    for d in gpus:
        budget = int(0.9 * free[d]) - held[d]
        on_d = eng.built.cache.k[d.index].numel() * eng.built.cache.k[d.index].element_size() * 2
        assert on_d == blocks * layer_block <= budget
        assert eng.info["kv_devices"][str(d)] == {"kv_bytes": on_d, "budget": budget}
    assert blocks == (int(0.9 * 3 * GiB) - GiB // 2) // layer_block  # the second GPU is the tight one
    assert "cuda:1: default: 2.20 GiB, 0.9 of the 3.00 GiB free GPU memory, less 0.50 GiB the profiled " \
        "forward took" in eng.info["kv_budget"], eng.info["kv_budget"]


def test_an_explicit_byte_budget_is_the_whole_pool_over_every_device(monkeypatch):
    model = make_model("llama")
    free = {torch.device("cuda", 0): 10 * GiB, torch.device("cuda", 1): 3 * GiB}
    monkeypatch.setattr(memory, "available_memory", lambda d: free[d])
    pool = memory.kv_pool("1GiB", [torch.device("cuda", 0), torch.device("cuda", 1)], [100, 300])
    assert pool.blocks() == GiB // 400 and pool.bytes == GiB and pool.rule == "kv_cache_memory='1GiB'"
    half = memory.kv_pool(0.5, [torch.device("cuda", 0), torch.device("cuda", 1)], [100, 300],
                          held={torch.device("cuda", 1): GiB})
    assert half.blocks() == min(5 * GiB // 100, (GiB + GiB // 2 - GiB) // 300)  # a fraction: of each GPU's own
    del model


def test_the_budget_is_sized_after_a_forward_at_the_largest_prefill_chunk(monkeypatch):
    """Where the device can be measured (a GPU; faked here on the CPU), the engine runs one forward at
    max_num_batched_tokens over a provisional cache before sizing the pool, MLA's absorbed weights made
    inside it and, with latent layers, after a cached context of one expansion chunk; the pool gets the
    share of the memory free before any of it, less what that forward took."""
    from svrmad_local.engine import build as build_mod
    from svrmad_local.engine import mla

    from .model_zoo import make_zoo_model

    cpu = torch.device("cpu")
    fake = FakeCuda({cpu: 10 * GiB}, {cpu: GiB})
    fake.attach(monkeypatch)
    monkeypatch.setattr(memory, "measurable", lambda d: True)
    monkeypatch.setattr(build_mod, "measurable", lambda d: True)
    monkeypatch.setattr(build_mod, "available_memory", lambda d: 10 * GiB)
    monkeypatch.setattr(memory, "available_memory", lambda d: 10 * GiB)
    monkeypatch.setattr(mla, "PREFILL_CHUNK_BYTES", 1)  # one block a chunk
    steps, made = [], []
    real_profile, real_prepare = build_mod.profile_forward, mla.prepare
    monkeypatch.setattr(mla, "prepare", lambda model: made.append(len(steps)) or real_prepare(model))

    def spy(runner, model, tokens, context):
        real = runner.execute
        runner.execute = lambda step: steps.append(step) or real(step)
        try:
            return real_profile(runner, model, tokens, context)
        finally:
            runner.execute = real

    monkeypatch.setattr(build_mod, "profile_forward", spy)
    model = make_zoo_model("deepseek-v3")
    eng = Engine(model, None, EngineConfig(block_size=4, max_num_batched_tokens=48, kv_cache_memory=0.5))
    (step,) = steps
    assert made == [0]  # the absorbed weights, before the forward: inside the measured window
    assert len(step.ids) == 48 and step.runs[0][:2] == (4, 52)  # after one cached chunk (a block of 4)
    assert eng.info["kv_held"] == {"cpu": GiB}
    assert eng.built.budget.bytes == int(0.5 * 10 * GiB) - GiB  # the fraction of the free memory, less it
    assert eng.blocks.num_blocks == eng.built.budget.bytes // eng.built.budget.block_bytes
