"""S2-MAD (Zeng et al.), answer-equivalence mode: prune redundant links, silence idle agents.

An agent hears only peers whose current view differs from its own; an agent left with nothing to
hear does not speak that round (it keeps its response, no call). With answer equivalence, which is
transitive, that silences everyone or no one, so the savings come from the pruned links and the
consensus stop. `peers="distinct"` also filters the redundancy among the peers heard (the original's
redundancy filtering): one representative, the lowest-indexed, per distinct view. The embedding
mode of the original is a hook: pass `embed`."""

from __future__ import annotations

import asyncio
import math
from typing import Callable, Sequence

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods.base import MethodResult, debate_rounds, equivalent, finish, group

PEERS = ("all", "distinct")


def _cosine(u: Sequence[float], v: Sequence[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    norm = math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v))
    return dot / norm if norm else 0.0


async def run(q: Question, initial: Sequence[Response], backend: Backend, *, rounds: int = 2,
              consensus: int = 5, peers: str = "all",
              embed: Callable[[str], Sequence[float]] | None = None,
              sim_threshold: float = 0.9) -> MethodResult:
    """peers: "all" - an agent hears every peer whose view differs from its own; "distinct" - one
    per distinct view among those (the lowest-indexed agent holding it: agents are exchangeable
    samples, so this is a reproducible arbitrary pick that needs no prior signal, which S2-MAD
    does not use, and every agent hears the same representative of a view).
    embed/sim_threshold: when `embed` is given, two responses are "the same view" when the cosine
    similarity of embed(text) is >= sim_threshold, instead of answer equivalence."""
    if peers not in PEERS:
        raise ValueError(f"s2-mad: peers must be one of {', '.join(PEERS)}, got {peers!r}")
    n = len(initial)
    vectors: dict[str, Sequence[float]] = {}

    def same_view(a: Response, b: Response) -> bool:
        if embed is None:
            return equivalent(a.answer, b.answer, q.answer_type)
        for r in (a, b):
            if r.id not in vectors:
                vectors[r.id] = embed(r.text)
        return _cosine(vectors[a.id], vectors[b.id]) >= sim_threshold

    def heard_by(i: int, cur: list[Response]) -> list[int]:
        others = [j for j in range(n) if j != i and not same_view(cur[i], cur[j])]
        if peers == "all":
            return others
        return [others[g[0]] for g in group([cur[j] for j in others], same_view)]

    async def step(cur: list[Response], t: int):
        hear = {i: heard_by(i, cur) for i in range(n)}
        speakers = [i for i in range(n) if hear[i]]
        outs = await asyncio.gather(*(
            backend.debate(q, cur[i], [cur[j] for j in hear[i]]) for i in speakers))
        new = list(cur)
        for i, out in zip(speakers, outs):
            new[i] = out
        return new, list(outs), sum(len(h) for h in hear.values())

    answer, debates, ncomm, ran = await debate_rounds(q, initial, step, rounds=rounds,
                                                      consensus=consensus)
    return finish("s2-mad", q, initial, debates, answer, ncomm=ncomm,
                  params={"rounds": rounds, "consensus": consensus, "peers": peers,
                          "mode": "answer" if embed is None else "embedding", "rounds_run": ran})
