"""`svrmad replay`: re-run a method's controller against a recorded trace, no model.

The controller is the very code a live run uses; only the backend is a `ReplayBackend`. This is
how parameters (S, C, budget, prior, ...) are swept after one expensive live run: any setting whose
debates the trace holds replays exactly, and one that needs an unrecorded debate stops with the
question and the call named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from svrmad_local.debate.replay import MissingDebate, ReplayBackend
from svrmad_local.debate.trace import read_trace, row_initial, row_priors, row_question
from svrmad_local.methods import METHODS, MethodResult, accepted_params, run_method
from svrmad_local.methods.sid_et import threshold_for_skip_rate
from svrmad_local.signals import PRIORS

# option dest -> method keyword (only passed to methods that take it)
OPTIONS = ("S", "C", "budget", "tau", "check", "spend", "prior", "repeat_pairs", "accept_exhausted",
           "rounds", "consensus", "groups", "seed", "ncomm_brief", "threshold", "skip_answer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace.jsonl of a run")
    p.add_argument("--method", default="svr-mad", choices=list(METHODS))
    p.add_argument("--json", action="store_true", help="one JSON object per question, then totals")
    g = p.add_argument_group("svr-mad")
    g.add_argument("--S", type=int, help="challengers per iteration (default 2)")
    g.add_argument("--C", type=int, help="debates needed before acceptance (default 2)")
    g.add_argument("--budget", type=int, help="B_max (default S*(k+m))")
    g.add_argument("--tau", type=float, help="acceptance threshold on the posterior (default 1)")
    g.add_argument("--check", choices=["each", "round"])
    g.add_argument("--spend", choices=["S", "actual"])
    g.add_argument("--prior", choices=list(PRIORS),
                   help="recompute priors from this signal (default: the recorded prior)")
    g.add_argument("--no-repeat-pairs", dest="repeat_pairs", action="store_false", default=None,
                   help="debate each pair at most once (traces recorded before repeated pairs)")
    g.add_argument("--accept-exhausted", action="store_true", default=None)
    g = p.add_argument_group("round-based baselines")
    g.add_argument("--rounds", type=int)
    g.add_argument("--consensus", type=int)
    g.add_argument("--groups", help='group-debate split, "3-3" or "2-2-2"')
    g.add_argument("--seed", type=int, help="group-debate grouping seed")
    g.add_argument("--ncomm-brief", choices=["each", "none"])
    g.add_argument("--skip-rate", type=float, default=0.6,
                   help="sid-et: skip this fraction of the trace's questions (default 0.6)")
    g.add_argument("--threshold", type=float, help="sid-et: min-LL threshold (overrides --skip-rate)")
    g.add_argument("--skip-answer", choices=["agent", "majority"])


async def replay_all(rows: list[dict], method: str, params: dict[str, Any]) -> list[MethodResult]:
    """Run `method` on every trace line concurrently; results in trace order."""
    takes_priors = "priors" in accepted_params(method)

    async def one(row: dict) -> MethodResult:
        extra = dict(params)
        priors = row_priors(row)
        if takes_priors and "prior" not in extra and None not in priors:
            extra["priors"] = priors  # the recorded starting scores
        return await run_method(method, row_question(row), row_initial(row), ReplayBackend(row),
                                **extra)

    return list(await asyncio.gather(*(one(r) for r in rows)))


def totals(results: list[MethodResult]) -> dict[str, Any]:
    n = len(results)
    out: dict[str, Any] = {
        "accuracy": sum(bool(r.correct) for r in results) / n if n else 0.0,
        "ncomm_mean": sum(r.ncomm for r in results) / n if n else 0.0,
        "tokens_mean": sum(r.tokens for r in results) / n if n else 0.0,
        "questions": n}
    acc = [r.accepted for r in results if r.accepted is not None]
    if acc:
        out["acceptance_rate"] = sum(acc) / len(acc)
    return out


def main(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)
    taken = accepted_params(args.method)
    given = {k: getattr(args, k) for k in OPTIONS if getattr(args, k, None) is not None}
    if args.method == "sid-et" and "threshold" not in given:
        given["threshold"] = threshold_for_skip_rate([row_initial(r) for r in rows], args.skip_rate)
    stray = sorted(set(given) - taken)
    if stray:
        print(f"svrmad replay: {args.method} takes no {', '.join('--' + s.replace('_', '-') for s in stray)}",
              file=sys.stderr)
        return 2
    try:
        results = asyncio.run(replay_all(rows, args.method, given))
    except MissingDebate as exc:
        print(f"svrmad replay: {exc}", file=sys.stderr)
        return 1
    summary = {"method": args.method, **totals(results)}
    if args.json:
        for row, r in zip(rows, results):
            line = {"id": row["id"], "answer": r.answer, "correct": r.correct, "ncomm": r.ncomm,
                    "tokens": r.tokens}
            if r.accepted is not None:
                line["accepted"] = r.accepted
            print(json.dumps(line))
        print(json.dumps(summary))
        return 0
    print(f"{'id':<24} {'answer':<16} {'correct':<8} {'ncomm':>6} {'tokens':>9}")
    for row, r in zip(rows, results):
        print(f"{str(row['id'])[:24]:<24} {str(r.answer)[:16]:<16} {str(r.correct):<8} "
              f"{r.ncomm:>6} {r.tokens:>9}")
    print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in summary.items()))
    return 0
