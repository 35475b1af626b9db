"""The live backend: agents are samples of one local model served by the engine.

Every agent's context is kept as chat messages whose contents are exact token runs, so the S
debates of one receiver fork from one cached prefix. For a reasoning model (`models.reasoning`)
each completion is split into hidden reasoning and final response: the answer, the
self-reported confidence and what a peer sees come from the final response, as an API returns
it; completion tokens count both, as an API bills them. The receiver's own earlier turn is its
final response too (`own_turn="final"`, what an API conversation sends back), or the exact
tokens it generated (`own_turn="exact"`: the prompt then extends the very run whose KV was
written while that answer was generated). docs/methods.md, "Reasoning models", has the costs.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from svrmad_local.grading import extract_answer
from svrmad_local.debate.prompts import debate_format, initial_messages
from svrmad_local.debate.types import Question, Response, debate_id
from svrmad_local.engine.engine import Engine
from svrmad_local.engine.config import SamplingParams
from svrmad_local.engine.stats import sequence_signals
from svrmad_local.models.chat import ChatFormat
from svrmad_local.models.reasoning import detect, effort_kwargs
from svrmad_local.signals import parse_self_confidence


def _seed(*parts: object) -> int:
    """A seed from the call's identity, so a rerun (or a resume) draws the same samples whatever
    order the questions are scheduled in."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:7], "big")


OWN_TURNS = ("final", "exact")
SIGNALS_OVER = ("final", "completion")


def model_name(engine: Engine) -> str:
    """How errors name the checkpoint: its folder, else its architecture."""
    cfg = engine.model.config
    return getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(engine.model).__name__


class EngineBackend:
    def __init__(self, engine: Engine, params: SamplingParams | None = None, *, elicit_confidence: bool = True,
                 seed: int = 0, reasoning_effort: str | None = None, own_turn: str = "final",
                 signals_over: str = "final", keep_token_stats: bool = False):
        """`reasoning_effort`: none | low | medium | high through the chat template (None: the
        template's default); `own_turn`: "final" | "exact" (see the module docstring);
        `signals_over`: the span the prior signals (min-LL, PPL, entropy, confidences) are computed
        over for a reasoning model: "final" (the final response: what an API returns logprobs
        for) or "completion" (reasoning included); `keep_token_stats`: each response keeps its
        tokens' log-probs and entropies (whole completion) in `token_stats`, for --save-token-stats."""
        for name, value, allowed in (("own_turn", own_turn, OWN_TURNS), ("signals_over", signals_over, SIGNALS_OVER)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
        self.engine = engine
        kwargs = effort_kwargs(getattr(engine.tokenizer, "chat_template", None), reasoning_effort, model_name(engine))
        self.chat = ChatFormat(engine.tokenizer, engine.eos_ids, kwargs)
        self.reasoning = detect(engine.tokenizer, self.chat.generation_prompt(), self.chat.eos_ids)
        self.params = params or SamplingParams()
        self.elicit = elicit_confidence
        self.seed = seed
        self.own_turn = own_turn
        self.signals_over = signals_over
        self.keep_token_stats = keep_token_stats

    def _parts(self, c) -> tuple[str, str, list[int], bool, dict]:
        """(final response text, reasoning text, final response tokens, whether there is a final
        response, signals) of a completion; a model without a reasoning format answers with all of it."""
        ids = list(c.token_ids)
        if self.reasoning is None:
            return c.text, "", ids, True, dict(c.signals)
        s, tok = self.reasoning.split(ids), self.engine.tokenizer
        signals = dict(c.signals) if self.signals_over == "completion" else sequence_signals(
            c.logprobs[s.start:s.end], c.entropies[s.start:s.end], c.topk_logprobs[s.start:s.end], self.engine.cfg.signals)
        return (tok.decode(ids[s.start:s.end], skip_special_tokens=True), tok.decode(ids[:s.start], skip_special_tokens=False),
                ids[s.start:s.end], s.final, signals)

    def _response(self, rid: str, agent: int, q: Question, c, prompt_len: int, computed: int, context: list,
                  round_: int = 0, peers=(), brief=()) -> Response:
        text, reasoning, final_tokens, final, signals = self._parts(c)
        signals["self_conf"] = parse_self_confidence(text) if final else None
        return Response(
            id=rid, agent=agent, answer=extract_answer(text, q.answer_type, q.choices) if final else None, text=text,
            tokens=list(c.token_ids), signals=signals, prompt_tokens=prompt_len,
            completion_tokens=len(c.token_ids), computed_tokens=computed, round=round_,
            peers=tuple(peers), brief=tuple(brief), context=context, reasoning=reasoning,
            final_tokens=final_tokens, final=final, finish_reason=c.finish_reason,
            token_stats=(np.asarray(c.logprobs, np.float32), np.asarray(c.entropies, np.float32))
            if self.keep_token_stats else None,
        )

    def _own_turn(self, own: Response) -> dict:
        """The receiver's earlier answer as an assistant message of its next prompt."""
        if self.own_turn == "exact":
            return {"role": "assistant", "content": own.tokens, "generated": True}
        return {"role": "assistant", "content": own.final_tokens}

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
            self._own_turn(own),
            {"role": "user", "content": debate_format(q, list(peers), list(brief), self.elicit)},
        ]
        prompt = self.chat.encode(messages)
        if len(prompt) >= self.engine.max_model_len:
            return self._context_overflow(rid, own, peers, brief, messages)
        out = await self.engine.generate(prompt, replace(self.params, n=1, seed=_seed(self.seed, q.id, rid)))
        return self._response(rid, own.agent, q, out.completions[0], len(prompt), out.usage.computed_tokens,
                              messages, own.round + 1, [p.id for p in peers], [b.id for b in brief])

    @staticmethod
    def _context_overflow(rid: str, own: Response, peers, brief, messages: list) -> Response:
        """A debate whose prompt outgrew the model's context is not sent (an API would refuse it):
        the receiver gives no answer, as when its answer cannot be parsed, and nothing is billed
        (docs/formats.md, "finish_reason")."""
        return Response(id=rid, agent=own.agent, answer=None, round=own.round + 1, peers=tuple(p.id for p in peers),
                        brief=tuple(b.id for b in brief), context=messages, finish_reason="context")
