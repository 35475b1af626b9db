"""Prior/posterior signals on one scale.

SVR-MAD starts each agent's correctness score from a prior signal and replaces it by
SVR = (r - c) / D in [-1, 1] once the agent has been debated; the receiver is the argmax over
both kinds. So every prior is mapped into [-1, 1], higher = more likely correct, with the same
meaning at the ends (-1: no reason to trust, 1: certain). The mappings are monotone, so rankings
among agents are those of the raw signals; only the comparison with SVR depends on the scale.

A missing signal (None, NaN, absent key) scores MISSING = -1.0, the lowest value: an agent
without a signal is never preferred over one that has it (ties break by agent index in methods).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Mapping

__all__ = ["CONFIDENCE_INSTRUCTION", "PRIORS", "MISSING", "CONF_SCALE", "parse_self_confidence", "prior_score",
           "strip_confidence"]

CONFIDENCE_INSTRUCTION = (
    'At the very end, on its own line, write "Confidence: N%" where N (0-100) is how sure you '
    "are that your final answer is correct."
)

MISSING = -1.0

# DeepConf token confidence C = -mean(top-k logprobs) is >= log(k) and unbounded above (about
# 3 for a flat top-20, 15-30 for a peaked one); 1 - 2*exp(-C / CONF_SCALE) spreads that range
# over (-1, 1) instead of saturating at 1 (C=3 -> -0.48, C=10 -> 0.26, C=20 -> 0.73).
CONF_SCALE = 10.0


def _conf(c: float) -> float:
    return 1.0 - 2.0 * math.exp(-max(c, 0.0) / CONF_SCALE)


# name -> (signal key in Response.signals, mapping of the raw value into [-1, 1])
PRIORS: dict[str, tuple[str | None, Callable[[float], float]]] = {
    "min_ll": ("min_ll", lambda v: 2.0 * math.exp(min(v, 0.0)) - 1.0),  # min token prob, rescaled
    "ppl": ("ppl", lambda v: 2.0 / max(v, 1.0) - 1.0),  # geometric-mean token prob, rescaled
    "mean_logprob": ("mean_logprob", lambda v: 2.0 * math.exp(min(v, 0.0)) - 1.0),  # = ppl's
    "mean_entropy": ("mean_entropy", lambda v: 2.0 * math.exp(-max(v, 0.0)) - 1.0),
    "self_conf": ("self_conf", lambda v: 2.0 * min(max(v, 0.0), 1.0) - 1.0),
    "conf_mean": ("conf_mean", _conf),
    "conf_lowest_group": ("conf_lowest_group", _conf),
    "conf_bottom10": ("conf_bottom10", _conf),
    "conf_tail": ("conf_tail", _conf),
    "none": (None, lambda v: 0.0),
}


def prior_score(signals: Mapping[str, float | None] | None, name: str) -> float:
    """The signal `name` of one response mapped into [-1, 1] (MISSING when it has none)."""
    if name not in PRIORS:
        raise ValueError(f"unknown prior {name!r}; known: {', '.join(PRIORS)}")
    key, scale = PRIORS[name]
    if key is None:
        return 0.0
    value = (signals or {}).get(key)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return MISSING
    if math.isnan(value):
        return MISSING
    return max(-1.0, min(1.0, scale(value)))


_NUM = r"(\d+(?:\.\d+)?|\.\d+)"
_SELF_CONF = re.compile(
    r"confidence\b(?:\s*(?:level|score))?(?:\s*\([^)\n]*\))?[\s*_:=]*(?:-\s[\s*]*)?(?:is\s+|of\s+|about\s+|~\s*)?"
    + _NUM
    + r"\s*(%|percent\b|/\s*" + _NUM + r"|out\s+of\s+" + _NUM + r")?",
    re.I,
)
# (?<![\d.]): try a number only where it starts, so a long run of digits is scanned once, not once per digit
_CONFIDENT = re.compile(r"(?<![\d.])" + _NUM + r"\s*(%|percent\b)\s*(?:sure|confident|certain)", re.I)


def parse_self_confidence(text: str | None) -> float | None:
    """The confidence a response states about itself, in [0, 1]; None if absent or garbled.

    The last statement wins. "85%" and "85" are percentages, "0.85" a fraction, "8/10" and
    "9 out of 10" ratios; values outside their range are garbled, not clipped."""
    if not text:
        return None
    found = list(_SELF_CONF.finditer(text)) + list(_CONFIDENT.finditer(text))
    if not found:
        return None
    m = max(found, key=lambda m: m.start())
    try:
        value = float(m.group(1))
        groups = m.groups()
        unit = groups[1] or ""
        denominator = next((g for g in groups[2:] if g), None) if m.re is _SELF_CONF else None
        if denominator is not None:
            denominator = float(denominator)
            if denominator <= 0 or value > denominator:
                return None
            return value / denominator
        if unit or value > 1 or "." not in m.group(1):
            return value / 100.0 if value <= 100 else None
        return value
    except (TypeError, ValueError):
        return None


# A "Confidence: 85%" line, or a "90% confident" phrase anywhere. The line prefix may not span
# newlines ([ \t], not \s): a run of blank lines must not be rescanned from each of its lines.
_CONFIDENCE_STATEMENT = re.compile(
    r"^[ \t*_#>-]*(?:my[ \t]+)?confidence\b[^\n]*"
    r"|(?<![\d.])\d+(?:\.\d+)?[ \t]*(?:%|percent)[ \t]*(?:sure|confident|certain)",
    re.I | re.M,
)


def strip_confidence(text: str) -> str:
    """The text without its confidence statements (see CONFIDENCE_INSTRUCTION), so that an answer
    extractor never reads the elicited confidence as the answer. Linear in len(text)."""
    low = text.lower()
    if "confidence" not in low and "%" not in low and "percent" not in low:
        return text  # the usual case for a long reasoning text: no regex pass at all
    return _CONFIDENCE_STATEMENT.sub("", text)
