"""How much memory the KV-cache may take, and keeping the CPU allocator from fighting us.

The budget is fixed before the first request (a pool of blocks), so it is decided once, here, from
what the user gave (bytes, a fraction of the memory available after loading, or "4GiB") or, by
default, from the machine: a share of its free memory, capped by what the engine can ever use.
"""

from __future__ import annotations

import os

import torch

from svrmad_local.sizes import parse_memory


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
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
# not: there the share is 0.9, as in vLLM). docs/engine.md, "KV-cache", has the reasoning.
CPU_SHARE = 0.5
GPU_SHARE = 0.9


def workload_cap(max_num_seqs: int, max_model_len: int, block_size: int, block_bytes: int) -> int:
    """The most KV the engine can ever hold referenced at once: `max_num_seqs` sequences of the model's
    whole context. A CPU default beyond it could only keep more unreferenced cache, so a small model
    does not reserve tens of GiB because the machine has them."""
    return max_num_seqs * -(-max_model_len // block_size) * block_bytes


def kv_budget(value: int | float | str | None, device: torch.device, cap: int | None = None) -> tuple[int, str]:
    """The KV budget in bytes, and one line saying how it was chosen (for `Engine.info`).

    Default: GPU_SHARE of the free GPU memory (as vLLM; the decode graphs' memory comes out of it,
    engine/build.py), or CPU_SHARE of the RAM available after loading, there no more than `cap`
    (`workload_cap`). An explicit value wins, cap or not. On the CPU a large pool costs nothing up
    front: `torch.empty` leaves its pages untouched, so resident memory grows only as blocks are first
    written (tests/test_kv_budget.py measures it)."""
    avail = available_memory(device)
    if value is not None:
        return parse_memory(value, avail, 0), f"kv_cache_memory={value!r}"
    where = "free GPU memory" if device.type == "cuda" else "RAM available after loading"
    share = GPU_SHARE if device.type == "cuda" else CPU_SHARE
    budget, why = int(share * avail), f"{share:g} of the {gib(avail)} {where}"
    if device.type != "cuda" and cap is not None and cap < budget:
        return cap, f"default: {gib(cap)}, what max_num_seqs x max_model_len can use (under {why}, {gib(budget)})"
    return budget, f"default: {gib(budget)}, {why}"


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
