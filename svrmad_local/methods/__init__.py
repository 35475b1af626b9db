"""The method registry: name -> `async run(q, initial, backend, **params) -> MethodResult`.

Ablations of SVR-MAD (Appendix B) are named "svr-mad:<posterior signal>". "s2-mad:distinct" is
S2-MAD hearing one peer per distinct answer: a name of its own, so one live run can record both
S2-MAD variants' debates and each replays. Every method is pure control flow against the
`Backend` protocol, so the same code runs live, replayed or scripted."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Awaitable, Callable

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods import all_to_all, group_debate, s2_mad, self_consistency, sid_et, svr_mad
from svrmad_local.methods.base import MethodResult

Method = Callable[..., Awaitable[MethodResult]]

METHODS: dict[str, Method] = {
    "svr-mad": svr_mad.run,
    "self-consistency": self_consistency.run,
    "all-to-all": all_to_all.run,
    "group-debate": group_debate.run,
    "sid-et": sid_et.run,
    "s2-mad": s2_mad.run,
    "s2-mad:distinct": partial(s2_mad.run, peers="distinct"),
    **{f"svr-mad:{p}": partial(svr_mad.run, posterior=p) for p in svr_mad.POSTERIORS if p != "svr"},
}


def accepted_params(name: str) -> set[str]:
    """The keyword parameters method `name` takes (so a caller can pass only those)."""
    sig = inspect.signature(METHODS[name])
    return {p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


async def run_method(name: str, q: Question, initial: list[Response], backend: Backend,
                     **params: Any) -> MethodResult:
    """Run a registered method and label its result with the registry name."""
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    result = await METHODS[name](q, initial, backend, **params)
    result.method = name
    return result


__all__ = ["METHODS", "MethodResult", "accepted_params", "run_method"]
