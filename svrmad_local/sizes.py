"""Byte sizes as a person writes them ("2GiB", "500MB", 4096, or a fraction such as 0.9 of what is
available): one parser for the KV budget (engine), the GPUs of `svrmad plan` (models) and the
command line's checks (job/). It imports nothing, so every layer may use it.
"""

from __future__ import annotations

import re

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
