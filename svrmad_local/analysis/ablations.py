"""Appendix B from a trace: SVR-MAD's control flow with the posterior score swapped, thresholds swept.

Needs a trace holding every debate a variant may ask for (`svrmad run --ablations` records
`svr_mad.possible_debates`: every disagreeing pair, with the repeats the budget allows when pairs
repeat), so each (signal, tau) variant is a model-free replay with the run's own control flow. Thresholds are taken at quantiles of the scores the signal can
take, so the points span acceptance rates from low to high (the paper shows 10%..90%).
"""

from __future__ import annotations

import asyncio

from svrmad_local.debate.trace import row_debates
from svrmad_local.signals import prior_score

POSTERIOR_SIGNALS = ("svr", "min_ll", "ppl", "self_conf")


def candidate_taus(trace: list[dict], signal: str, points: int = 11) -> list[float]:
    if signal == "svr":
        return [1.0, 0.5, 0.34, 0.0, -0.34, -0.5, -1.0]
    scores = sorted(prior_score(r.signals, signal) for row in trace for r in row_debates(row).values())
    if not scores:
        return []
    qs = [scores[min(len(scores) - 1, round(i * (len(scores) - 1) / (points - 1)))] for i in range(points)]
    return sorted(set(qs), reverse=True)


def sweep(trace: list[dict], params: dict, signals=POSTERIOR_SIGNALS) -> list[dict]:
    """One point per (signal, tau): acceptance rate, mean tokens and accuracy over the trace."""
    from svrmad_local.analysis.replay import replay_all, totals

    out = []
    for sig in signals:
        method = "svr-mad" if sig == "svr" else f"svr-mad:{sig}"
        for tau in candidate_taus(trace, sig):
            res = asyncio.run(replay_all(trace, method, {**params, "tau": tau}))
            t = totals(res)
            out.append({"posterior": sig, "tau": tau, "acceptance_rate": t.get("acceptance_rate", 0.0),
                        "tokens_mean": t["tokens_mean"], "ncomm_mean": t["ncomm_mean"], "accuracy": t["accuracy"],
                        "questions": t["questions"]})
    return out
