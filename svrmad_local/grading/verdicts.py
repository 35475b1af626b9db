"""Verdicts: `equivalent`, `is_correct`, their async forms, the verdict cache, the grader choice.

A pair is decided in the calling process when the cheap rules can (normalised strings, exact
numbers, structure over those: no sympy, microseconds); anything else goes to the grading worker
process (worker.py). Every verdict is cached by its normalised pair. The synchronous functions
block on the worker; from a coroutine, `await aequivalent(...)`/`ais_correct(...)`, or `await
settle(...)` a batch of answers beforehand, keep the event loop free while sympy runs (the sync
calls that follow are cache hits).

A worker request past its last budget (GradingTimeout) is logged, counted in `stats["undecided"]`
and answered False for that call only: it is not cached, so a later call decides it again.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from typing import Iterable

from svrmad_local.grading import mathverify, worker
from svrmad_local.grading.equivalence import CHEAP, NeedsSympy, decide
from svrmad_local.grading.normalize import MAX_CACHED_CHARS, normalize
from svrmad_local.grading.normalize import clear_cache as _forget_normalised

log = logging.getLogger(__name__)

__all__ = ["GRADERS", "equivalent", "is_correct", "aequivalent", "ais_correct", "settle", "grade", "grades",
           "set_grader", "get_grader", "clear_cache", "stats"]

GRADERS = ("ours", "math-verify", "both")
CACHE_SIZE = 1 << 17
stats: collections.Counter = collections.Counter()  # cheap / worker / undecided verdicts
_cache: dict[tuple[str, str, str], bool] = {}
_cache_lock = threading.Lock()
_grader = "ours"


# ----------------------------------------------------------------------------- grader choice


def set_grader(name: str) -> None:
    """The process-wide grader of `is_correct`: "ours" (default), "math-verify", or "both" (ours
    decides `correct`; `grades()` records both verdicts). Fails in one line when math-verify is
    needed and not installed."""
    global _grader
    if name not in GRADERS:
        raise ValueError(f"unknown grader {name!r}; known: {', '.join(GRADERS)}")
    if name != "ours":
        mathverify.require()
    _grader = name


def get_grader() -> str:
    return _grader


# ----------------------------------------------------------------------------- pairs and the cache


def _key(a: str | None, b: str | None, answer_type: str) -> bool | tuple[str, str, str]:
    """The verdict when normalisation alone decides it, else the worker request ("math", na, nb)."""
    if a is None or b is None:
        return False
    na, nb = normalize(a, answer_type), normalize(b, answer_type)
    if na is None or nb is None:
        return False
    if na == nb:
        return True
    if answer_type == "mc":
        return False
    return ("math", na, nb) if na < nb else ("math", nb, na)


def _mv_key(answer: str | None, gold: str, answer_type: str) -> bool | tuple[str, str, str]:
    if answer_type == "mc" or answer is None:  # letters: ours decides (math-verify is for math)
        return _key(answer, gold, answer_type)
    mathverify.require()
    return ("math-verify", str(answer), str(gold))


def _remember(key: tuple, verdict: bool) -> bool:
    if len(key[1]) + len(key[2]) > 2 * MAX_CACHED_CHARS:  # degenerate answers: decided, not kept
        return verdict
    with _cache_lock:
        if len(_cache) >= CACHE_SIZE:
            del _cache[next(iter(_cache))]
        _cache[key] = verdict
    return verdict


def _cheap(key: tuple) -> bool | None:
    got = _cache.get(key)
    if got is not None or key[0] != "math":
        return got
    try:
        verdict = decide(key[1], key[2], CHEAP)
    except NeedsSympy:
        return None
    stats["cheap"] += 1
    return _remember(key, verdict)


def _from_worker(key: tuple) -> bool:
    got = _cache.get(key)
    if got is not None:
        return got
    try:
        verdict = bool(worker.call(*key))
    except worker.GradingTimeout as exc:
        stats["undecided"] += 1
        log.warning("grading: %s; counted as not equivalent for this call, not cached", exc)
        return False
    stats["worker"] += 1
    return _remember(key, verdict)


def _decided(key: bool | tuple) -> bool:
    if isinstance(key, bool):
        return key
    verdict = _cheap(key)
    return verdict if verdict is not None else _from_worker(key)


async def _adecided(key: bool | tuple) -> bool:
    if isinstance(key, bool):
        return key
    verdict = _cheap(key)
    return verdict if verdict is not None else await asyncio.to_thread(_from_worker, key)


def clear_cache() -> None:
    """Forget every verdict and normalisation (tests; a long-lived process after a code change)."""
    with _cache_lock:
        _cache.clear()
    _forget_normalised()


# ----------------------------------------------------------------------------- the API


def equivalent(a: str | None, b: str | None, answer_type: str) -> bool:
    """Whether two answers are the same answer. None (no answer) equals nothing, not even None."""
    return _decided(_key(a, b, answer_type))


async def aequivalent(a: str | None, b: str | None, answer_type: str) -> bool:
    """`equivalent` for coroutines: sympy work runs off the event loop."""
    return await _adecided(_key(a, b, answer_type))


def grade(answer: str | None, gold: str, answer_type: str, grader: str | None = None) -> bool:
    """Whether `answer` is correct against `gold` under `grader` (default: the process-wide one;
    "both" grades with ours)."""
    if (grader or _grader) == "math-verify":
        return _decided(_mv_key(answer, gold, answer_type))
    return equivalent(answer, gold, answer_type)


def is_correct(answer: str | None, gold: str, answer_type: str) -> bool:
    """Grading against a gold answer (normalised the same way, so "1,234" golds are fine)."""
    return grade(answer, gold, answer_type)


async def ais_correct(answer: str | None, gold: str, answer_type: str) -> bool:
    if _grader == "math-verify":
        return await _adecided(_mv_key(answer, gold, answer_type))
    return await aequivalent(answer, gold, answer_type)


def grades(answer: str | None, gold: str, answer_type: str) -> dict[str, bool] | None:
    """Both graders' verdicts when the process-wide grader is "both", else None."""
    if _grader != "both":
        return None
    return {"ours": equivalent(answer, gold, answer_type),
            "math-verify": _decided(_mv_key(answer, gold, answer_type))}


async def settle(answers: Iterable[str | None], answer_type: str, *, against: Iterable[str | None] = (),
                 gold: str | None = None) -> None:
    """Decide, off the event loop, every pair a method may compare: the answers among themselves,
    each against `against`, and each against `gold` (under the grader(s) in use). The calls that
    follow find the verdicts cached."""
    answers = list(dict.fromkeys(a for a in answers if a is not None))
    against = [b for b in dict.fromkeys(against) if b is not None]
    keys = [_key(a, b, answer_type) for a, b in itertools.chain(
        itertools.combinations(answers, 2), itertools.product(answers, against))]
    if gold is not None:
        if _grader != "math-verify":
            keys += [_key(a, gold, answer_type) for a in answers]
        if _grader != "ours":
            keys += [_mv_key(a, gold, answer_type) for a in answers]
    pending = sorted({k for k in keys if not isinstance(k, bool) and _cheap(k) is None})
    if pending:
        await asyncio.to_thread(lambda: [_from_worker(k) for k in pending])
