"""How much memory the KV-cache may take, and keeping the CPU allocator from fighting us.

The budget is fixed before the first request (a pool of blocks), so it is decided once, here, from
what the user gave: bytes, a fraction of the memory available after loading, or "4GiB".
"""

from __future__ import annotations

import os
import re

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: int | float | str | None, available: int, default: int) -> int:
    """Bytes from an int, a fraction in (0, 1] of `available`, or a string: "0.9" (a fraction),
    "4096" (bytes), "2GiB", "500MB". Anything else is a ValueError naming the value."""
    if value is None:
        return default
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([kmg]i?b|b)?\s*", value.lower())
        if not m:
            raise ValueError(f"kv_cache_memory {value!r}: expected bytes, a fraction in (0, 1] or e.g. '2GiB'")
        number, unit = m.group(1), m.group(2)
        if unit:
            value = float(number) * _UNITS[unit]
            if value < 1:
                raise ValueError(f"kv_cache_memory {m.group(0).strip()!r} is less than one byte")
            return int(value)
        value = float(number) if "." in number else int(number)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"kv_cache_memory {value!r}: expected bytes, a fraction in (0, 1] or e.g. '2GiB'")
    if isinstance(value, float):
        if 0 < value <= 1:
            return int(value * available)
        if value != int(value):
            raise ValueError(f"kv_cache_memory {value}: a fraction must be in (0, 1]; bytes must be whole")
        value = int(value)
    if value <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value}")
    return value


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
