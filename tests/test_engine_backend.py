"""The live backend on the real engine (tiny random model): a repeated debate is the same prompt,
served from the KV-cache, and a new sample."""

import asyncio

from svrmad_local.debate.engine_backend import EngineBackend
from svrmad_local.debate.types import Question
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams


def test_a_repeat_is_a_cached_prompt_and_a_new_sample(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, EngineConfig(kv_cache_memory=8 * 2**20, block_size=4))
    backend = EngineBackend(eng, SamplingParams(max_tokens=12), elicit_confidence=False)
    q = Question(id="q", question="What is 2 + 3?", gold="5")

    async def go():
        initial = await backend.initial(q, 2)
        first = await backend.debate(q, initial[0], [initial[1]])
        before = eng.totals.computed_tokens
        again = await backend.debate(q, initial[0], [initial[1]], repeat=2)
        spent = eng.totals.computed_tokens - before
        same = await backend.debate(q, initial[0], [initial[1]], repeat=2)
        return first, again, spent, same

    first, again, spent, same = asyncio.run(go())
    assert (first.id, again.id) == ("0<1", "0<1#2")
    assert again.prompt_tokens == first.prompt_tokens and again.context == first.context
    # the first computed the DebateFormat message; the repeat only its last prompt token (the one
    # whose logits start the sample): its cost is its completion
    assert first.computed_tokens > 1 and again.computed_tokens == spent == 1
    assert again.tokens != first.tokens  # its own seed: a new sample
    assert same.tokens == again.tokens  # ...derived from its id, so a rerun draws it again
