"""The live backend: agents are samples of one local model served by the engine.

Every agent's context is kept as chat messages whose assistant turns are the exact tokens it
generated, so a debate prompt starts with the very token run ([question + own answer]) whose KV
the engine wrote while that answer was generated, and the S debates of one receiver fork from it.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from svrmad_local.debate.answers import extract_answer
from svrmad_local.debate.prompts import debate_format, initial_messages
from svrmad_local.debate.types import Question, Response, debate_id
from svrmad_local.engine.engine import Engine
from svrmad_local.engine.params import SamplingParams
from svrmad_local.models.chat import ChatFormat
from svrmad_local.signals import parse_self_confidence


def _seed(*parts: object) -> int:
    """A seed from the call's identity, so a rerun (or a resume) draws the same samples whatever
    order the questions are scheduled in."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:7], "big")


class EngineBackend:
    def __init__(self, engine: Engine, params: SamplingParams | None = None, *, elicit_confidence: bool = True,
                 seed: int = 0):
        self.engine = engine
        self.chat = ChatFormat(engine.tokenizer, engine.eos_ids)
        self.params = params or SamplingParams()
        self.elicit = elicit_confidence
        self.seed = seed

    def _response(self, rid: str, agent: int, q: Question, c, prompt_len: int, computed: int, context: list,
                  round_: int = 0, peers=(), brief=()) -> Response:
        signals = dict(c.signals)
        signals["self_conf"] = parse_self_confidence(c.text)
        return Response(
            id=rid, agent=agent, answer=extract_answer(c.text, q.answer_type, q.choices), text=c.text,
            tokens=list(c.token_ids), signals=signals, prompt_tokens=prompt_len,
            completion_tokens=len(c.token_ids), computed_tokens=computed, round=round_,
            peers=tuple(peers), brief=tuple(brief), context=context,
        )

    async def initial(self, q: Question, n: int) -> list[Response]:
        messages = initial_messages(q, self.elicit)
        prompt = self.chat.encode(messages)
        out = await self.engine.generate(prompt, replace(self.params, n=n, seed=_seed(self.seed, q.id, "initial")))
        # the prompt is computed once for all n agents: split what was computed evenly (sum exact)
        comp = out.usage.computed_tokens
        shares = [comp // n + (1 if i < comp % n else 0) for i in range(n)]
        return [self._response(str(i), i, q, c, len(prompt), shares[i], messages)
                for i, c in enumerate(out.completions)]

    async def debate(self, q: Question, own: Response, peers, brief=(), *, repeat: int = 1) -> Response:
        """A repeat (repeat > 1) has the first's prompt token for token, so the engine serves it
        from the KV-cache; its seed comes from its own id, so it is a new sample."""
        if own.context is None:
            raise ValueError(f"question {q.id}: response {own.id} has no context to continue (recorded, not live?)")
        rid = debate_id(own.id, [p.id for p in peers], [b.id for b in brief], repeat)
        messages = own.context + [
            {"role": "assistant", "content": own.tokens},
            {"role": "user", "content": debate_format(q, list(peers), list(brief), self.elicit)},
        ]
        prompt = self.chat.encode(messages)
        out = await self.engine.generate(prompt, replace(self.params, n=1, seed=_seed(self.seed, q.id, rid)))
        return self._response(rid, own.agent, q, out.completions[0], len(prompt), out.usage.computed_tokens,
                              messages, own.round + 1, [p.id for p in peers], [b.id for b in brief])
