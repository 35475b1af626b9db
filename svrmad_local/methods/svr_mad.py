"""SVR-MAD (the paper's Algorithm 1): posterior-guided pairwise debates with early acceptance.

Every debate is one sender's *pre-debate* response shown to one receiver's *pre-debate* context,
so a (sender, receiver) pair is one cacheable call whatever the iteration that asks for it. The
receiver's score is its prior until it has been challenged, then its survival rate
SVR = (retained - changed) / debates (posterior-dominant). Choices the paper leaves open are
parameters here and are listed in docs/methods.md.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from svrmad_local.debate.types import Backend, Question, Response
from svrmad_local.methods.base import MethodResult, cluster, equivalent, finish, majority
from svrmad_local.signals import prior_score

POSTERIORS = ("svr", "min_ll", "ppl", "self_conf")


def budget_for(answers: Sequence[str | None], answer_type: str, S: int) -> int:
    """B_max = S * (k + m): k answer clusters (each None answer a cluster of its own), m the size
    of the largest cluster."""
    groups = cluster(answers, answer_type)
    return S * (len(groups) + max((len(g) for g in groups), default=0))


def fallback_vote(initial: Sequence[Response], post: Sequence[Sequence[Response]],
                  answer_type: str) -> tuple[str | None, list[str | None]]:
    """The paper's fallback: each agent votes the majority of its own post-debate answers (its
    pre-debate answer breaks ties and is the vote of an agent never debated, or whose post-debate
    answers are all None); the result is the majority of the votes, ties going to the pre-debate
    majority, then to the tied answer of the lowest-indexed voter. Returns (answer, votes)."""
    y = [r.answer for r in initial]
    votes = []
    for i, mine in enumerate(post):
        v = majority([p.answer for p in mine], answer_type, [y[i]])
        votes.append(y[i] if v is None else v)
    return majority(votes, answer_type, y), votes


async def run(q: Question, initial: Sequence[Response], backend: Backend, *,
              priors: Sequence[float] | None = None, prior: str = "min_ll", S: int = 2, C: int = 2,
              budget: int | None = None, tau: float = 1.0, check: str = "each", spend: str = "S",
              posterior: str = "svr", accept_exhausted: bool = False) -> MethodResult:
    """Run Algorithm 1 on one question.

    priors: Corr's starting values (default: `prior_score(signals, prior)` of each initial response).
    S: challengers per iteration; C: debates a receiver needs before it can be accepted.
    budget: B_max (default S*(k+m)); the loop never runs more than `budget` debates.
    tau: acceptance threshold on the posterior score (SVR: 1.0 = survived every challenge).
    check: "each" tests acceptance after every debate (the paper's prose), "round" after the S.
    spend: "S" charges every iteration S (Algorithm 1 line 14), "actual" its debates.
    posterior: "svr", or an Appendix B ablation signal averaged over the receiver's post-debate
    responses. accept_exhausted: also accept a receiver that passed every disagreeing peer there
    is, even if those are fewer than C.
    """
    if check not in ("each", "round") or spend not in ("S", "actual") or posterior not in POSTERIORS:
        raise ValueError(f"svr-mad: bad check={check!r}, spend={spend!r} or posterior={posterior!r}")
    if S < 1 or C < 1:
        raise ValueError(f"svr-mad: S and C must be >= 1 (S={S}, C={C})")
    n, at = len(initial), q.answer_type
    if priors is not None and len(priors) != n:
        raise ValueError(f"svr-mad: {len(priors)} priors for {n} agents")
    y = [r.answer for r in initial]
    corr = [float(p) for p in priors] if priors is not None else [prior_score(r.signals, prior)
                                                                  for r in initial]
    disagree = [[s for s in range(n) if s != r and not equivalent(y[s], y[r], at)]
                for r in range(n)]
    B = budget_for(y, at, S) if budget is None else int(budget)
    post: list[list[Response]] = [[] for _ in range(n)]  # each agent's responses as receiver
    kept = [0] * n  # retained minus changed
    done: set[tuple[int, int]] = set()  # (sender, receiver) pairs already debated
    debates: list[Response] = []

    def challengers(r: int) -> list[int]:
        return [s for s in disagree[r] if (s, r) not in done]

    def record(s: int, r: int, resp: Response) -> None:
        done.add((s, r))
        debates.append(resp)
        post[r].append(resp)
        kept[r] += 1 if equivalent(resp.answer, y[r], at) else -1
        if posterior == "svr":
            corr[r] = kept[r] / len(post[r])
        else:
            corr[r] = sum(prior_score(p.signals, posterior) for p in post[r]) / len(post[r])

    def accepts(r: int) -> bool:
        d = len(post[r])
        enough = d >= C or (accept_exhausted and d > 0 and not challengers(r))
        return enough and corr[r] >= tau

    spent, winner = 0, None
    while spent < B and winner is None:
        # Receivers: agents with an answer and a disagreeing peer not yet heard; ties -> lowest index.
        cands = [i for i in range(n) if y[i] is not None and challengers(i)]
        if not cands:
            break
        r = max(cands, key=lambda i: (corr[i], -i))
        group = sorted(challengers(r), key=lambda s: (-corr[s], s))[:min(S, B - spent)]
        if check == "each":
            # No acceptance is possible before the receiver has C debates, so the debates up to
            # that point run concurrently; from there on, one at a time with a check after each.
            head = max(1, C - len(post[r]))
            batches = [group[:head]] + [[s] for s in group[head:]]
            for batch in batches:
                outs = await asyncio.gather(*(backend.debate(q, initial[r], [initial[s]]) for s in batch))
                for s, resp in zip(batch, outs):
                    record(s, r, resp)
                if accepts(r):
                    winner = r
                    break
        else:
            outs = await asyncio.gather(*(backend.debate(q, initial[r], [initial[s]]) for s in group))
            for s, resp in zip(group, outs):
                record(s, r, resp)
            winner = r if accepts(r) else None
        spent += S if spend == "S" else len(group)

    answer = y[winner] if winner is not None else fallback_vote(initial, post, at)[0]
    name = "svr-mad" if posterior == "svr" else f"svr-mad:{posterior}"
    params = {"S": S, "C": C, "budget": B, "tau": tau, "check": check, "spend": spend,
              "posterior": posterior}
    return finish(name, q, initial, debates, answer, ncomm=len(debates),
                  accepted=winner is not None, scores=corr, params=params)
