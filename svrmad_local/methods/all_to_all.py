"""All-to-all MAD (Du et al.): every agent reads every peer's full response each round.

Round t uses the round t-1 responses (own and peers), so round 1's calls have the same ids as
SID-ET's debated questions and a caching backend computes them once."""

from __future__ import annotations

import asyncio
from typing import Sequence

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods.base import MethodResult, debate_rounds, finish


async def run(q: Question, initial: Sequence[Response], backend: Backend, *, rounds: int = 2,
              consensus: int = 5) -> MethodResult:
    """NComm counts one link per (sender, receiver) per round: N*(N-1) a round."""
    n = len(initial)

    async def step(cur: list[Response], t: int):
        outs = await asyncio.gather(*(
            backend.debate(q, cur[i], [cur[j] for j in range(n) if j != i]) for i in range(n)))
        return list(outs), list(outs), n * (n - 1)

    answer, debates, ncomm, ran = await debate_rounds(q, initial, step, rounds=rounds,
                                                      consensus=consensus)
    return finish("all-to-all", q, initial, debates, answer, ncomm=ncomm,
                  params={"rounds": rounds, "consensus": consensus, "rounds_run": ran})
