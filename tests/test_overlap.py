"""Decode steps launched before the previous step's tokens are read (EngineConfig.overlap, engine/step.py).

With overlap the host schedules step N+1 and launches it with its token ids taken on the device from
step N's packed rows, and only then reads step N. What runs on the CPU here (the static path run eagerly,
`cuda_graphs="static"`) is what a GPU would queue, so these tests hold the bookkeeping:

* every output (tokens, log-probs, entropies, top-k, finish reasons, token counts) equals the engine's
  with overlap off, bit for bit, through early stops (a sequence that step N ends computes a dropped row
  in step N+1), length limits, n>1 forks, requests that cannot sample inside the step, a scoring request,
  requests arriving mid-run, stop strings and preemption under a small cache; and on a mixture-of-experts
  model the greedy tokens equal a cache-free loop's;
* steps really were launched in flight and rows dropped (the counters say so);
* a step that fails with a step in flight fails its requests and leaves the engine serving;
* the choice: off where the static path runs eagerly unless asked, an error where asked and impossible.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from svrmad_local.engine.config import SettingsError
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams

from .model_zoo import loop_greedy, make_zoo_model, rand_prompt

STOPS = list(range(3, 33))  # about one token in thirteen ends a sequence: many end while a step is in flight


def engine(model, tokenizer=None, **kw):
    kw = {"kv_cache_memory": 4 * 2**20, "block_size": 4, "max_num_seqs": 8, "cuda_graphs": "static", **kw}
    return Engine(model, tokenizer, EngineConfig(**kw))


def _fields(out):
    """What a request returns that must be equal: tokens, text, finish reasons, top-k ids, counts."""
    if hasattr(out, "completions"):
        return [(c.index, c.token_ids, c.text, c.finish_reason, c.topk_ids) for c in out.completions], \
            out.usage.generated_tokens
    return out.topk_ids


def _numbers(out) -> list[float]:
    """Its log-probs, entropies and top log-probs in one list: equal to the last bits where the steps'
    shapes are (a run whose requests arrive by the clock, or recompute after preemption, may batch them
    otherwise, overlap or not: the prefill that recomputes a sequence writes its KV in other sums)."""
    rows = out.completions if hasattr(out, "completions") else [out]
    return [v for r in rows for v in r.logprobs + r.entropies + [x for t in r.topk_logprobs for x in t]]


def same(a: list, b: list) -> None:
    assert [_fields(x) for x in a] == [_fields(y) for y in b]
    for x, y in zip(a, b):
        assert _numbers(x) == pytest.approx(_numbers(y), abs=1e-5)


def _mixed(eng) -> list:
    """One run of mixed requests, some arriving while others decode, a scoring request among them."""
    early = [SamplingParams(max_tokens=t, seed=i, stop_token_ids=STOPS) for i, t in enumerate((6, 25, 9, 30))]
    late = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),  # greedy beside sampled rows
        SamplingParams(n=3, max_tokens=12, seed=7, stop_token_ids=STOPS),  # forks from the leader's prompt
        SamplingParams(max_tokens=3, seed=8, topk_logprobs=25, ignore_eos=True),  # wider than the step holds
        SamplingParams(max_tokens=4, seed=9, top_k=0, ignore_eos=True),  # a full sort: after the step
        SamplingParams(max_tokens=18, seed=10, temperature=0.7, top_p=0.8, top_k=5, ignore_eos=True),
    ]

    async def main():
        first = [asyncio.ensure_future(eng.generate(rand_prompt(5 + 4 * i, i), p)) for i, p in enumerate(early)]
        while eng.totals.generated_tokens < 8:  # the late ones arrive while the first decode
            await asyncio.sleep(0.001)
        rest = [eng.generate(rand_prompt(7 + 3 * i, 50 + i), p) for i, p in enumerate(late)]
        rest.append(eng.score(rand_prompt(9, 77), rand_prompt(6, 78), topk=3))
        return await asyncio.gather(*first, *rest)

    return asyncio.run(main())


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_overlap_returns_what_reading_each_step_returns(name):
    model = make_zoo_model(name)
    on, off = engine(model, overlap="on"), engine(model, overlap="off")
    assert on.execution.overlap.value == "on" and off.execution.overlap.value == "off"
    a, b = _mixed(on), _mixed(off)
    same(a, b)
    assert {c.finish_reason for x in a[:-1] for c in x.completions} == {"stop", "length"}
    assert on.info["overlapped_steps"] > 10 and on.info["dropped_rows"] > 0, on.info
    assert off.info["overlapped_steps"] == 0 and off.info["dropped_rows"] == 0
    assert on.info["generated_tokens"] == off.info["generated_tokens"]
    assert on.info["computed_tokens"] == off.info["computed_tokens"]


def test_overlap_is_bit_exact_where_the_steps_are_the_same(monkeypatch):
    # submitted together, nothing waits on the clock: the only difference is when the host reads
    model = make_zoo_model("llama")
    prompts = [rand_prompt(5 + 3 * i, 90 + i) for i in range(6)]
    params = [SamplingParams(max_tokens=8 + 4 * i, seed=i, stop_token_ids=STOPS) for i in range(5)]
    params.append(SamplingParams(n=2, max_tokens=15, seed=5, stop_token_ids=STOPS))
    on, off = engine(model, overlap="on"), engine(model, overlap="off")
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, *x, **k: reads.append(1) or tolist(t, *x, **k))
    a = on.generate_sync(prompts, params)
    assert len(reads) == on.info["steps"]  # still one read from the device a step
    b = off.generate_sync(prompts, params)
    assert [(_fields(x), _numbers(x)) for x in a] == [(_fields(y), _numbers(y)) for y in b]
    assert on.info["overlapped_steps"] > 0 and on.info["dropped_rows"] > 0, on.info


def test_overlap_under_preemption_and_length_limits():
    model = make_zoo_model("llama")
    prompts = [rand_prompt(10, 200 + i) for i in range(6)]
    params = [SamplingParams(max_tokens=10 + 3 * i, seed=i, ignore_eos=True) for i in range(6)]
    block = engine(model, overlap="off").built.budget.block_bytes
    # room for ~2 sequences of 25 tokens at once: steps launched in flight reserve, and preempt, before a read
    on = engine(model, kv_cache_memory=16 * block, overlap="on")
    a = on.generate_sync(prompts, params)
    b = engine(model, overlap="off").generate_sync(prompts, params)
    assert sum(o.usage.preemptions for o in a) > 0
    same(a, b)
    assert [len(o.completions[0].token_ids) for o in a] == [10 + 3 * i for i in range(6)]
    assert on.info["overlapped_steps"] > 0 and on.blocks.peak_used <= on.blocks.num_blocks


def test_overlap_stops_at_the_models_context():
    # a sequence that fills the context with step N is not scheduled into step N+1 (its position would not exist)
    model = make_zoo_model("llama")
    prompts = [rand_prompt(10, 5), rand_prompt(14, 6)]
    params = SamplingParams(max_tokens=50, seed=4, ignore_eos=True)
    outs = []
    for overlap in ("on", "off"):
        eng = engine(model, overlap=overlap)
        eng.max_model_len = 24
        outs.append(eng.generate_sync(prompts, params))
        assert eng.info["dropped_rows"] == 0
    assert [(_fields(x), _numbers(x)) for x in outs[0]] == [(_fields(y), _numbers(y)) for y in outs[1]]
    assert [len(o.completions[0].token_ids) for o in outs[0]] == [14, 10]
    assert {o.completions[0].finish_reason for o in outs[0]} == {"length"}


def test_overlap_with_stop_strings(tiny_model, tiny_tokenizer):
    prompts = ["Janet has 16 eggs", "the answer is", "she sells them"]
    params = SamplingParams(max_tokens=24, seed=3, stop=["e", "a"])
    on = engine(tiny_model, tiny_tokenizer, overlap="on")
    a = on.generate_sync(prompts, params)
    b = engine(tiny_model, tiny_tokenizer, overlap="off").generate_sync(prompts, params)
    same(a, b)
    assert any(c.finish_reason == "stop" for x in a for c in x.completions)
    assert on.info["overlapped_steps"] > 0


def test_overlap_on_a_mixture_of_experts_keeps_the_greedy_tokens():
    model = make_zoo_model("qwen3-moe")
    prompts = [rand_prompt(n, 30 + n) for n in (6, 11, 17)]
    greedy = [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True) for t in (4, 12, 9)]
    on = engine(model, overlap="on")
    outs = on.generate_sync(prompts, greedy)
    assert [o.completions[0].token_ids for o in outs] == [loop_greedy(model, p, g.max_tokens)
                                                          for p, g in zip(prompts, greedy)]
    assert on.info["overlapped_steps"] > 0


def test_overlap_over_replayed_graphs(monkeypatch):
    # the stand-in graph API replays each shape into the one output buffer it captured, as CUDA does: the
    # next step may be the same graph, so a step in flight must be read from its own copy
    from .test_graphs import StandIn

    StandIn(monkeypatch)
    model = make_zoo_model("llama")
    on = engine(model, cuda_graphs="auto")  # graphs "captured": auto takes overlap
    assert on.execution.overlap.value == "on" and on.runner.static.capture
    prompts = [rand_prompt(6 + 5 * i, 60 + i) for i in range(3)]
    params = [SamplingParams(max_tokens=9 + 5 * i, seed=i, stop_token_ids=STOPS) for i in range(3)]
    a = on.generate_sync(prompts, params)
    b = engine(model, cuda_graphs="off").generate_sync(prompts, params)
    assert [(_fields(x), _numbers(x)) for x in a] == [(_fields(y), _numbers(y)) for y in b]
    assert on.info["overlapped_steps"] > 0 and on.runner.static.replays > on.info["overlapped_steps"] / 2


def test_a_failing_step_with_a_step_in_flight_fails_its_requests_and_the_engine_serves_on():
    model = make_zoo_model("llama")
    on = engine(model, overlap="on")
    execute, calls = on.runner.execute, []

    def failing(step, draws=None, fed=None):
        if fed is not None:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the device fell over")
        return execute(step, draws, fed)

    on.runner.execute = failing
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with pytest.raises(RuntimeError, match="fell over"):
        on.generate_sync([rand_prompt(8, 1), rand_prompt(9, 2)], params)
    assert on.stepper.inflight is None and not on.scheduler.has_work()
    out = on.generate_sync(rand_prompt(8, 1), params)[0]
    assert out.completions[0].token_ids == loop_greedy(model, rand_prompt(8, 1), 10)
    assert on.blocks.num_used == 0  # every block of the failed requests went back


def test_the_overlap_choice():
    model = make_zoo_model("llama")
    auto = engine(model)  # the static path eagerly: nothing would run while the host prepares a step
    assert auto.execution.overlap.value == "off" and "eagerly" in auto.execution.overlap.reason
    assert "overlap off" in auto.execution.line()
    with pytest.raises(ValueError, match="overlap='on' cannot run here: decode steps run the dynamic path"):
        engine(model, cuda_graphs="off", overlap="on")
    assert engine(model, cuda_graphs="off").execution.overlap.value == "off"
    with pytest.raises(SettingsError, match="overlap must be one of auto, on, off, got 'yes'"):
        EngineConfig(overlap="yes")
