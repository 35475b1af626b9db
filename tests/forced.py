"""A real engine whose samples are given: for testing what happens to a completion of a known
shape (reasoning, final response, truncation), which a tiny random model never produces.

`ForcedEngine.generate` first runs the prompt through the engine (so `computed_tokens` is what the
engine really computed for it, after reuse of the KV-cache), then teacher-forces each scripted
completion after it (`Engine.score`): its logprobs are the model's, and its KV is cached like a
generated one, so a later prompt that extends [prompt + completion] finds it.
"""

from __future__ import annotations

from dataclasses import replace

from svrmad_local.engine.params import SamplingParams
from svrmad_local.engine.sequence import Completion, RequestOutput, Usage


class ForcedEngine:
    def __init__(self, engine, script):
        """`script(prompt_ids, index) -> (completion ids, finish_reason)`."""
        self.engine, self.script = engine, script
        self.tokenizer, self.eos_ids, self.model, self.cfg = engine.tokenizer, engine.eos_ids, engine.model, engine.cfg
        self.max_model_len = engine.max_model_len
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, params: SamplingParams) -> RequestOutput:
        self.prompts.append(list(prompt))
        first = await self.engine.generate(prompt, replace(params, n=1, max_tokens=1))
        usage = Usage(prompt_tokens=len(prompt) * params.n, computed_tokens=first.usage.computed_tokens)
        comps = []
        for i in range(params.n):
            ids, reason = self.script(list(prompt), i)
            s = await self.engine.score(list(prompt), ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            comps.append(Completion(i, list(ids), text, reason, s.logprobs, s.entropies, s.topk_logprobs,
                                    s.topk_ids, s.signals))
            usage.generated_tokens += len(ids)
        return RequestOutput(0, list(prompt), comps, usage)
