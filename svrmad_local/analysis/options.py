"""The method options `svrmad run` and `svrmad replay` share, and how they reach the methods.

Every option defaults to None, "the method's own default", which is read from the method's
signature (and shown in the help), so no default is repeated here; an option reaches only the
methods that take it (`accepted_params`). No torch here: replay and report start fast.
"""

from __future__ import annotations

import argparse
import inspect
import math
from dataclasses import dataclass
from typing import Any

from svrmad_local.grading import GRADERS
from svrmad_local.methods import METHODS, accepted_params



# ---------------------------------------------------------------- method options (run and replay)

@dataclass(frozen=True)
class MethodOption:
    flag: str
    keyword: str  # the method's keyword argument
    kwargs: dict
    help: str


METHOD_OPTIONS = (
    MethodOption("--S", "S", {"type": int}, "SVR-MAD: challengers per iteration"),
    MethodOption("--C", "C", {"type": int}, "SVR-MAD: debates a receiver needs before acceptance"),
    MethodOption("--budget", "budget", {"type": int}, "SVR-MAD: B_max (None = S*(k+m))"),
    MethodOption("--tau", "tau", {"type": float}, "SVR-MAD: acceptance threshold on the posterior"),
    MethodOption("--check", "check", {"choices": ["each", "round"]}, "SVR-MAD: when acceptance is tested"),
    MethodOption("--spend", "spend", {"choices": ["S", "actual"]}, "SVR-MAD: budget charged per iteration"),
    MethodOption("--prior", "prior", {"choices": None}, "SVR-MAD: the signal Corr starts from"),
    MethodOption("--no-repeat-pairs", "repeat_pairs", {"action": "store_false"},
                 "SVR-MAD: debate each (sender, receiver) pair at most once"),
    MethodOption("--accept-exhausted", "accept_exhausted", {"action": "store_true"},
                 "SVR-MAD: accept a receiver that heard every disagreeing peer, even if fewer than C"),
    MethodOption("--rounds", "rounds", {"type": int}, "round-based methods: at most this many rounds"),
    MethodOption("--consensus", "consensus", {"type": int}, "round-based methods: stop when this many agree"),
    MethodOption("--groups", "groups", {}, 'GroupDebate: split, "3-3" or "2-2-2"'),
    MethodOption("--ncomm-brief", "ncomm_brief", {"choices": ["each", "none"]},
                 "GroupDebate: whether answer-only transfers count in NComm"),
    MethodOption("--s2-peers", "peers", {"choices": ["all", "distinct"]},
                 "S2-MAD: hear every disagreeing peer, or one per distinct answer"),
    MethodOption("--threshold", "threshold", {"type": float}, "SID-ET: min-LL threshold (overrides --skip-rate)"),
    MethodOption("--skip-answer", "skip_answer", {"choices": ["agent", "majority"]},
                 "SID-ET: a skipped question's answer"),
)
_BY_KEYWORD = {o.keyword: o for o in METHOD_OPTIONS}


def method_default(keyword: str) -> Any:
    """The default of `keyword` in the first registered method that takes it (inspect.Parameter.empty
    when none does yet)."""
    for fn in METHODS.values():
        p = inspect.signature(fn).parameters.get(keyword)
        if p is not None and p.kind is inspect.Parameter.KEYWORD_ONLY:
            return p.default
    return inspect.Parameter.empty


def method_flag(keyword: str) -> str:
    return _BY_KEYWORD[keyword].flag if keyword in _BY_KEYWORD else keyword


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    """The method options of `svrmad run` and `svrmad replay`. Every default is None ("the method's
    own default", shown in the help), so only what a user gives reaches a method."""
    from svrmad_local.signals import PRIORS

    g = p.add_argument_group("method options (each goes only to the methods that take it)")
    for o in METHOD_OPTIONS:
        kwargs = dict(o.kwargs)
        if o.keyword == "prior":
            kwargs["choices"] = sorted(PRIORS)
        default = method_default(o.keyword)
        shown = "" if default is inspect.Parameter.empty or kwargs.get("action") else f" (default {default})"
        g.add_argument(o.flag, dest=o.keyword, default=None, help=o.help + shown, **kwargs)
    g.add_argument("--skip-rate", type=float, default=None,
                   help="SID-ET: skip this fraction of questions (default: tuned against SVR-MAD, Algorithm 2)")
    g.add_argument("--grader", choices=GRADERS, default=None, help="answer grading (default ours)")


def check_method_options(options: dict[str, Any], skip_rate: float | None = None) -> list[str]:
    """What is wrong with the given method options (`svrmad run` and `svrmad replay` alike): counts
    below 1, thresholds that are not finite numbers (NaN compares false, so it would silently never
    accept or never skip) or off their scale, a skip rate outside [0, 1]."""
    p = []
    for key in ("S", "C", "budget", "rounds", "consensus"):
        if options.get(key) is not None and options[key] < 1:
            p.append(f"{method_flag(key)} must be >= 1, got {options[key]}")
    for key in ("tau", "threshold"):
        if options.get(key) is not None and not math.isfinite(options[key]):
            p.append(f"{method_flag(key)} must be a finite number, got {options[key]}")
    # past these a run would go on silently never accepting (tau) or never skipping (threshold)
    if options.get("tau") is not None and math.isfinite(options["tau"]) and not -1 <= options["tau"] <= 1:
        p.append(f"--tau must be in [-1, 1], the posterior's scale (SVR: 1 = survived every challenge), "
                 f"got {options['tau']}")
    if options.get("threshold") is not None and math.isfinite(options["threshold"]) and options["threshold"] > 0:
        p.append(f"--threshold is a min-LL, a log-probability (<= 0), got {options['threshold']}")
    if skip_rate is not None and not 0 <= skip_rate <= 1:
        p.append(f"--skip-rate must be in [0, 1], got {skip_rate}")
    return p


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options given on the command line, as method keywords."""
    return {o.keyword: getattr(args, o.keyword) for o in METHOD_OPTIONS if getattr(args, o.keyword, None) is not None}


def stray_options(methods: list[str], options: dict[str, Any]) -> list[str]:
    """Flags of `options` that none of `methods` takes."""
    taken = set().union(*(accepted_params(m) for m in methods)) if methods else set()
    return [method_flag(k) for k in options if k not in taken]


def parse_methods(text: str) -> list[str]:
    names = list(METHODS) if text == "all" else [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    if not names:
        raise ValueError("--methods names no method")
    return list(dict.fromkeys(names))
