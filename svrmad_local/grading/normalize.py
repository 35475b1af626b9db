"""A canonical string for an answer: equal strings are equivalent answers (the converse needs
`equivalent`), so it also serves as a vote key. The rules, in order, are in docs/grading.md.

Every step is one pass over the answer (an extracted answer can be 200k digits long), and numbers
are handled as strings or `Decimal`s: nothing converts a long digit string with int(), whose
4,300-digit limit would make a long number unequal even to itself.
"""

from __future__ import annotations

import functools
import logging
import re
from decimal import Decimal
from fractions import Fraction

from svrmad_local.grading.text import balanced, split_top, unwrap

log = logging.getLogger(__name__)

__all__ = ["normalize", "exact_number"]

_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00d7": r"\times ", "\u00b7": r"\cdot ", "\u221a": r"\sqrt",
    "\u03c0": r"\pi ", "\u221e": r"\infty ", "\u2264": r"\leq ", "\u2265": r"\geq ", "\u2260": r"\neq ",
    "\u222a": r"\cup ", "\u2026": "...", "\u00b0": r"^\circ", "\u00a0": " ",
}
_TEXT_CMDS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mathsf",
              "operatorname", "mbox", "hbox", "boxed", "fbox")
MATH_WORDS = {"sqrt", "frac", "pi", "sin", "cos", "tan", "sec", "csc", "cot", "log", "ln", "exp",
              "infty", "inf", "cdot", "times", "floor", "ceil", "binom", "min", "max", "gcd", "lcm",
              "mod", "sinh", "cosh", "tanh", "arcsin", "arccos", "arctan"}
_STOP_WORDS = {"if", "or", "and", "for", "when", "where", "is", "are", "otherwise", "with", "such",
               "all", "of", "not", "no", "but", "then", "that", "which"}
_SIMPLE_LHS = re.compile(r"^(?:[A-Za-z](?:_\{?\w+\}?)?|[A-Za-z]\w*\([A-Za-z,]*\)|\\[A-Za-z]+)$")
_ROW_BREAK = "\x00"  # `\\` (a matrix row break) while the other rules run: no rule may split it
_MAX_EXACT_CHARS = 4000  # Decimal -> int is quadratic: longer numbers compare as canonical strings


def normalize(answer: str | None, answer_type: str) -> str | None:
    """A canonical string for an answer (equal strings are equivalent answers; the converse needs
    `equivalent`). Usable as a grouping key for votes. None when nothing is left."""
    if answer is not None and len(answer) > MAX_CACHED_CHARS:  # a looping model's "answer": not kept
        return _normalize(answer, answer_type)
    return _cached(answer, answer_type)


MAX_CACHED_CHARS = 2000


def _normalize(answer: str | None, answer_type: str) -> str | None:
    if answer is None:
        return None
    try:
        if answer_type == "mc":
            return _normalize_mc(str(answer))
        return _normalize_math(str(answer)) or None
    except Exception:
        log.debug("normalize failed on %.200r", answer, exc_info=True)
        return None


_cached = functools.lru_cache(maxsize=65536)(_normalize)
clear_cache = _cached.cache_clear


def _normalize_mc(s: str) -> str | None:
    s = unwrap(s, _TEXT_CMDS).replace("$", "").strip().strip("*").strip()
    m = re.match(r"^\(?([A-Za-z])\)?(?:[.):\s]|$)", s)
    return m.group(1).upper() if m else None


# ----------------------------------------------------------------------------- math


def _clean_latex(s: str) -> str:
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = s.replace("\\\\", _ROW_BREAK)
    s = unwrap(s, _TEXT_CMDS, space=True)
    s = s.replace(r"\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)  # \( \) \[ \] math delimiters
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg)(?![A-Za-z])\.?", "", s)
    s = re.sub(r"(?<=\d)(?:,[ \t]*\\![ \t]*|\{[ \t]*,[ \t]*\})(?=\d{3})", "", s)  # MATH's 30,\!240, 1{,}234
    s = re.sub(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~", " ", s)
    s = re.sub(r"\\(?:displaystyle|textstyle)(?![A-Za-z])", "", s)
    s = s.replace(r"\lbrace", r"\{").replace(r"\rbrace", r"\}")
    s = re.sub(r"\\[lr]?vert(?![A-Za-z])", "|", s)
    s = re.sub(r"\\(?:ldots|cdots|dots)(?![A-Za-z])", "...", s)
    for old, new in ((r"\le", r"\leq"), (r"\ge", r"\geq"), (r"\ne", r"\neq"), (r"\leqslant", r"\leq"),
                     (r"\geqslant", r"\geq"), (r"\lt", "<"), (r"\gt", ">")):
        s = re.sub(re.escape(old) + r"(?![A-Za-z])", new.replace("\\", r"\\"), s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    return _matrices(s).strip()


_MATRIX = re.compile(r"\\begin\{(?:p|b|B|small)?matrix\}|\\end\{(?:p|b|B|small)?matrix\}")
_ARRAY = re.compile(r"[(\[]\s*\\begin\{array\}\{[^{}]*\}(.*?)\\end\{array\}\s*[)\]]", re.S)


def _matrices(s: str) -> str:
    r"""Every matrix environment becomes `\begin{pmatrix}`: the delimiters are typography.
    (vmatrix is a determinant, not a matrix, and stays as it is.)"""
    if "\\begin" not in s:
        return s
    s = _ARRAY.sub(r"\\begin{pmatrix}\1\\end{pmatrix}", s)
    return _MATRIX.sub(lambda m: r"\begin{pmatrix}" if m.group().startswith(r"\begin") else r"\end{pmatrix}", s)


# "1,234 dollars", "1,234^\circ": one number with thousands commas, then no other comma
_THOUSANDS = re.compile(r"([-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?)([^,\d][^,]*)?")


def _drop_marks(s: str) -> str:
    """Degree marks and percent signs (after the thousands rule, which needs them: `45^\\circ,135^\\circ`
    is a list of two angles, not 45135)."""
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\degree(?![A-Za-z])", "", s)
    return s.replace(r"\%", "").replace("%", "")


def is_prose(s: str) -> bool:
    if "\\" in s:
        return False
    return any(w.lower() not in MATH_WORDS for w in re.findall(r"[A-Za-z]{3,}", s))


def _squeeze(s: str) -> str:
    """Drop whitespace, except where it separates a command from a following letter (\\pi r)."""
    out = []
    prev = ""
    for m in re.finditer(r"\\[A-Za-z]+|\s+|[^\\\s]+|\\", s):
        t = m.group()
        if t[0].isspace():
            nxt = s[m.end() : m.end() + 1]
            if prev.startswith("\\") and prev[1:].isalpha() and nxt.isalpha():
                out.append(" ")
            continue
        out.append(t)
        prev = t if t.startswith("\\") else t[-1:]
    return "".join(out)


def canonical_number(s: str) -> str:
    """`18.00` -> `18`, `+5` -> `5`, `-0` -> `0`, `007` -> `7`; `s` is a plain decimal."""
    sign = "-" if s.startswith("-") else ""
    whole, _, frac = s.lstrip("+-").partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = whole + ("." + frac if frac else "")
    return "0" if out == "0" else sign + out


_UNIT_HEAD = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\d+/\d+|\d+\s*\\frac\{\d+\}\{\d+\}|\\frac\{[^{}]*\}\{[^{}]*\})"
_UNITS = re.compile(rf"({_UNIT_HEAD})\s+([A-Za-z][A-Za-z\s/^.\d]*)")  # a space before the words: 5xy is no unit
_SHORT_UNITS = {"cm", "mm", "km", "kg", "mg", "ml", "ft", "yd", "mi", "hr", "lb", "oz", "in", "am", "pm"}


def _strip_units(s: str) -> str:
    r"""`18 dollars`, `5 cm^2`, `\frac{68}{3}\text{pounds}` -> the number, when the words look like
    units: at most three, each of three letters or more (or a two-letter unit: cm, kg, ft, ...),
    none a math word or a connective, after a space (`5 ab`, `5xy`, `2 \pi`, `3 n` keep theirs)."""
    m = _UNITS.fullmatch(s)
    if not m:
        return s
    words = re.findall(r"[A-Za-z]+", m.group(2))
    if "," in m.group(2) or len(words) > 3:
        return s
    if any((len(w) < 3 and w.lower() not in _SHORT_UNITS) or w.lower() in MATH_WORDS or w.lower() in _STOP_WORDS
           for w in words):
        return s
    return m.group(1).strip()


def _mixed_number(s: str) -> str:
    """6\\frac{3}{4} -> \\frac{27}{4}: MATH writes mixed numbers so."""
    m = re.fullmatch(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}", s)
    if m and len(s) < 100 and int(m.group(2)) < int(m.group(3)):
        return r"\frac{%d}{%s}" % (int(m.group(1)) * int(m.group(3)) + int(m.group(2)), m.group(3))
    return s


def _strip_assignment(s: str) -> str:
    parts = split_top(s, ("=",))
    if len(parts) == 2 and not re.search(r"[<>]|\\(?:leq|geq|neq)", s):
        lhs, rhs = parts[0].strip(), parts[1].strip()
        if _SIMPLE_LHS.match(lhs) and rhs:
            return rhs
    return s


_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _normalize_math(s: str) -> str:
    s = _clean_latex(s).strip().rstrip(".").strip()
    s = _strip_assignment(re.sub(r"^(?:=|:)\s*", "", s))  # "x = 15,600", "x = 15 cm^2"
    m = _THOUSANDS.fullmatch(s)
    if m:
        s = m.group(1).replace(",", "") + (m.group(2) or "")
    s = _strip_units(_drop_marks(s).strip())
    if re.search(r"\s+and\s+", s):  # "2 and 5", "1, 3 and 7" are lists
        items = re.split(r"\s*,\s*|\s+and\s+", s)
        if not any(is_prose(it) for it in items):
            s = ",".join(items)
    prose = is_prose(s)
    if prose:
        s = s.lower()
    s = _squeeze(s)
    if s.startswith(r"\{") and s.endswith(r"\}") and balanced(s[2:-2]):
        s = s[2:-2]  # a whole-answer set {a,b} reads the same as the list a,b
    items = [_mixed_number(_strip_assignment(x)) for x in split_top(s)]
    items = [canonical_number(x) if _PLAIN_NUMBER.fullmatch(x) else x for x in items]
    if len(items) > 1 and not prose and not any("..." in x for x in items):
        items = sorted(items)
    return ",".join(items).strip().replace(_ROW_BREAK, "\\\\")


def exact_number(text: str) -> Fraction | None:
    r"""The exact value of a normalised plain number (`-3`, `0.5`, `1/2`, `\frac{1}{2}`), else None."""
    if len(text) > _MAX_EXACT_CHARS:
        return None
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", text)
    try:
        if m:
            value = Fraction(int(Decimal(m.group(2))), int(Decimal(m.group(3))))
            return -value if m.group(1) else value
        m = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(\d+))?", text)
        if m:
            value = Fraction(Decimal(m.group(1)))
            return value / int(Decimal(m.group(2))) if m.group(2) else value
    except (ArithmeticError, ValueError):
        return None
    return None
