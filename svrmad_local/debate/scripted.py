"""Scripted agents: a `Backend` whose answers are written by the test, for controllers without a model.

Token counts grow like a real debate's context (own context + peers' responses), so methods'
token accounting can be checked by hand; every call is recorded in `calls`.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Mapping, Sequence, Union

from svrmad_local.debate.types import Question, Response, debate_id

# (receiver, own response, peers, brief) -> the receiver's new answer
OutcomeFn = Callable[[int, Response, Sequence[Response], Sequence[Response]], "str | None"]
SignalsSpec = Union[Sequence[dict], Mapping[str, dict], Callable[[Response], dict], None]


class ScriptedBackend:
    """initial_answers: agent i's initial answer is initial_answers[i].
    outcomes: {(sender, receiver): new answer} for pairwise debates of initial responses (every
    repeat), {(sender, receiver, k): new answer} for the k-th of them only (k = 1 the first),
    and/or {response id: new answer} for any debate ("0<5#2" a repeat), or a callable
    (receiver, own, peers, brief) -> answer (which sees no repeat number: same answer every time).
    A debate the script does not cover keeps the receiver's answer (retained).
    signals: per-agent initial signals (a list), signals by response id (a dict) or a callable
    (response) -> signals. Token counts: an initial response bills `prompt_tokens` and generates
    `completion_tokens`; a debate bills its own context (own prompt + own completion) plus
    `brief_tokens` per answer-only peer plus each full peer's completion, of which only the part
    after its own context is computed (prefix reuse); a repeat computes nothing (its prompt is the
    first's, cached)."""

    def __init__(self, initial_answers: Sequence[str | None],
                 outcomes: Mapping | OutcomeFn | None = None, signals: SignalsSpec = None, *,
                 prompt_tokens: int = 100, completion_tokens: int = 50, brief_tokens: int = 5):
        self.initial_answers = list(initial_answers)
        self.outcomes = outcomes if outcomes is not None else {}
        self.signals = signals
        self.prompt_tokens, self.completion_tokens = prompt_tokens, completion_tokens
        self.brief_tokens = brief_tokens
        self.calls: list[str] = []  # response ids of the debates asked for, in order

    def _signals(self, r: Response) -> dict:
        s = self.signals
        if s is None:
            return {}
        if callable(s):
            return dict(s(r))
        if isinstance(s, Mapping):
            return dict(s.get(r.id, {}))
        return dict(s[r.agent]) if r.round == 0 else {}

    def _answer(self, own: Response, peers: Sequence[Response], brief: Sequence[Response],
                rid: str, repeat: int) -> str | None:
        o = self.outcomes
        if callable(o):
            return o(own.agent, own, peers, brief)
        if rid in o:
            return o[rid]
        if len(peers) == 1 and not brief and own.round == 0 and peers[0].round == 0:
            pair = (peers[0].agent, own.agent)
            return o.get((*pair, repeat), o.get(pair, own.answer))
        return own.answer

    async def initial(self, q: Question, n: int) -> list[Response]:
        if n > len(self.initial_answers):
            raise ValueError(f"scripted backend has {len(self.initial_answers)} agents, asked {n}")
        out = []
        for i in range(n):
            r = Response(id=str(i), agent=i, answer=self.initial_answers[i],
                         text=f"agent {i} says {self.initial_answers[i]}",
                         prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         computed_tokens=self.prompt_tokens)
            r.signals = self._signals(r)
            out.append(r)
        return out

    async def debate(self, q: Question, own: Response, peers: Sequence[Response],
                     brief: Sequence[Response] = (), *, repeat: int = 1) -> Response:
        await asyncio.sleep(0)  # yield like a real backend, so concurrent callers interleave
        rid = debate_id(own.id, [p.id for p in peers], [b.id for b in brief], repeat)
        self.calls.append(rid)
        answer = self._answer(own, peers, brief, rid, repeat)
        new = sum(p.completion_tokens for p in peers) + self.brief_tokens * len(brief)
        r = Response(id=rid, agent=own.agent, answer=answer,
                     text=f"agent {own.agent} after {rid} says {answer}",
                     prompt_tokens=own.tokens_total + new, completion_tokens=self.completion_tokens,
                     computed_tokens=new if repeat == 1 else 0, round=own.round + 1,
                     peers=tuple(p.id for p in peers), brief=tuple(b.id for b in brief))
        r.signals = self._signals(r)
        return r
