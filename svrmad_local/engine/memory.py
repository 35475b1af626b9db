"""How much memory the KV-cache may take, and keeping the CPU allocator from fighting us.

The budget is fixed before the first request (a pool of blocks), so it is decided once, here, from
what the user gave: bytes, a fraction of the memory available after loading, or "4GiB".
"""

from __future__ import annotations

import os

import torch

from svrmad_local.sizes import parse_memory  # noqa: F401  (parse_memory: importable here too)


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


def kv_budget(value: int | float | str | None, device: torch.device) -> int:
    """The KV budget in bytes. Default: 90% of free GPU memory, or min(2 GiB, half the free RAM)."""
    avail = available_memory(device)
    default = int(0.9 * avail) if device.type == "cuda" else min(2 * 2**30, avail // 2)
    return parse_memory(value, avail, default)


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
