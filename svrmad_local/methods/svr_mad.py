"""SVR-MAD (the paper's Algorithm 1): posterior-guided pairwise debates with early acceptance.

Every debate is one sender's *pre-debate* response shown to one receiver's *pre-debate* context.
As Algorithm 1 is written, each iteration debates the top S of the receiver's disagreeing peers,
debated before or not: a pair chosen again is a new, independent debate (the same prompt, served
from the KV-cache, and a new sample). The receiver's score is its prior until it has been
challenged, then its survival rate SVR = (retained - changed) / debates (posterior-dominant).
Choices the paper leaves open are parameters here and are listed in docs/methods.md.
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


def _disagree(y: Sequence[str | None], answer_type: str) -> list[list[int]]:
    """disagree[r]: the agents whose pre-debate answer is not equivalent to agent r's."""
    return [[s for s in range(len(y)) if s != r and not equivalent(y[s], y[r], answer_type)]
            for r in range(len(y))]


def possible_debates(answers: Sequence[str | None], answer_type: str, *, S: int = 2,
                     budget: int | None = None, spend: str = "S",
                     repeat_pairs: bool = True) -> list[tuple[int, int, int]]:
    """Every (sender, receiver, repeat) debate that `run` with these S/budget/spend/repeat_pairs
    (same defaults) may ask for, whatever its tau, C, check, priors or posterior: each
    disagreeing ordered pair with an answering receiver, repeated up to the number of iterations
    the budget allows (ceil(B/S) charged S each, B charged per debate). `svrmad run --ablations`
    records them so every Appendix B variant replays."""
    B = budget_for(answers, answer_type, S) if budget is None else int(budget)
    most = min(B, 1) if not repeat_pairs else (-(-B // S) if spend == "S" else B)
    pairs = [(s, r) for r, ds in enumerate(_disagree(answers, answer_type))
             if answers[r] is not None for s in ds]
    return [(s, r, k) for k in range(1, max(most, 0) + 1) for s, r in pairs]


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
              posterior: str = "svr", repeat_pairs: bool = True,
              accept_exhausted: bool = False) -> MethodResult:
    """Run Algorithm 1 on one question.

    priors: Corr's starting values (default: `prior_score(signals, prior)` of each initial response).
    S: challengers per iteration; C: debates a receiver needs before it can be accepted.
    budget: B_max (default S*(k+m)); the loop never runs more than `budget` debates.
    tau: acceptance threshold on the posterior score (SVR: 1.0 = survived every challenge).
    check: "each" tests acceptance after every debate (the paper's prose), "round" after the S.
    spend: "S" charges every iteration S (Algorithm 1 line 14), "actual" its debates.
    posterior: "svr", or an Appendix B ablation signal averaged over the receiver's post-debate
    responses.
    repeat_pairs: Algorithm 1 as written (True): every iteration debates the top S of all the
    receiver's disagreeing peers, a pair chosen again being a new debate (`repeat` k, id "r<s#k").
    False: a pair is debated at most once, and a receiver whose disagreeing peers are all heard
    passes the turn. accept_exhausted: also accept a receiver that has heard every disagreeing
    peer there is (at least once), even if those debates are fewer than C.
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
    disagree = _disagree(y, at)
    B = budget_for(y, at, S) if budget is None else int(budget)
    post: list[list[Response]] = [[] for _ in range(n)]  # each agent's responses as receiver
    kept = [0] * n  # retained minus changed
    times: dict[tuple[int, int], int] = {}  # (sender, receiver) -> debates so far
    debates: list[Response] = []

    def challengers(r: int) -> list[int]:
        """The receiver's candidate challengers, strongest first (ties: lowest index)."""
        peers = [s for s in disagree[r] if repeat_pairs or (s, r) not in times]
        return sorted(peers, key=lambda s: (-corr[s], s))

    def exhausted(r: int) -> bool:
        return all((s, r) in times for s in disagree[r])

    def ask(s: int, r: int):
        times[s, r] = times.get((s, r), 0) + 1
        return backend.debate(q, initial[r], [initial[s]], repeat=times[s, r])

    def record(r: int, resp: Response) -> None:
        debates.append(resp)
        post[r].append(resp)
        kept[r] += 1 if equivalent(resp.answer, y[r], at) else -1
        if posterior == "svr":
            corr[r] = kept[r] / len(post[r])
        else:
            corr[r] = sum(prior_score(p.signals, posterior) for p in post[r]) / len(post[r])

    def accepts(r: int) -> bool:
        d = len(post[r])
        enough = d >= C or (accept_exhausted and d > 0 and exhausted(r))
        return enough and corr[r] >= tau

    # a backend that can run debates ahead (RecordingBackend with run_ahead) hears which come next
    prefetch = getattr(backend, "prefetch", None)
    spent, winner = 0, None
    while spent < B and winner is None:
        # Receivers: agents with an answer and a challenger left; ties -> lowest index.
        cands = [i for i in range(n) if y[i] is not None and challengers(i)]
        if not cands:
            break
        r = max(cands, key=lambda i: (corr[i], -i))
        group = challengers(r)[:min(S, B - spent)]
        if check == "each":
            # No acceptance is possible before the receiver has C debates, so the debates up to
            # that point run concurrently; from there on, one at a time with a check after each.
            head = max(1, C - len(post[r]))
            batches = [group[:head]] + [[s] for s in group[head:]]
            if prefetch is not None:  # the rest of this group, in case no check accepts first
                for s in group[head:]:
                    prefetch(q, initial[r], [initial[s]], repeat=times.get((s, r), 0) + 1)
            for batch in batches:
                for resp in await asyncio.gather(*(ask(s, r) for s in batch)):
                    record(r, resp)
                if accepts(r):
                    winner = r
                    break
        else:
            for resp in await asyncio.gather(*(ask(s, r) for s in group)):
                record(r, resp)
            winner = r if accepts(r) else None
        spent += S if spend == "S" else len(group)

    answer = y[winner] if winner is not None else fallback_vote(initial, post, at)[0]
    name = "svr-mad" if posterior == "svr" else f"svr-mad:{posterior}"
    params = {"S": S, "C": C, "budget": B, "tau": tau, "check": check, "spend": spend,
              "posterior": posterior, "repeat_pairs": repeat_pairs}
    return finish(name, q, initial, debates, answer, ncomm=len(debates),
                  accepted=winner is not None, scores=corr, params=params)
