"""HuggingFace's math-verify as a second grader (optional: `pip install -e ".[mathverify]"`).

It is called in the grading worker process (its time limits use SIGALRM, which works only in a
main thread), on the answer our extractor found, so both graders judge the same answer against
the same gold; multiple-choice letters are graded by ours (math-verify is for math). Its own
time limits make it load-dependent, one reason it is the second opinion and not the default.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["INSTALL", "GraderUnavailable", "available", "require", "verify_answer", "verify_response"]

INSTALL = 'pip install -e ".[mathverify]"'


class GraderUnavailable(ValueError):
    """A grader was asked for whose optional package is not installed."""


@functools.lru_cache(maxsize=1)
def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def require() -> None:
    """Fail in one clear line when math-verify is not installed."""
    if not available():
        raise GraderUnavailable(f"the math-verify grader needs the optional extra: {INSTALL}")


def _as_latex(s: str) -> str:
    s = s.strip()
    return s if ("$" in s or "\\boxed" in s or "\\(" in s or "\\[" in s) else f"${s}$"


def verify_answer(answer: str, gold: str) -> bool:
    """math-verify's verdict on an extracted answer against a gold answer."""
    from math_verify import parse, verify

    return bool(verify(parse(_as_latex(gold)), parse(_as_latex(answer))))


def verify_response(response: str, gold: str) -> bool:
    """math-verify's verdict on a whole response (its own extraction) against a gold answer."""
    from math_verify import parse, verify

    return bool(verify(parse(_as_latex(gold)), parse(response)))
