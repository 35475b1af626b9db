"""Whether two normalised math answers are the same answer: structure first, then the pieces.

The structure (unions, sets, tuples and intervals, relations, matrices) is taken apart here, and
its atoms are compared by one of two comparators that share this single decision procedure:

- `CHEAP` runs in the calling process: equal strings and exact numbers; any atom or equation it
  cannot decide raises `NeedsSympy`, and the whole pair goes to the grading worker.
- `FULL` runs in the worker: the same cheap rules first, then sympy (`symbolic.py`).

Because the cheap rules are the first rules of the full comparator and the procedure is the same,
a pair the cheap path decides gets the verdict the worker would give it.
"""

from __future__ import annotations

import re

from svrmad_local.grading.normalize import exact_number
from svrmad_local.grading.text import balanced, split_top

__all__ = ["NeedsSympy", "CHEAP", "FULL", "decide"]

_RELATIONS = (r"\leq", r"\geq", r"\neq", "<=", ">=", "!=", "<", ">", "=")
_RELATION = re.compile("(%s)" % "|".join(re.escape(r) + (r"(?![A-Za-z])" if r[0] == "\\" else "")
                                         for r in _RELATIONS))
_VARIABLE = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?$")
_MATRIX = re.compile(r"\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", re.S)


class NeedsSympy(Exception):
    """The cheap rules cannot decide this pair."""


class Cheap:
    """Atoms are equal when they are the same string or the same exact number."""

    def atoms(self, a: str, b: str) -> bool:
        if a == b:
            return True
        fa, fb = exact_number(a), exact_number(b)
        if fa is not None and fb is not None:
            return fa == fb
        raise NeedsSympy

    def equation(self, l1: str, r1: str, l2: str, r2: str) -> bool:
        raise NeedsSympy


class Full(Cheap):
    """Cheap first, then sympy: expressions and the same equation rearranged."""

    def atoms(self, a: str, b: str) -> bool:
        try:
            return super().atoms(a, b)
        except NeedsSympy:
            pass
        from svrmad_local.grading.latex import to_sympy
        from svrmad_local.grading.symbolic import expressions_equal

        ea, eb = to_sympy(a), to_sympy(b)
        return ea is not None and eb is not None and expressions_equal(ea, eb, seed=f"{a}\x00{b}")

    def equation(self, l1: str, r1: str, l2: str, r2: str) -> bool:
        from svrmad_local.grading.latex import to_sympy
        from svrmad_local.grading.symbolic import expressions_equal

        ex = [to_sympy(s) for s in (l1, r1, l2, r2)]
        if None in ex:
            return False
        d1, d2 = ex[0] - ex[1], ex[2] - ex[3]  # l1 - r1 = +-(l2 - r2)
        seed = f"{l1}={r1}\x00{l2}={r2}"
        return expressions_equal(d1, d2, seed=seed) or expressions_equal(d1, -d2, seed=seed)


CHEAP, FULL = Cheap(), Full()


def decide(na: str, nb: str, comparator: Cheap) -> bool:
    """Whether normalised answers na and nb are the same answer (may raise NeedsSympy with CHEAP)."""
    return _same(structure(na), structure(nb), comparator)


def structure(s: str):
    """("union", parts) | ("set", items) | ("seq", open, close, items) | ("rel", ops, sides)
    | ("matrix", rows) | ("atom", s)."""
    parts = split_top(s, (r"\cup",))
    if len(parts) > 1:
        return ("union", [structure(p) for p in parts])
    m = _MATRIX.fullmatch(s)
    if m:
        return ("matrix", [[("atom", c) for c in row.split("&")] for row in m.group(1).split("\\\\")])
    if s.startswith(r"\{") and s.endswith(r"\}") and balanced(s[2:-2]):
        return ("set", [structure(x) for x in split_top(s[2:-2])])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and balanced(s[1:-1]):
        items = split_top(s[1:-1])
        if len(items) > 1:
            return ("seq", s[0], s[-1], [structure(x) for x in items])
    items = split_top(s)
    if len(items) > 1:
        return ("set", [structure(x) for x in items])
    pieces = _RELATION.split(s)
    if len(pieces) > 1 and all(balanced(p) for p in pieces[0::2]):
        canon = {"<=": r"\leq", ">=": r"\geq", "!=": r"\neq"}
        return _relation([canon.get(op, op) for op in pieces[1::2]], pieces[0::2])
    return ("atom", s)


def _relation(ops: list[str], sides: list[str]):
    """Single-variable inequalities become intervals so that x \\geq 2 matches [2, \\infty)."""
    flip = {"<": ">", ">": "<", r"\leq": r"\geq", r"\geq": r"\leq"}
    if all(op in (">", r"\geq") for op in ops):
        ops, sides = [flip[o] for o in reversed(ops)], list(reversed(sides))
    if all(op in ("<", r"\leq") for op in ops):
        if len(sides) == 3 and _VARIABLE.match(sides[1]) and not _VARIABLE.match(sides[0]):
            return ("seq", "(" if ops[0] == "<" else "[", ")" if ops[1] == "<" else "]",
                    [("atom", sides[0]), ("atom", sides[2])])
        if len(sides) == 2 and _VARIABLE.match(sides[0]) and not _VARIABLE.match(sides[1]):
            return ("seq", "(", ")" if ops[0] == "<" else "]", [("atom", r"-\infty"), ("atom", sides[1])])
        if len(sides) == 2 and _VARIABLE.match(sides[1]) and not _VARIABLE.match(sides[0]):
            return ("seq", "(" if ops[0] == "<" else "[", ")", [("atom", sides[0]), ("atom", r"\infty")])
    return ("rel", ops, [("atom", x) for x in sides])


def _same(x, y, c: Cheap) -> bool:
    kx, ky = x[0], y[0]
    if kx == "set" and len(x[1]) == 1:
        return _same(x[1][0], y, c)
    if ky == "set" and len(y[1]) == 1:
        return _same(x, y[1][0], c)
    if kx == "atom" and ky == "atom":
        return c.atoms(x[1], y[1])
    if kx in ("set", "union") and ky == kx:
        return _matching(x[1], y[1], c)
    if kx == "seq" and ky == "seq":
        return x[1:3] == y[1:3] and len(x[3]) == len(y[3]) and all(_same(a, b, c) for a, b in zip(x[3], y[3]))
    if kx == "matrix" and ky == "matrix":
        return [len(r) for r in x[1]] == [len(r) for r in y[1]] and all(
            _same(a, b, c) for ra, rb in zip(x[1], y[1]) for a, b in zip(ra, rb))
    if {kx, ky} == {"seq", "set"}:  # (3,2,5) answered as a bare list (whose order is not kept)
        seq, flat = (x, y) if kx == "seq" else (y, x)
        return seq[1:3] == ("(", ")") and _matching(seq[3], flat[1], c)
    if kx == "rel" and ky == "rel":
        if x[1] == y[1] and len(x[2]) == len(y[2]) and all(_same(a, b, c) for a, b in zip(x[2], y[2])):
            return True
        if x[1] == y[1] == ["="]:  # the same equation rearranged
            return c.equation(x[2][0][1], x[2][1][1], y[2][0][1], y[2][1][1])
    return False


def _matching(xs: list, ys: list, c: Cheap) -> bool:
    if len(xs) != len(ys):
        return False
    free = list(ys)
    for x in xs:
        for j, y in enumerate(free):
            if _same(x, y, c):
                del free[j]
                break
        else:
            return False
    return True
