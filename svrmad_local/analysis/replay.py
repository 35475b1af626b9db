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

from svrmad_local.analysis.options import add_method_arguments, check_method_options, method_options, stray_options
from svrmad_local.debate.replay_backend import MissingDebate, ReplayBackend
from svrmad_local.debate.trace import read_trace, row_initial, row_priors, row_question
from svrmad_local.methods import METHODS, MethodResult, accepted_params, run_method
from svrmad_local.methods.sid_et import threshold_for_skip_rate, tune_skip_rate

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace.jsonl of a run")
    p.add_argument("--method", default="svr-mad", choices=list(METHODS))
    p.add_argument("--json", action="store_true", help="one JSON object per question, then totals")
    p.add_argument("--seed", type=int, help="GroupDebate grouping seed (default: the method's, as `svrmad run --seed 0`)")
    add_method_arguments(p)


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


def sid_et(rows: list[dict], params: dict[str, Any], reference: dict[str, Any],
           skip_rate: float | None = None) -> tuple[list[MethodResult], float | None, float | None]:
    """SID-ET over a trace as Appendix A runs it: the threshold is `params["threshold"]` if given,
    else the one that skips `skip_rate` of these questions, else the skip rate Algorithm 2 picks
    against SVR-MAD replayed with `reference`. Returns (results, skip rate, threshold)."""
    initials = [row_initial(r) for r in rows]
    params = {k: v for k, v in params.items() if k in accepted_params("sid-et")}

    def at(rate: float) -> tuple[list[MethodResult], float | None]:
        thr = threshold_for_skip_rate(initials, rate)
        return asyncio.run(replay_all(rows, "sid-et", {**params, "threshold": thr})), thr

    if params.get("threshold") is not None:
        return asyncio.run(replay_all(rows, "sid-et", params)), None, params["threshold"]
    if skip_rate is None:
        ref = totals(asyncio.run(replay_all(rows, "svr-mad", reference)))

        def evaluate(rate: float) -> tuple[float, float]:
            t = totals(at(rate)[0])
            return t["tokens_mean"], t["accuracy"]

        skip_rate = tune_skip_rate(evaluate, ref["tokens_mean"], ref["accuracy"])
    results, thr = at(skip_rate)
    return results, skip_rate, thr


def main(args: argparse.Namespace) -> int:
    rows = read_trace(args.trace)
    given = method_options(args)
    if args.seed is not None:
        given["seed"] = args.seed
    stray = stray_options([args.method], given)
    if args.skip_rate is not None and args.method != "sid-et":
        stray.append("--skip-rate")
    if stray:
        print(f"svrmad replay: {args.method} takes no {', '.join(stray)}", file=sys.stderr)
        return 2
    bad = check_method_options(given, args.skip_rate)
    if bad:
        raise ValueError("; ".join(bad))
    try:
        if args.method == "sid-et":
            reference = {k: v for k, v in given.items() if k in accepted_params("svr-mad")}
            results = sid_et(rows, given, reference, args.skip_rate)[0]
        else:
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
