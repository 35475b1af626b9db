"""GroupDebate (Liu et al.): full responses inside random groups, final answers across them.

Groups are drawn once per question from a generator seeded by (question id, seed), so a rerun or
a replay forms the same groups and asks for the same debate ids."""

from __future__ import annotations

import asyncio
import random
from typing import Sequence

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods.base import MethodResult, debate_rounds, finish


def make_groups(q: Question, n: int, groups: str, seed: int) -> list[list[int]]:
    """Split agents 0..n-1 into groups of the sizes in `groups` ("3-3", "2-2-2"), members sorted."""
    sizes = [int(s) for s in groups.split("-")]
    if sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"group-debate: groups {groups!r} do not split {n} agents")
    order = list(range(n))
    random.Random(f"{q.id}:{seed}").shuffle(order)
    out, start = [], 0
    for size in sizes:
        out.append(sorted(order[start:start + size]))
        start += size
    return out


async def run(q: Question, initial: Sequence[Response], backend: Backend, *, groups: str = "3-3",
              seed: int = 0, rounds: int = 2, consensus: int = 5,
              ncomm_brief: str = "none") -> MethodResult:
    """ncomm_brief: "each" counts an answer-only transfer as one link like a full one (N*(N-1)
    links a round), "none" counts only the full transfers inside groups."""
    if ncomm_brief not in ("each", "none"):
        raise ValueError(f"group-debate: bad ncomm_brief={ncomm_brief!r}")
    n = len(initial)
    split = make_groups(q, n, groups, seed)
    mates = {i: [j for j in g if j != i] for g in split for i in g}
    others = {i: [j for j in range(n) if j not in mates[i] and j != i] for i in range(n)}

    async def step(cur: list[Response], t: int):
        outs = await asyncio.gather(*(
            backend.debate(q, cur[i], [cur[j] for j in mates[i]], [cur[j] for j in others[i]])
            for i in range(n)))
        links = sum(len(mates[i]) + (len(others[i]) if ncomm_brief == "each" else 0)
                    for i in range(n))
        return list(outs), list(outs), links

    answer, debates, ncomm, ran = await debate_rounds(q, initial, step, rounds=rounds,
                                                      consensus=consensus)
    return finish("group-debate", q, initial, debates, answer, ncomm=ncomm,
                  params={"groups": groups, "seed": seed, "rounds": rounds,
                          "consensus": consensus, "ncomm_brief": ncomm_brief, "rounds_run": ran,
                          "split": split})
