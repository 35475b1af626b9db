"""LaTeX (or plain `a*b^2`) -> sympy, by a small recursive-descent parser that builds sympy objects
directly: model outputs are untrusted, so nothing is ever `eval`ed (`sympy.parsing.latex` needs an
antlr4 runtime of exactly 4.11 and is not used). Imported only where sympy work is done: the
grading worker process (`svrmad_local.grading.worker`).

Work is bounded before sympy sees it: numbers longer than MAX_DIGITS digits, values over MAX_BITS
bits, factorials over 5000 and integer powers over 10,000 of symbolic bases are refused (one C-level
big-int operation cannot be interrupted), and so is any text longer than MAX_CHARS.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal
from fractions import Fraction

__all__ = ["to_sympy", "MAX_CHARS"]

MAX_CHARS = 600  # longer atoms compare as text only
MAX_DIGITS = 4000
MAX_BITS = 200_000  # refuse numbers whose evaluation alone would take unbounded time/memory


class _ParseError(Exception):
    pass


_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
          "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon",
          "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma",
          "Phi", "Psi", "Omega"}
_FUNCS = ("sqrt", "sin", "cos", "tan", "sec", "csc", "cot", "log", "ln", "exp")
_TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\\[A-Za-z]+|\\[{}|]|\.\.\.|\S)")


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

    def signed(self, inner):
        """Leading signs, then `inner` (in a term a sign binds looser than ^, in an exponent tighter)."""
        if self.peek() in ("-", "+"):
            return -self.signed(inner) if self.take() == "-" else self.signed(inner)
        return inner()

    def unary(self):
        return self.signed(self.power)

    def exponent(self):
        return self.signed(self.postfix)

    def power(self):
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            return self.pow(base, self.exponent())
        return base

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
            if len(t) > MAX_DIGITS:
                raise _ParseError("number too long")
            value = Fraction(Decimal(t))
            return sp.Rational(value.numerator, value.denominator)
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
            if bits > MAX_BITS:
                raise _ParseError("number too large")
        return sp.Pow(base, exp)

    def guard_factorial(self, e, fn):
        if e.is_Number and e > 5_000:
            raise _ParseError("factorial too large")
        return fn(e)


@functools.lru_cache(maxsize=16384)
def to_sympy(text: str):
    """The sympy expression of a normalised atom, or None when it is not one we can read."""
    if len(text) > MAX_CHARS:
        return None
    try:
        return _LatexParser(text).parse()
    except (_ParseError, TypeError, ValueError, ArithmeticError, AttributeError, RecursionError):
        return None

