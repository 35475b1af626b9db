"""Answer extraction and equivalence.

Every method decides "do these two agents agree?" and "did the receiver keep its answer?" with
`equivalent`, and accuracy is `is_correct`, so one notion of sameness serves them all. Model
outputs are untrusted text: nothing here raises on bad input or evaluates it as code (LaTeX is
parsed by a small recursive-descent parser that builds sympy objects directly), and symbolic
comparison runs under a time limit. The rules are documented in docs/grading.md.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import re
import signal
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

log = logging.getLogger(__name__)

__all__ = ["extract_answer", "normalize", "equivalent", "is_correct"]

# ----------------------------------------------------------------------------- helpers

# "Confidence: 85%" lines and "90% confident" phrases (see signals.CONFIDENCE_INSTRUCTION)
_CONFIDENCE_LINE = re.compile(
    r"^[\s*_#>-]*(?:my\s+)?confidence\b.*$|\d+(?:\.\d+)?\s*(?:%|percent)\s*(?:sure|confident|certain)",
    re.I | re.M,
)


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the brace group opening at text[start] ('{'), and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def _unwrap(text: str, commands: tuple[str, ...]) -> str:
    r"""Replace \cmd{X} by X for each command (brace-aware, so nested braces survive)."""
    pattern = re.compile(r"\\(?:%s)(?![A-Za-z])\s*" % "|".join(commands))
    out, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() < pos:
            continue
        group = _braced(text, m.end())
        if group is None:
            continue
        out.append(text[pos : m.start()])
        out.append(_unwrap(group[0], commands))
        pos = group[1]
    out.append(text[pos:])
    return "".join(out)


def _boxed_contents(text: str) -> list[str]:
    r"""Contents of every \boxed{...} / \fbox{...} (and brace-less `\boxed 5`), in order."""
    found = []
    for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])\s*", text):
        group = _braced(text, m.end())
        if group is not None:
            found.append(group[0])
        else:
            bare = re.match(r"[^\s$]+", text[m.end() :])
            if bare:
                found.append(bare.group(0))
    return [f.strip() for f in found if f.strip()]


def _split_top(text: str, seps: tuple[str, ...] = (",",)) -> list[str]:
    """Split on separators outside any bracket; intervals like (a,b] count as balanced."""
    parts, depth, last, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            depth += 1 if text[i + 1] == "{" else -1
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            for sep in seps:
                end = i + len(sep)
                if text.startswith(sep, i) and not (sep[0] == "\\" and text[end : end + 1].isalpha()):
                    parts.append(text[last:i])
                    last = end
                    i = end - 1
                    break
        i += 1
    parts.append(text[last:])
    return parts


# ----------------------------------------------------------------------------- extraction

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def extract_answer(text: str, answer_type: str, choices: list[str] | None = None) -> str | None:
    """The final answer stated in a model response, or None when none can be found.

    Math: the last \\boxed{} wins, then an "Answer:"/"final answer is" line, then the last number.
    MC: the uppercase letter (see docs/grading.md for the order of the patterns)."""
    try:
        if not text:
            return None
        # A "Confidence: 85%" line must never be read as the answer.
        body = _CONFIDENCE_LINE.sub("", text)
        if answer_type == "mc":
            return _extract_mc(body, choices)
        return _extract_math(body)
    except Exception:  # untrusted text: never propagate
        log.debug("extract_answer failed", exc_info=True)
        return None


_ANSWER_LINE = re.compile(r"\banswer[\s*]*(?:is\b|:|=)[\s*:]*(.+)", re.I)
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def _clean_line(s: str) -> str:
    s = s.strip().strip("*").strip()
    s = re.sub(r"^[:\s*]+", "", s)
    s = s.rstrip(" .;*").strip()
    if len(s) > 2 and s[0] == s[-1] == "$":
        s = s.strip("$").strip()
    return s


def _extract_math(text: str) -> str | None:
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1]
    markers = list(_ANSWER_LINE.finditer(text)) + list(re.finditer(r"####\s*(.+)", text))
    if markers:
        last = max(markers, key=lambda m: m.start())
        answer = _clean_line(last.group(1))
        # "the answer is not obvious ... 42": a marker followed by more numbers was not final
        if answer and not _NUMBER.search(text, last.end()):
            return answer
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _option_key(s: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^\w\s]", " ", s.lower())).strip()


def _extract_mc(text: str, choices: list[str] | None) -> str | None:
    valid = _LETTERS[: len(choices)] if choices else _LETTERS
    L = f"[{valid}]"

    def letter_of(s: str) -> str | None:
        s = _unwrap(s, ("text", "textbf", "mathrm", "mathbf")).replace("$", "")
        m = re.match(rf"^\s*\**\s*\(?({L})\)?(?![A-Za-z])", s)
        if m:
            return m.group(1)
        if choices:
            key = _option_key(s)
            for i, c in enumerate(choices):
                if key and key == _option_key(c):
                    return valid[i]
        return None

    stages = [
        [letter_of(b) for b in _boxed_contents(text)],
        [
            letter_of(m.group(1))
            for m in re.finditer(r"\b(?:answer|option|choice)[\s*]*(?:is\b|:|=)[\s*:]*(.+)", text, re.I)
        ],
        re.findall(rf"^[\s*]*\(?({L})\)?[.)]?[\s*]*$", text, re.M),
        re.findall(rf"\(({L})\)", text),
    ]
    for found in stages:
        found = [f for f in found if f]
        if found:
            return found[-1]
    if choices:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if lines:
            last = _option_key(lines[-1])
            keys = [_option_key(c) for c in choices]
            hits = {i for i, k in enumerate(keys) if k and re.search(rf"\b{re.escape(k)}\b", last)}
            if len(hits) == 1:
                return valid[hits.pop()]
    return None


# ----------------------------------------------------------------------------- normalisation

_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00d7": r"\times ", "\u00b7": r"\cdot ", "\u221a": r"\sqrt",
    "\u03c0": r"\pi ", "\u221e": r"\infty ", "\u2264": r"\leq ", "\u2265": r"\geq ", "\u2260": r"\neq ",
    "\u222a": r"\cup ", "\u2026": "...", "\u00b0": "", "\u00a0": " ",
}
_TEXT_CMDS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mathsf",
              "operatorname", "mbox", "hbox", "boxed", "fbox")
_MATH_WORDS = {"sqrt", "frac", "pi", "sin", "cos", "tan", "sec", "csc", "cot", "log", "ln", "exp",
               "infty", "inf", "cdot", "times", "floor", "ceil", "binom", "min", "max", "gcd", "lcm",
               "mod", "sinh", "cosh", "tanh", "arcsin", "arccos", "arctan"}
_STOP_WORDS = {"if", "or", "and", "for", "when", "where", "is", "are", "otherwise", "with", "such",
               "all", "of", "not", "no", "but", "then", "that", "which"}
_SIMPLE_LHS = re.compile(r"^(?:[A-Za-z](?:_\{?\w+\}?)?|[A-Za-z]\w*\([A-Za-z,]*\)|\\[A-Za-z]+)$")
_RELATIONS = (r"\leq", r"\geq", r"\neq", "<=", ">=", "!=", "<", ">", "=")


def normalize(answer: str | None, answer_type: str) -> str | None:
    """A canonical string for an answer (equal strings are equivalent answers; the converse needs
    `equivalent`). Usable as a grouping key for votes. None when nothing is left."""
    if answer is None:
        return None
    try:
        if answer_type == "mc":
            return _normalize_mc(str(answer))
        return _normalize_math(str(answer)) or None
    except Exception:
        log.debug("normalize failed on %r", answer, exc_info=True)
        return None


def _normalize_mc(s: str) -> str | None:
    s = _unwrap(s, _TEXT_CMDS).replace("$", "").strip().strip("*").strip()
    m = re.match(r"^\(?([A-Za-z])\)?(?:[.):\s]|$)", s)
    return m.group(1).upper() if m else None


def _clean_latex(s: str) -> str:
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = _unwrap(s, _TEXT_CMDS)
    s = s.replace(r"\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)  # \( \) \[ \] math delimiters
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg)(?![A-Za-z])\.?", "", s)
    s = re.sub(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~", " ", s)
    s = re.sub(r"\\(?:displaystyle|textstyle)(?![A-Za-z])", "", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\degree(?![A-Za-z])", "", s)
    s = s.replace(r"\%", "").replace("%", "")
    s = s.replace(r"\lbrace", r"\{").replace(r"\rbrace", r"\}")
    s = re.sub(r"\\[lr]?vert(?![A-Za-z])", "|", s)
    s = re.sub(r"\\(?:ldots|cdots|dots)(?![A-Za-z])", "...", s)
    for old, new in ((r"\le", r"\leq"), (r"\ge", r"\geq"), (r"\ne", r"\neq"), (r"\leqslant", r"\leq"),
                     (r"\geqslant", r"\geq"), (r"\lt", "<"), (r"\gt", ">")):
        s = re.sub(re.escape(old) + r"(?![A-Za-z])", new.replace("\\", r"\\"), s)
    s = s.replace("{,}", "")  # LaTeX thousands separator 1{,}234
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    return s.strip()


def _is_prose(s: str) -> bool:
    if "\\" in s:
        return False
    return any(w.lower() not in _MATH_WORDS for w in re.findall(r"[A-Za-z]{3,}", s))


def _squeeze(s: str) -> str:
    """Drop whitespace, except where it separates a command from a following letter (\\pi r)."""
    tokens = re.findall(r"\\[A-Za-z]+|\s+|.", s)
    out = []
    for i, t in enumerate(tokens):
        if t.isspace():
            prev = tokens[i - 1] if i else ""
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
            if prev.startswith("\\") and prev[1:].isalpha() and nxt[:1].isalpha():
                out.append(" ")
            continue
        out.append(t)
    return "".join(out)


def _canonical_number(s: str) -> str:
    try:
        d = Decimal(s)
    except InvalidOperation:
        return s
    if d == d.to_integral_value():
        return str(int(d))
    text = format(d, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _strip_units(s: str) -> str:
    m = re.fullmatch(r"([-+]?\d[\d,]*(?:\.\d+)?)\s*([A-Za-z][A-Za-z\s/^.\d]*)", s)
    if not m:
        return s
    words = re.findall(r"[A-Za-z]+", m.group(2))
    if "," in m.group(2) or len(words) > 3:
        return s
    if any(len(w) < 2 or w.lower() in _MATH_WORDS or w.lower() in _STOP_WORDS for w in words):
        return s
    return m.group(1)


def _strip_assignment(s: str) -> str:
    parts = _split_top(s, ("=",))
    if len(parts) == 2 and not re.search(r"[<>]|\\(?:leq|geq|neq)", s):
        lhs, rhs = parts[0].strip(), parts[1].strip()
        if _SIMPLE_LHS.match(lhs) and rhs:
            return rhs
    return s


def _normalize_math(s: str) -> str:
    s = _clean_latex(s).strip().rstrip(".").strip()
    s = re.sub(r"^(?:=|:)\s*", "", s)
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # 1,234 is a number, (1,2) is not
        s = s.replace(",", "")
    s = _strip_units(s)
    if re.search(r"\s+and\s+", s):  # "2 and 5", "1, 3 and 7" are lists
        items = re.split(r"\s*,\s*|\s+and\s+", s)
        if not any(_is_prose(it) for it in items):
            s = ",".join(items)
    prose = _is_prose(s)
    m = re.fullmatch(r"(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}", s)  # mixed number 6\frac{3}{4}
    if m and int(m.group(2)) < int(m.group(3)):
        s = r"\frac{%d}{%s}" % (int(m.group(1)) * int(m.group(3)) + int(m.group(2)), m.group(3))
    if prose:
        s = s.lower()
    s = _squeeze(s)
    if s.startswith(r"\{") and s.endswith(r"\}") and _balanced(s[2:-2]):
        s = s[2:-2]  # a whole-answer set {a,b} reads the same as the list a,b
    items = [_strip_assignment(x) for x in _split_top(s)]
    items = [_canonical_number(x) if re.fullmatch(r"[-+]?\d+(?:\.\d+)?", x) else x for x in items]
    if len(items) > 1 and not prose and not any("..." in x for x in items):
        items = sorted(items)
    return ",".join(items).strip()


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth < 0:
            return False
    return depth == 0


# ----------------------------------------------------------------------------- LaTeX -> sympy


class _ParseError(Exception):
    pass


_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
          "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon",
          "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma",
          "Phi", "Psi", "Omega"}
_FUNCS = ("sqrt", "sin", "cos", "tan", "sec", "csc", "cot", "log", "ln", "exp")
_TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\\[A-Za-z]+|\\[{}|]|\.\.\.|\S)")
_MAX_BITS = 200_000  # refuse numbers whose evaluation alone would take unbounded time/memory


class _LatexParser:
    """LaTeX (or plain a*b^2) -> sympy expression, building objects directly (no eval)."""

    def __init__(self, text: str):
        import sympy

        self.sp = sympy
        self.toks = [m.group(1) for m in _TOKEN.finditer(text)]
        if "".join(self.toks) != re.sub(r"\s+", "", text):
            raise _ParseError(text)
        self.i = 0
        self.abs_depth = 0

    def parse(self):
        e = self.expr()
        if self.i != len(self.toks):
            raise _ParseError(f"trailing {self.toks[self.i:]}")
        return e

    def peek(self, k: int = 0):
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        t = self.peek()
        if t is None or (expected is not None and t != expected):
            raise _ParseError(f"expected {expected!r}, got {t!r}")
        self.i += 1
        return t

    def expr(self):
        e = self.term()
        while self.peek() in ("+", "-"):
            e = e + self.term() if self.take() == "+" else e - self.term()
        return e

    def term(self):
        e = self.unary()
        while True:
            t = self.peek()
            if t in ("*", r"\cdot", r"\times"):
                self.take()
                e = e * self.unary()
            elif t in ("/", r"\div"):
                self.take()
                e = e / self.unary()
            elif self.starts_atom(t):
                e = e * self.power()
            else:
                return e

    def unary(self):
        if self.peek() in ("-", "+"):
            return -self.unary() if self.take() == "-" else self.unary()
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            return self.pow(base, self.exponent())
        return base

    def exponent(self):
        if self.peek() in ("-", "+"):
            return -self.exponent() if self.take() == "-" else self.exponent()
        return self.postfix()

    def postfix(self):
        e = self.atom()
        while self.peek() == "!":
            self.take()
            if self.peek() == "!":
                self.take()
                e = self.guard_factorial(e, self.sp.factorial2)
            else:
                e = self.guard_factorial(e, self.sp.factorial)
        return e

    def starts_atom(self, t) -> bool:
        if t is None:
            return False
        if t == "|":
            return self.abs_depth == 0
        if t in ("(", "[", "{") or t[0].isdigit() or t[0] == "." and len(t) > 1 or t.isalpha():
            return True
        return t.startswith("\\") and t[1:] in (
            {"frac", "sqrt", "binom", "pi", "infty", "lfloor", "lceil"} | _GREEK | set(_FUNCS)
        )

    def arg(self):
        t = self.peek()
        if t == "{":
            return self.group("{", "}")
        if t is not None and t.isdigit() and len(t) > 1:  # \frac12
            self.toks[self.i] = t[1:]
            return self.sp.Integer(int(t[0]))
        return self.atom()

    def group(self, open_: str, close: str):
        self.take(open_)
        e = self.expr()
        self.take(close)
        return e

    def raw_group(self) -> str:
        if self.peek() != "{":
            return self.take()
        self.take("{")
        depth, out = 1, []
        while True:
            t = self.take()
            depth += (t == "{") - (t == "}")
            if depth == 0:
                return "".join(out)
            out.append(t)

    def atom(self):
        sp = self.sp
        t = self.take()
        if t[0].isdigit() or (t[0] == "." and len(t) > 1):
            return sp.Rational(t)
        if t in ("(", "[", "{"):
            self.i -= 1
            return self.group(t, {"(": ")", "[": "]", "{": "}"}[t])
        if t == "|":
            self.abs_depth += 1
            inner = self.expr()
            self.take("|")
            self.abs_depth -= 1
            return sp.Abs(inner)
        if t.isalpha():
            word = t
            j = 0
            while (self.peek(j) or "").isalpha() and len(self.peek(j)) == 1:
                word += self.peek(j)
                j += 1
            for name in _FUNCS + ("pi",):
                if word.startswith(name):
                    self.i += len(name) - 1
                    return sp.pi if name == "pi" else self.function(name)
            if len(word) > 3 or (len(word) == 3 and len(set(word)) < 3):
                raise _ParseError(f"prose {word!r}")  # "odd n" must not become o*d**2*n
            if self.peek() == "_":
                self.take()
                return sp.Symbol(f"{t}_{self.raw_group()}")
            return sp.E if t == "e" else sp.Symbol(t)
        if t.startswith("\\"):
            return self.command(t[1:])
        raise _ParseError(f"unexpected {t!r}")

    def command(self, name: str):
        sp = self.sp
        if name == "frac":
            num = self.arg()
            return num / self.arg()
        if name == "binom":
            n = self.arg()
            return sp.binomial(n, self.arg())
        if name == "sqrt" and self.peek() == "[":
            n = self.group("[", "]")
            return sp.root(self.arg(), n)
        if name == "pi":
            return sp.pi
        if name == "infty":
            return sp.oo
        if name in _GREEK:
            return sp.Symbol("lamda" if name == "lambda" else name)
        if name in ("lfloor", "lceil"):
            inner = self.expr()
            self.take(r"\rfloor" if name == "lfloor" else r"\rceil")
            return sp.floor(inner) if name == "lfloor" else sp.ceiling(inner)
        if name in _FUNCS:
            return self.function(name)
        raise _ParseError(f"unsupported \\{name}")

    def function(self, name: str):
        sp = self.sp
        base = power = None
        if self.peek() == "_":
            self.take()
            base = self.arg()
        if self.peek() == "^" and name != "sqrt":
            self.take()
            power = self.exponent()
        x = self.arg() if name == "sqrt" else (self.atom() if self.peek() in ("(", "{", "[") else self.power())
        funcs = {"sqrt": sp.sqrt, "sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "sec": sp.sec,
                 "csc": sp.csc, "cot": sp.cot, "ln": sp.log, "exp": sp.exp}
        value = sp.log(x, base) if name == "log" and base is not None else funcs.get(name, sp.log)(x)
        return value if power is None else self.pow(value, power)

    def pow(self, base, exp):
        sp = self.sp
        if exp.is_Integer and abs(int(exp)) > 10_000 and not base.is_Number:
            raise _ParseError("exponent too large")
        if base.is_Number and exp.is_Number and base not in (0, 1, -1):
            bits = abs(float(exp)) * math.log2(max(abs(float(base)), 1 / abs(float(base))))
            if bits > _MAX_BITS:
                raise _ParseError("number too large")
        return sp.Pow(base, exp)

    def guard_factorial(self, e, fn):
        if e.is_Number and e > 5_000:
            raise _ParseError("factorial too large")
        return fn(e)


@functools.lru_cache(maxsize=16384)
def _to_sympy(text: str):
    try:
        return _LatexParser(text).parse()
    except (_ParseError, TypeError, ValueError, ZeroDivisionError, AttributeError, RecursionError):
        return None


def _to_fraction(text: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", text)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(?:\.\d+)?(?:/\d+)?", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


# ----------------------------------------------------------------------------- equivalence


class _Timeout(BaseException):
    """BaseException so that sympy's broad `except Exception` clauses cannot swallow it."""


def _call_with_timeout(fn, timeout: float | None):
    """Run fn() for at most `timeout` seconds, else raise _Timeout.

    In the main thread (the event loop of a run, pytest) a one-shot SIGALRM interrupts the
    computation itself. Elsewhere, or when someone else owns SIGALRM, fn runs in a daemon thread
    that is abandoned on timeout: the caller gets its answer in time, the thread finishes (or not)
    in the background. Huge numbers are refused by the parser, so nothing sits in one C call."""
    if timeout is None:
        return fn()
    use_alarm = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
    if use_alarm:
        def on_alarm(signum, frame):
            raise _Timeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        try:
            signal.setitimer(signal.ITIMER_REAL, max(timeout, 1e-3))
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True, name="svrmad-equivalent")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise _Timeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


def equivalent(a: str | None, b: str | None, answer_type: str, timeout: float = 2.0) -> bool:
    """Whether two answers are the same answer. None (no answer) equals nothing, not even None.

    Order: normalised strings, exact numbers, then structure (sets, tuples, intervals, relations)
    with sympy for the pieces, all of the symbolic part under `timeout` seconds (timeout -> False).
    Results are cached: methods compare the same pairs many times."""
    if a is None or b is None:
        return False
    na, nb = normalize(a, answer_type), normalize(b, answer_type)
    if na is None or nb is None:
        return False
    if na == nb:
        return True
    if answer_type == "mc":
        return False
    if na > nb:
        na, nb = nb, na
    return _equivalent_math(na, nb, timeout)


@functools.lru_cache(maxsize=65536)
def _equivalent_math(na: str, nb: str, timeout: float) -> bool:
    fa, fb = _to_fraction(na), _to_fraction(nb)
    if fa is not None and fb is not None:
        return fa == fb
    try:
        return bool(_call_with_timeout(lambda: _same(_structure(na), _structure(nb)), timeout))
    except _Timeout:
        log.debug("equivalence timed out: %r vs %r", na, nb)
        return False
    except Exception:
        log.debug("equivalence failed: %r vs %r", na, nb, exc_info=True)
        return False


def is_correct(answer: str | None, gold: str, answer_type: str) -> bool:
    """Grading against a gold answer (normalised the same way, so "1,234" golds are fine)."""
    return equivalent(answer, gold, answer_type)


def _structure(s: str):
    """("union", parts) | ("set", items) | ("seq", open, close, items) | ("rel", ops, sides) | ("atom", s)."""
    parts = _split_top(s, (r"\cup",))
    if len(parts) > 1:
        return ("union", [_structure(p) for p in parts])
    if s.startswith(r"\{") and s.endswith(r"\}") and _balanced(s[2:-2]):
        return ("set", [_structure(x) for x in _split_top(s[2:-2])])
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _balanced(s[1:-1]):
        items = _split_top(s[1:-1])
        if len(items) > 1:
            return ("seq", s[0], s[-1], [_structure(x) for x in items])
    items = _split_top(s)
    if len(items) > 1:
        return ("set", [_structure(x) for x in items])
    sides, ops = _split_relation(s)
    if ops:
        return _relation(ops, sides)
    return ("atom", s)


def _split_relation(s: str) -> tuple[list[str], list[str]]:
    pattern = "|".join(re.escape(r) + (r"(?![A-Za-z])" if r[0] == "\\" else "") for r in _RELATIONS)
    pieces = re.split(f"({pattern})", s)
    if len(pieces) == 1 or not all(_balanced(p) for p in pieces[0::2]):
        return [s], []
    canon = {"<=": r"\leq", ">=": r"\geq", "!=": r"\neq"}
    return pieces[0::2], [canon.get(op, op) for op in pieces[1::2]]


def _relation(ops: list[str], sides: list[str]):
    """Single-variable inequalities become intervals so that x \\geq 2 matches [2, \\infty)."""
    flip = {"<": ">", ">": "<", r"\leq": r"\geq", r"\geq": r"\leq"}
    if all(op in (">", r"\geq") for op in ops):
        ops, sides = [flip[o] for o in reversed(ops)], list(reversed(sides))
    var = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?$")
    if all(op in ("<", r"\leq") for op in ops):
        if len(sides) == 3 and var.match(sides[1]) and not var.match(sides[0]):
            lo, hi = sides[0], sides[2]
            return ("seq", "(" if ops[0] == "<" else "[", ")" if ops[1] == "<" else "]",
                    [("atom", lo), ("atom", hi)])
        if len(sides) == 2 and var.match(sides[0]) and not var.match(sides[1]):
            return ("seq", "(", ")" if ops[0] == "<" else "]", [("atom", r"-\infty"), ("atom", sides[1])])
        if len(sides) == 2 and var.match(sides[1]) and not var.match(sides[0]):
            return ("seq", "(" if ops[0] == "<" else "[", ")", [("atom", sides[0]), ("atom", r"\infty")])
    return ("rel", ops, [("atom", x) for x in sides])


def _same(x, y) -> bool:
    kx, ky = x[0], y[0]
    if kx == "set" and len(x[1]) == 1:
        return _same(x[1][0], y)
    if ky == "set" and len(y[1]) == 1:
        return _same(x, y[1][0])
    if kx == "atom" and ky == "atom":
        return _atoms_equal(x[1], y[1])
    if kx in ("set", "union") and ky == kx:
        return _matching(x[1], y[1])
    if kx == "seq" and ky == "seq":
        return x[1:3] == y[1:3] and len(x[3]) == len(y[3]) and all(map(_same, x[3], y[3]))
    if {kx, ky} == {"seq", "set"}:  # (3,2,5) answered as a bare list (whose order is not kept)
        seq, flat = (x, y) if kx == "seq" else (y, x)
        return seq[1:3] == ("(", ")") and _matching(seq[3], flat[1])
    if kx == "rel" and ky == "rel":
        if x[1] == y[1] and len(x[2]) == len(y[2]) and all(map(_same, x[2], y[2])):
            return True
        if x[1] == y[1] == ["="]:  # the same equation rearranged: l1-r1 = +-(l2-r2)
            ex = [_to_sympy(s[1]) for s in x[2]] + [_to_sympy(s[1]) for s in y[2]]
            if None not in ex:
                d1, d2 = ex[0] - ex[1], ex[2] - ex[3]
                return _sympy_equal(d1, d2) or _sympy_equal(d1, -d2)
    return False


def _matching(xs: list, ys: list) -> bool:
    if len(xs) != len(ys):
        return False
    free = list(ys)
    for x in xs:
        for j, y in enumerate(free):
            if _same(x, y):
                del free[j]
                break
        else:
            return False
    return True


def _atoms_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    fa, fb = _to_fraction(a), _to_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    ea, eb = _to_sympy(a), _to_sympy(b)
    if ea is None or eb is None:
        return False
    return _sympy_equal(ea, eb)


def _sympy_equal(x, y) -> bool:
    import sympy

    if x == y:
        return True
    d = x - y
    if d == 0:
        return True
    if d.has(sympy.oo, -sympy.oo, sympy.zoo, sympy.nan):
        return False
    if d.is_Number:  # exact arithmetic already decided it
        return False
    if not d.free_symbols:  # closed forms sympy leaves unsimplified: high-precision evaluation
        value = d.evalf(50, chop=True)
        if value == 0:
            return True
        scale = max(1.0, abs(complex(x.evalf(20))))
        return bool(value.is_number) and abs(complex(value)) <= min(1e-12, 1e-30 * scale)
    if _differs_somewhere(d, x):
        return False
    if sympy.expand(d) == 0:
        return True
    return sympy.simplify(d) == 0


def _differs_somewhere(d, x) -> bool:
    """A cheap disproof: d = x - y is clearly nonzero at a random point. Only ever says "differ"
    (never "equal"), so piecewise coincidences such as |t| = t for t > 0 cannot fool it."""
    rng = random.Random(len(str(d)))  # deterministic per expression
    symbols = sorted(d.free_symbols, key=str)
    for _ in range(3):
        point = {s: Fraction(rng.randint(-97, 97), rng.randint(7, 29)) for s in symbols}
        try:
            value = complex(d.subs(point).evalf(30))
            scale = max(1.0, abs(complex(x.subs(point).evalf(30))))
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            continue
        if math.isfinite(abs(value)) and abs(value) > 1e-12 * scale:
            return True
    return False
