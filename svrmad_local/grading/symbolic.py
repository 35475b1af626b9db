"""Whether two sympy expressions are equal, decided the same way whatever the machine's load.

No step here is cut short by a clock. Each step's work is bounded before it starts, from the
expressions themselves, and a step whose bound is exceeded is skipped (its verdict is "not
proven"), so the same pair always takes the same path to the same verdict:

1. `x == y`, `x - y == 0`; a difference holding infinities, or an exact number, decides.
2. Constant difference: 50-digit evaluation (|d| <= 1e-30 * |x|, and <= 1e-12).
3. Difference with symbols: evaluated exactly, or to 40 digits, at pseudo-random rational points
   drawn from a seed made of the pair's text. A clear nonzero value at any point: not equal.
   POINTS agreeing points prove the identity when the difference is analytic (no |.|, floor,
   ceiling, sign, min/max, mod, piecewise): an analytic function vanishing on that many random
   points of an open set is zero; (x+y+z+w)^60 (x-y) against its distributed form takes
   milliseconds this way where `expand` takes a minute.
4. Otherwise (a non-analytic difference, or too few points where both sides are defined):
   `expand` when the expansion has at most MAX_EXPAND_TERMS terms (bounded from the expression
   tree without expanding), then `simplify` when the difference has at most MAX_SIMPLIFY_OPS
   operations. Not proven by either: not equal.

The grading worker process runs this (grading/worker.py); its wall-clock budget is a safety net
for a bound that proves too loose, and an expiry is an error, never a verdict.
"""

from __future__ import annotations

import math
import random

import sympy

__all__ = ["expressions_equal"]

POINTS = 6
MAX_TRIES = 12
MAX_EXPAND_TERMS = 5000
MAX_SIMPLIFY_OPS = 60
_NON_ANALYTIC = (sympy.Abs, sympy.floor, sympy.ceiling, sympy.sign, sympy.Min, sympy.Max, sympy.Mod,
                 sympy.Piecewise, sympy.re, sympy.im, sympy.arg, sympy.frac)
_INFINITE = (sympy.oo, -sympy.oo, sympy.zoo, sympy.nan)
_TINY_CONSTANT = sympy.Float("1e-30")
_TINY_POINT = sympy.Float("1e-25")


def expressions_equal(x, y, seed: str) -> bool:
    """x == y as mathematical expressions; `seed` (the pair's text) fixes the random points."""
    if x == y:
        return True
    d = x - y
    if d == 0:
        return True
    if d.has(*_INFINITE) or d.is_Number:  # exact arithmetic already decided it
        return False
    if not d.free_symbols:
        return _constant_is_zero(d, x)
    at_points = _zero_at_points(d, x, y, seed)
    if at_points is False:
        return False
    if at_points and not d.has(*_NON_ANALYTIC):
        return True
    return _proved_zero(d)


def _small(value, scale, tiny) -> bool:
    """|value| <= tiny * max(1, |scale|), for sympy numbers of any magnitude (no float overflow)."""
    try:
        return bool(sympy.Abs(value) <= tiny * sympy.Max(1, sympy.Abs(scale)))
    except TypeError:  # nan, or not a number after all
        return False


def _constant_is_zero(d, x) -> bool:
    value = d.evalf(50, chop=True)
    if value == 0:
        return True
    if not value.is_number:
        return False
    return _small(value, x.evalf(20), _TINY_CONSTANT) and _small(value, 0, sympy.Float("1e-12"))


def _zero_at_points(d, x, y, seed: str) -> bool | None:
    """False: d is clearly nonzero at a point. True: zero at POINTS points. None: too few points
    where d could be evaluated."""
    rng = random.Random(seed)
    symbols = sorted(d.free_symbols, key=str)
    agreed = 0
    for _ in range(MAX_TRIES):
        point = {s: sympy.Rational(rng.choice((-1, 1)) * rng.randint(1, 97), rng.randint(7, 29))
                 for s in symbols}
        try:
            v = d.xreplace(point)
            if v.is_Rational:
                zero = v == 0
            else:
                value = v.evalf(40)
                if not value.is_number or value.has(*_INFINITE):
                    continue
                scale = sympy.Max(sympy.Abs(x.xreplace(point).evalf(20)), sympy.Abs(y.xreplace(point).evalf(20)))
                if scale.has(*_INFINITE) or not scale.is_number:
                    continue
                zero = _small(value, scale, _TINY_POINT)
        except (TypeError, ValueError, ArithmeticError, AttributeError, RecursionError):
            continue
        if not zero:
            return False
        agreed += 1
        if agreed >= POINTS:
            return True
    return None


def _proved_zero(d) -> bool:
    if _expansion_terms(d) <= MAX_EXPAND_TERMS and sympy.expand(d) == 0:
        return True
    return sympy.count_ops(d) <= MAX_SIMPLIFY_OPS and sympy.simplify(d) == 0


def _expansion_terms(e) -> int:
    """An upper bound on the terms `expand` makes anywhere in e (capped at MAX_EXPAND_TERMS + 1)."""
    cap = MAX_EXPAND_TERMS + 1

    def terms(node) -> int:
        if node.is_Add:
            return min(cap, sum(terms(a) for a in node.args))
        if node.is_Mul:
            out = 1
            for a in node.args:
                out = min(cap, out * terms(a))
            return out
        if node.is_Pow and node.exp.is_Integer:
            n, t = abs(int(node.exp)), terms(node.base)
            if t <= 1:
                return 1
            return cap if n > cap else min(cap, math.comb(t + n - 1, n))  # monomials of degree n in t terms
        return 1

    return max((terms(node) for node in sympy.preorder_traversal(e)), default=1)
