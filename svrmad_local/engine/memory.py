"""How much memory the KV-cache may take on each device, and keeping the CPU allocator from fighting us.

The budget is fixed before the first request (a pool of blocks), so it is decided once, here, from
what the user gave (bytes, a fraction of the memory available after loading, or "4GiB") or, by
default, from the machine: a share of its free memory, capped by what the engine can ever use.

Every layer's KV lives on that layer's device, so under a device map the pool is sized per device:
each GPU gives the pool `share` of its own free memory, less what a profiled forward took there
(`measure`), and the pool holds as many blocks as the tightest device can take of its own layers'
part of a block (`kv_pool`). `svrmad plan` counts with the same rule (`models.plan.kv_room`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from svrmad_local.models.plan import GPU_SHARE, kv_room
from svrmad_local.sizes import parse_memory


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return CUDA.free(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# The CPU default's share of the RAM available after loading: the other half is the headroom for
# activations, the OS, this process's other buffers and other programs (RAM is shared, GPU memory is
# not: there the share is GPU_SHARE, 0.9, as in vLLM). docs/engine.md, "KV-cache", has the reasoning.
CPU_SHARE = 0.5


def workload_cap(max_num_seqs: int, max_model_len: int, block_size: int, block_bytes: int) -> int:
    """The most KV the engine can ever hold referenced at once: `max_num_seqs` sequences of the model's
    whole context. A CPU default beyond it could only keep more unreferenced cache, so a small model
    does not reserve tens of GiB because the machine has them."""
    return max_num_seqs * -(-max_model_len // block_size) * block_bytes


def fraction(value) -> float | None:
    """The share of the available memory `value` names (0.9, "0.9"), or None where it names bytes."""
    big = 2**52
    n = parse_memory(value, big, 0)
    return n / big if parse_memory(value, big // 2, 0) != n else None


def kv_budget(value: int | float | str | None, device: torch.device, cap: int | None = None,
              held: int = 0, avail: int | None = None) -> tuple[int, str]:
    """One device's KV budget in bytes, and one line saying how it was chosen (for `Engine.info`).

    Default: GPU_SHARE of the free GPU memory less `held` (what the profiled forward took there:
    activations at the largest prefill chunk, NCCL buffers, the absorbed MLA weights; the decode graphs'
    memory comes out of the rest, engine/build.py), or CPU_SHARE of the RAM available after loading,
    there no more than `cap` (`workload_cap`). A fraction is that share of this device's memory, less
    `held` alike; bytes win, cap or not. On the CPU a large pool costs nothing up front: `torch.empty`
    leaves its pages untouched, so resident memory grows only as blocks are first written
    (tests/test_kv_budget.py measures it). `avail`: the memory available, as read before the engine
    allocated anything (read now when not given)."""
    avail = available_memory(device) if avail is None else avail
    if value is not None:
        share = fraction(value)
        if share is None:
            return parse_memory(value, avail, 0), f"kv_cache_memory={value!r}"
        return kv_room(avail, held, share), f"kv_cache_memory={value!r}" + _less(held)
    where = "free GPU memory" if device.type == "cuda" else "RAM available after loading"
    share = GPU_SHARE if device.type == "cuda" else CPU_SHARE
    budget, why = kv_room(avail, held, share), f"{share:g} of the {gib(avail)} {where}" + _less(held)
    if device.type != "cuda" and cap is not None and cap < budget:
        return cap, f"default: {gib(cap)}, what max_num_seqs x max_model_len can use (under {why}, {gib(budget)})"
    return budget, f"default: {gib(budget)}, {why}"


def _less(held: int) -> str:
    return f", less {gib(held)} the profiled forward took" if held else ""


@dataclass(frozen=True)
class Pool:
    """The KV pool over the devices its layers sit on: the bytes one block takes on each device (its
    layers' part), what the pool may take there, and how many blocks that makes."""

    block_bytes: dict  # device -> bytes of one block of its layers
    budgets: dict  # device -> bytes the pool may take there
    rule: str
    explicit: int | None = None  # kv_cache_memory in bytes: the whole pool, over every device

    @property
    def bytes(self) -> int:
        return self.explicit if self.explicit is not None else sum(self.budgets.values())

    def blocks(self, less: dict | None = None) -> int:
        """Blocks the pool holds with `less` (device -> bytes, e.g. the decode graphs') taken off each
        device's budget first: as many as the tightest device takes."""
        less = less or {}
        if self.explicit is not None:
            return max(0, self.explicit - sum(less.values())) // sum(self.block_bytes.values())
        return min(max(0, self.budgets[d] - less.get(d, 0)) // b for d, b in self.block_bytes.items())

    def per_device(self, num_blocks: int) -> dict[str, dict]:
        """What the pool takes and was allowed on each device (Engine.info["kv_devices"])."""
        return {str(d): {"kv_bytes": num_blocks * b, "budget": self.budgets[d]} for d, b in self.block_bytes.items()}


def block_bytes_by_device(layer_devices: list[torch.device], layer_bytes: list[int]) -> dict:
    """Bytes one block takes on each device: the sum over the layers that live there."""
    out: dict = {}
    for d, b in zip(layer_devices, layer_bytes):
        out[d] = out.get(d, 0) + b
    return out


def kv_pool(value, layer_devices: list[torch.device], layer_bytes: list[int], cap: int | None = None,
            held: dict | None = None, free: dict | None = None) -> Pool:
    """The pool for layers on `layer_devices`, layer i taking `layer_bytes[i]` of every block: each device
    budgets from its own memory (`kv_budget`, less its `held`), and the pool holds what the tightest
    device can take of its own layers. Bytes given explicitly are the whole pool, over every device.
    `free`: each device's available memory as read before the engine allocated anything there."""
    per = block_bytes_by_device(layer_devices, layer_bytes)
    held, free = held or {}, free or {}
    if value is not None and fraction(value) is None:
        total, rule = kv_budget(value, next(iter(per)), cap, avail=free.get(next(iter(per))))
        whole = sum(per.values())
        return Pool(per, {d: total * b // whole for d, b in per.items()}, rule, explicit=total)
    budgets, rules = {}, []
    for d in per:
        # a CPU device's cap is its share of the workload's need (the whole cap when all layers are there)
        share_cap = None if cap is None else cap * per[d] // sum(per.values())
        budgets[d], why = kv_budget(value, d, share_cap, held.get(d, 0), free.get(d))
        rules.append(why if len(per) == 1 else f"{d}: {why}")
    return Pool(per, budgets, "; ".join(rules))


class CUDA:
    """The CUDA allocator's figures `measure` reads (tests put a stand-in in its place: no GPU here)."""

    free = staticmethod(lambda d: torch.cuda.mem_get_info(d)[0])
    allocated = staticmethod(torch.cuda.memory_allocated)
    reserved = staticmethod(torch.cuda.memory_reserved)
    peak_allocated = staticmethod(torch.cuda.max_memory_allocated)
    reset_peak = staticmethod(torch.cuda.reset_peak_memory_stats)
    synchronize = staticmethod(torch.cuda.synchronize)


def empty_cache(devices) -> None:
    """Hands the memory torch's allocator keeps but no tensor uses back to the GPUs (the provisional
    cache's, the profiled forward's), before the real pool is allocated."""
    if any(measurable(d) for d in devices):
        torch.cuda.empty_cache()


def measurable(device: torch.device) -> bool:
    """Whether `measure` can see what a forward takes on `device` (a CUDA allocator's statistics)."""
    return device.type == "cuda"


def measure(devices, fn) -> dict:
    """Runs `fn` and returns, for each CUDA device of `devices`, the bytes it took there at its peak and
    kept outside torch: the allocator's peak above what it held before (activations, the tensors made
    and kept, such as the absorbed MLA weights), plus the free memory that went neither to torch's
    allocator (NCCL's buffers, cuBLAS workspaces, compiled kernels' modules). vLLM sizes its KV the same
    way, after one forward at the largest batch."""
    devs = [d for d in dict.fromkeys(devices) if measurable(d)]
    before = {}
    for d in devs:
        CUDA.synchronize(d)
        CUDA.reset_peak(d)
        before[d] = (CUDA.allocated(d), CUDA.reserved(d), CUDA.free(d))
    fn()
    held = {}
    for d in devs:
        CUDA.synchronize(d)
        allocated, reserved, free = before[d]
        outside = (free - CUDA.free(d)) - (CUDA.reserved(d) - reserved)
        held[d] = max(0, CUDA.peak_allocated(d) - allocated) + max(0, outside)
    return held


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and page-faults them back on the next step; on a
    CPU that costs more than the attention itself. Keep them in the heap (Linux/glibc only)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no mmap-backed allocations
        libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of free heap
    except (OSError, AttributeError):
        pass
