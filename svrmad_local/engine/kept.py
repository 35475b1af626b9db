"""Timings kept per machine: what a build timed once, read back by every later build on that machine.

Why keep them: a choice made from timings of candidates that run close can go either way from one build
to the next, and the candidates' outputs differ in the last bits (fp32 sums in another order). Kept under
a key of everything the figures depend on (the device, the software, the shapes, the kernels' source),
every later engine on that machine makes the same choice, so its log-probs are the same bits from run to
run, and it times nothing it need not. Figures: {shape: {rows: {"torch": s, candidate: s}}}, seconds a
call, the torch candidate always among them. engine/gemv.py (the few-row linears) and engine/sampler.py
(a step's sampling) keep theirs here, each in its own file under `--cache-dir`/calibration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Callable

from svrmad_local.models.default import cache_dir

log = logging.getLogger("svrmad_local")


def source_digest(*files: Path) -> str:
    """What a key holds of the timed kernels' source files: an edited kernel is timed again."""
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def cache_path(what: str, k: dict, cache: str | Path | None = None) -> Path:
    """`what`-<digest of the key>.json under the cache's calibration folder."""
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(cache) / "calibration" / f"{what}-{digest}.json"


def read(path: Path, k: dict, what: str) -> dict | None:
    """The kept figures for key `k`, or None (absent, another key, or unreadable: said in one line)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") != k:
            return None
        figures = data["figures"]
        if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 and "torch" in times
                   for per_rows in figures.values() for times in per_rows.values() for t in times.values()):
            raise ValueError("a figure is not a finite positive number of seconds")
        return figures
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("svrmad: ignoring the unreadable %s timings %s (%s: %s); timing again", what, path,
                    type(e).__name__, e)
        return None


def write(path: Path, k: dict, figures: dict, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": k, "figures": figures}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("svrmad: could not keep the %s timings in %s (%s); the next engine times again", what, path, e)


def measured(what: str, k: dict, cache: str | Path | None, time: Callable[[], dict]) -> tuple[dict, bool]:
    """(figures, whether they were kept from an earlier engine): the kept ones for key `k`, else `time()`'s,
    kept under `cache` for the next engine."""
    path = cache_path(what, k, cache)
    figures = read(path, k, what)
    if figures is not None:
        return figures, True
    figures = time()
    write(path, k, figures, what)
    return figures, False
