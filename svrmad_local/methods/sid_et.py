"""SID-ET as the paper's Appendix A runs it: skip debate when one agent is confident enough.

The most confident agent is the one with the highest pre-debate min log-likelihood
(signals["min_ll"]). If that value reaches the threshold the question is answered without debate,
else it goes to all-to-all MAD (the very calls, and ids, of the all-to-all method). The threshold is
set per dataset from a skip rate, and the skip rate is tuned against SVR-MAD (Algorithm 2)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods import all_to_all
from svrmad_local.methods.base import MethodResult, finish, majority

SKIP_RATES = tuple(i / 10 for i in range(9, 0, -1))  # 90%, 80%, ..., 10%


def most_confident(initial: Sequence[Response]) -> tuple[int, float]:
    """(agent, its min-LL) with the highest min-LL; a missing value counts as -inf; ties -> lowest."""
    conf = [-math.inf if r.signals.get("min_ll") is None else float(r.signals["min_ll"])
            for r in initial]
    best = max(range(len(conf)), key=lambda i: (conf[i], -i))
    return best, conf[best]


def threshold_for_skip_rate(initials: Sequence[Sequence[Response]], rate: float) -> float | None:
    """The min-LL threshold that skips round(rate * questions) of these questions: the confidence
    of the last question skipped when they are sorted most confident first (questions tied with
    it are skipped too). None (skip nothing) when that is no question."""
    conf = sorted((most_confident(init)[1] for init in initials), reverse=True)
    k = round(rate * len(conf))
    return conf[k - 1] if k > 0 else None


def tune_skip_rate(evaluate: Callable[[float], tuple[float, float]], tok_ref: float,
                   acc_ref: float, rates: Sequence[float] = SKIP_RATES) -> float:
    """Algorithm 2: from the highest skip rate down, return the first whose accuracy reaches the
    reference's, or whose total tokens exceed the reference's; the last rate when none does.
    `evaluate(rate)` returns (total tokens, accuracy) of SID-ET at that skip rate."""
    for rate in rates:
        tokens, acc = evaluate(rate)
        if acc >= acc_ref or tokens > tok_ref:
            return rate
    return rates[-1]


async def run(q: Question, initial: Sequence[Response], backend: Backend, *,
              threshold: float | None = None, skip_answer: str = "agent", rounds: int = 2,
              consensus: int = 5) -> MethodResult:
    """threshold: min-LL at or above which the question is skipped (None: never skip).
    skip_answer: a skipped question's answer, "agent" (the confident agent's, as SID's "solvable
    by a single agent") or "majority" (of the initial answers). `accepted` is True when skipped."""
    if skip_answer not in ("agent", "majority"):
        raise ValueError(f"sid-et: bad skip_answer={skip_answer!r}")
    params = {"threshold": threshold, "skip_answer": skip_answer, "rounds": rounds,
              "consensus": consensus}
    agent, conf = most_confident(initial)
    if threshold is not None and conf >= threshold:
        answer = (initial[agent].answer if skip_answer == "agent"
                  else majority([r.answer for r in initial], q.answer_type))
        return finish("sid-et", q, initial, [], answer, ncomm=0, accepted=True, params=params)
    mad = await all_to_all.run(q, initial, backend, rounds=rounds, consensus=consensus)
    mad.method, mad.accepted = "sid-et", False
    mad.params = {**params, "rounds_run": mad.params["rounds_run"]}
    return mad
