"""The engine's invariants (design sketch): cached == uncached, logprobs == full forward,
seeded sampling independent of batch mates, exact accounting, a memory budget that holds."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.memory import parse_memory
from svrmad_local.engine.params import SamplingParams
from svrmad_local.engine.scheduler import RequestTooLarge

from .conftest import make_model
from .model_zoo import assert_cascade_matches_plain

BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # tiny model: layers x (K, V) x block_size 4 x kv_heads x head_dim x fp32
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def rand_prompt(n, seed, vocab=400):
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(n)]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def full_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1)


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 8 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers_generate(arch):
    model = make_model(arch)
    eng = engine(model)
    prompts = [rand_prompt(n, s) for s, n in enumerate([5, 17, 9, 30])]
    outs = eng.generate_sync(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.completions[0].token_ids == hf_greedy(model, p, 12)


def test_cached_prefix_gives_same_tokens_alone_and_in_mixed_batch(tiny_model):
    prefix = rand_prompt(23, 1)
    prompt = prefix + rand_prompt(6, 2)
    fresh = engine(tiny_model).generate_sync([prompt], GREEDY)[0]
    eng = engine(tiny_model)
    eng.generate_sync([prefix + rand_prompt(9, 3)], GREEDY)  # warm the cache with the prefix
    mates = [rand_prompt(n, 10 + n) for n in (3, 11, 40)]
    params = [GREEDY] + [SamplingParams(max_tokens=7, seed=5)] * 3
    warm = eng.generate_sync([prompt] + mates, params)[0]
    assert warm.usage.computed_tokens == len(prompt) - len(prefix)
    assert warm.completions[0].token_ids == fresh.completions[0].token_ids == hf_greedy(tiny_model, prompt, 12)


def test_reported_logprobs_equal_full_forward(tiny_model):
    eng = engine(tiny_model)
    prompt = rand_prompt(13, 4)
    eng.generate_sync([prompt[:8]], GREEDY)  # part of the prompt comes from the cache
    c = eng.generate_sync([prompt], SamplingParams(max_tokens=10, seed=3, topk_logprobs=5))[0].completions[0]
    ref = full_logprobs(tiny_model, prompt + c.token_ids)
    for i, tok in enumerate(c.token_ids):
        row = ref[len(prompt) + i - 1]
        assert c.logprobs[i] == pytest.approx(row[tok].item(), abs=1e-4)
        assert c.entropies[i] == pytest.approx(-(row.exp() * row).sum().item(), abs=1e-4)
        assert c.topk_logprobs[i] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
        assert c.topk_ids[i] == row.topk(5).indices.tolist()
    assert c.signals["min_ll"] == pytest.approx(min(c.logprobs))


def test_score_equals_full_forward_and_reuses_prompt(tiny_model):
    eng = engine(tiny_model, score_chunk=4, max_num_batched_tokens=16)
    prompt, cont = rand_prompt(20, 5), rand_prompt(25, 6)
    eng.generate_sync([prompt], GREEDY)
    s = eng.score_sync(prompt, cont, topk=3)
    ref = full_logprobs(tiny_model, prompt + cont)
    want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(cont)]
    assert s.logprobs == pytest.approx(want, abs=1e-4)
    assert len(s.topk_ids) == len(cont) and len(s.topk_ids[0]) == 3
    assert s.usage.computed_tokens == len(cont) + 1  # the prompt's last position is recomputed for its hidden state


def test_seeded_sampling_independent_of_batch_mates(tiny_model):
    p = rand_prompt(10, 7)
    params = SamplingParams(n=3, max_tokens=15, seed=42, ignore_eos=True)
    alone = engine(tiny_model).generate_sync([p], params)[0]
    mates = [rand_prompt(n, n) for n in (4, 25, 12, 7)]
    batched = engine(tiny_model).generate_sync(mates[:2] + [p] + mates[2:], [SamplingParams(max_tokens=9)] * 2 + [params] + [SamplingParams(max_tokens=20)] * 2)[2]
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in batched.completions]
    assert len({tuple(c.token_ids) for c in alone.completions}) > 1  # the n samples differ
    other = engine(tiny_model).generate_sync([p], SamplingParams(n=3, max_tokens=15, seed=43, ignore_eos=True))[0]
    assert [c.token_ids for c in other.completions] != [c.token_ids for c in alone.completions]


def test_accounting_adds_up(tiny_model):
    eng = engine(tiny_model)
    q = rand_prompt(21, 8)
    init = eng.generate_sync([q], SamplingParams(n=4, max_tokens=9, seed=1, ignore_eos=True))[0]
    assert init.usage.prompt_tokens == 4 * len(q)
    assert init.usage.computed_tokens == len(q)  # the n samples fork from one prefill
    assert init.usage.generated_tokens == sum(len(c.token_ids) for c in init.completions) == 36
    # a debate-shaped prompt: question + own answer + new text reuses the KV written while answering
    own = init.completions[2].token_ids
    debate = q + own + rand_prompt(7, 9)
    d = eng.generate_sync([debate], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert d.usage.computed_tokens == 7 + 1  # the answer's last token was sampled, never fed back
    assert d.usage.cached_tokens == d.usage.prompt_tokens - d.usage.computed_tokens
    t = eng.totals
    assert t.prompt_tokens == init.usage.prompt_tokens + d.usage.prompt_tokens
    assert t.computed_tokens == init.usage.computed_tokens + d.usage.computed_tokens
    assert t.generated_tokens == 36 + 5
    assert d.usage.peak_kv_bytes > 0 and d.usage.time_s > 0
    # distinct blocks: the 4 samples share the prompt's full blocks (21 tokens, block 4 -> 5 full)
    per_sample = -(-(21 + 9) // 4) - 5
    assert init.usage.peak_kv_bytes <= (5 + 4 * per_sample) * eng.built.budget.block_bytes <= eng.info["peak_kv_bytes"]


def test_memory_budget_holds_under_a_flood(tiny_model):
    prompts = [rand_prompt(8 + i % 5, 100 + i) for i in range(24)]
    ref = engine(tiny_model).generate_sync(prompts, GREEDY)
    # room for ~3 sequences of 25 tokens at once: the scheduler must wait and preempt, not crash
    eng = Engine(tiny_model, None, EngineConfig(block_size=4, kv_cache_memory=20 * BLOCK_BYTES))
    assert eng.blocks.num_blocks == 20
    outs = eng.generate_sync(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in outs] == [o.completions[0].token_ids for o in ref]
    assert eng.blocks.peak_used <= eng.blocks.num_blocks
    assert eng.info["peak_kv_bytes"] <= eng.built.budget.bytes
    assert eng.blocks.evictions > 0


def test_preemption_keeps_results_exact(tiny_model):
    eng = Engine(tiny_model, None, EngineConfig(block_size=4, kv_cache_memory=12 * BLOCK_BYTES, max_num_seqs=8))
    prompts = [rand_prompt(10, 200 + i) for i in range(6)]
    params = SamplingParams(max_tokens=20, seed=9, ignore_eos=True)
    outs = eng.generate_sync(prompts, params)
    assert sum(o.usage.preemptions for o in outs) > 0
    ref = engine(tiny_model).generate_sync(prompts, params)
    assert [o.completions[0].token_ids for o in outs] == [o.completions[0].token_ids for o in ref]
    assert all(o.usage.computed_tokens >= 10 for o in outs)


def test_chunked_prefill_and_block_sizes_agree(tiny_model):
    p = rand_prompt(50, 11)
    ref = hf_greedy(tiny_model, p, 12)
    for bs, chunk in [(1, 7), (4, 16), (16, 2048), (5, 3)]:
        out = engine(tiny_model, block_size=bs, max_num_batched_tokens=chunk).generate_sync([p], GREEDY)[0]
        assert out.completions[0].token_ids == ref, (bs, chunk)


def test_concurrent_coroutines_share_batches(tiny_model):
    eng = engine(tiny_model)

    async def agent(i):
        out = await eng.generate(rand_prompt(6, 300 + i), SamplingParams(max_tokens=8, seed=i, ignore_eos=True))
        return len(out.completions[0].token_ids)

    async def main():
        return await asyncio.gather(*(agent(i) for i in range(10)))

    assert asyncio.run(main()) == [8] * 10
    assert eng.totals.steps < 10 * 8  # gathered into shared steps


def test_stop_tokens_and_strings(tiny_model, tiny_tokenizer):
    eng = Engine(tiny_model, tiny_tokenizer, EngineConfig(kv_cache_memory=8 * 2**20, block_size=4))
    p = rand_prompt(6, 12)
    free = eng.generate_sync([p], GREEDY)[0].completions[0]
    stop_tok = free.token_ids[3]
    c = eng.generate_sync([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0].completions[0]
    assert c.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1] and c.finish_reason == "stop"
    text = tiny_tokenizer.decode(free.token_ids[:5])
    target = text[-2:] if text.strip() else None
    if target:
        s = eng.generate_sync([p], SamplingParams(temperature=0, max_tokens=12, stop=[target]))[0].completions[0]
        assert s.finish_reason == "stop" and target not in s.text


def test_request_errors(tiny_model):
    eng = engine(tiny_model)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate_sync([[]], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        eng.generate_sync([[1, 2, 10_000]], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    tiny = Engine(tiny_model, None, EngineConfig(block_size=4, kv_cache_memory=4 * BLOCK_BYTES))
    with pytest.raises(RequestTooLarge, match="KV blocks"):
        tiny.generate_sync([rand_prompt(40, 1)], GREEDY)
    # the engine still serves the next request
    assert tiny.generate_sync([rand_prompt(3, 1)], SamplingParams(temperature=0, max_tokens=4))[0].completions[0].token_ids


def test_parse_memory():
    assert parse_memory("2GiB", 0, 0) == 2 * 2**30
    assert parse_memory(0.5, 1000, 0) == 500
    assert parse_memory(4096, 0, 0) == 4096
    assert parse_memory(None, 0, 7) == 7
    assert parse_memory("0.9", 1000, 0) == 900  # a fraction given as a string (the CLI's case)
    assert parse_memory(".25", 1000, 0) == 250
    assert parse_memory("4096", 1000, 0) == 4096
    assert parse_memory("1.5GiB", 0, 0) == int(1.5 * 2**30)
    assert parse_memory(1.0, 1000, 0) == 1000
    for bad in ("lots", "1.5", "-2", "0", "0.5b", "", "2 GiB extra", 1.5, True):
        with pytest.raises(ValueError):
            parse_memory(bad, 1000, 0)


def test_prompts_sharing_an_uncached_head_in_one_step_compute_it_once(tiny_model):
    """The S debates of one receiver arrive together and share the DebateFormat head: the scheduler
    defers all but one for a step so the head is computed once (SGLang's in-batch prefix sharing)."""
    head = rand_prompt(21, 40)
    prompts = [head + rand_prompt(5, 41 + i) for i in range(3)]
    eng = engine(tiny_model)
    outs = eng.generate_sync(prompts, GREEDY)
    assert eng.totals.computed_tokens == len(head) + 3 * 5
    ref = [hf_greedy(tiny_model, p, 12) for p in prompts]
    assert [o.completions[0].token_ids for o in outs] == ref


def test_a_prompt_sharing_the_head_of_a_continuing_chunked_prefill_waits_for_it(tiny_model):
    """A long prompt admitted in an earlier step still computes its tail (the shared head's end among
    it) in this one: a prompt sharing that head waits a step for it, as it does for a prompt admitted
    in the same step, and computes only its own tokens."""
    head = rand_prompt(21, 42)
    first, second = head + rand_prompt(5, 43), head + rand_prompt(5, 44)
    eng = engine(tiny_model, max_num_batched_tokens=16)  # first: [0, 16) in step 1, [16, 26) in step 2
    outs = eng.generate_sync([first, second], GREEDY)
    assert eng.totals.computed_tokens == len(first) + 5  # was 26 + 10: second recomputed [16, 21)
    assert [o.completions[0].token_ids for o in outs] == [hf_greedy(tiny_model, p, 12) for p in (first, second)]


def test_decode_levels_cover_each_query_exactly_once():
    from svrmad_local.engine.runner import decode_levels

    bs = 4
    # q0,q1,q2 share blocks 0,1 (the question); q0,q1 also share 2 (a receiver's answer); own tails
    tables = [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5, 6], [7, 8]]
    lens = [15, 13, 16, 6]
    levels = decode_levels(tables, lens, bs, "cpu")
    for i, (tab, n) in enumerate(zip(tables, lens)):
        slots = []
        for lv in levels:
            if i in lv.query_idx.tolist():
                slots += [b * bs + o for b in lv.block_table.tolist() for o in range(bs)][: lv.kv_len]
        assert slots == [b * bs + o for b in tab for o in range(bs)][:n], i
    shared = [lv for lv in levels if len(lv.query_idx) > 1]
    assert [(sorted(lv.query_idx.tolist()), lv.kv_len) for lv in shared] == [([0, 1, 2], 8), ([0, 1], 4)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cascade_attention_in_the_engine_keeps_the_invariants(tiny_model, impl):
    import svrmad_local.kernels as kernels

    if impl == "triton" and not (kernels.HAS_TRITON and kernels._backend.interpreter_ready()):
        pytest.skip("triton interpreter not available in this process")
    q = rand_prompt(14, 60)
    eng = assert_cascade_matches_plain(engine, tiny_model, q, SamplingParams(n=4, max_tokens=6, seed=2, ignore_eos=True),
                                       impl)
    assert eng.generate_sync([q], GREEDY)[0].completions[0].token_ids == hf_greedy(tiny_model, q, 12)
    if impl == "triton":
        s = eng.score_sync(q, rand_prompt(5, 61), topk=3)
        ref = full_logprobs(tiny_model, q + rand_prompt(5, 61))
        assert s.logprobs == pytest.approx([ref[len(q) + i - 1, t].item() for i, t in enumerate(rand_prompt(5, 61))], abs=1e-4)


def test_forks_that_find_no_room_wait_and_match(tiny_model):
    p = rand_prompt(10, 70)
    params = SamplingParams(n=5, max_tokens=6, seed=4, ignore_eos=True)
    ref = engine(tiny_model).generate_sync([p], params)[0]
    eng = Engine(tiny_model, None, EngineConfig(block_size=4, kv_cache_memory=7 * BLOCK_BYTES))
    got = eng.generate_sync([p], params)[0]
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in ref.completions]
    assert got.usage.generated_tokens == 30 and eng.blocks.peak_used <= 7


def test_public_api_from_pretrained_text_and_chat_prompts(tmp_path, tiny_model, tiny_tokenizer):
    from svrmad_local import Engine as PublicEngine, EngineConfig as PublicConfig, SamplingParams as PublicParams

    assert PublicEngine is Engine and PublicConfig is EngineConfig and PublicParams is SamplingParams
    tiny_model.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    eng = PublicEngine.from_pretrained(tmp_path, kv_cache_memory=8 * 2**20, block_size=4)
    text = "What is 2 + 3?"
    ids = tiny_tokenizer.encode(text)
    by_text = eng.generate_sync(text, GREEDY)[0].completions[0].token_ids
    assert by_text == eng.generate_sync([ids], GREEDY)[0].completions[0].token_ids == hf_greedy(tiny_model, ids, 12)
    messages = [{"role": "user", "content": text}]
    chat_ids = tiny_tokenizer.encode(tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False), add_special_tokens=False)
    assert eng.generate_sync([messages], GREEDY)[0].prompt_token_ids == chat_ids
    s = eng.score_sync(text, " The answer is 5", topk=2)
    assert len(s.logprobs) == len(tiny_tokenizer.encode(" The answer is 5", add_special_tokens=False))
    with pytest.raises(TypeError, match="unknown option.*kv_cache_mem"):
        PublicEngine.from_pretrained(tmp_path, kv_cache_mem="1GiB")
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        eng.generate_sync([ids], [GREEDY, GREEDY])


def test_prefill_runs_of_one_step_share_one_padded_attention_call():
    """Similar prefill runs go in one call (padded), a long one beside short ones alone; on the CPU,
    without a window, runs that continue a cached context go alone (prefix + causal square)."""
    from svrmad_local.engine.attention import Span, _view

    def span(row0, qn, L):
        return Span(row0, row0 + qn, torch.arange(100, 100 + L))

    runs = [span(0, 1, 9), span(1, 5, 12), span(6, 6, 6), span(12, 4, 10)]
    alone = _view(runs, 1, window=None)
    assert alone.prefill is None and [p[:2] for p in alone.prefills] == [(1, 6), (6, 12), (12, 16)]
    assert alone.prefills[1][3] is None and alone.prefills[0][3].shape == (5, 12)  # plain causal / prefix
    assert _view(runs, 1, window=None, latent=True).prefills == []  # latent runs never split: padded as before
    v = _view(runs, 1, window=100)  # a window wider than every run: the same keys, padded together
    assert v.decode.index.shape == (1, 9) and v.prefills == []
    assert v.prefill.q_rows.shape == (3, 6) and v.prefill.dest.tolist() == list(range(1, 16))
    # run 1: 5 queries at positions 7..11 over 12 keys, bottom-right causal
    assert v.prefill.mask[0, 0, :5].tolist() == torch.ones(5, 12, dtype=torch.bool).tril(7).tolist()
    assert v.prefill.mask[0, 0, 5].tolist() == [True] + [False] * 11  # a padding row sees one key
    w = _view([span(0, 5, 12), span(5, 6, 6)], 0, window=3)  # windows trim the keys per run
    assert w.prefill.index[0, :7].tolist() == list(range(105, 112))
    lone = _view([span(0, 200, 200), span(200, 2, 30), span(202, 2, 30), span(204, 2, 30)], 0, window=100)
    assert lone.prefill is None and [p[:2] for p in lone.prefills] == [(0, 200), (200, 202), (202, 204), (204, 206)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefix_plus_causal_square_equals_the_masked_call(dtype, with_sinks):
    """Two unmasked flash calls merged by their log-sum-exps = one call with the bottom-right causal
    mask, within the dtype's rounding (float64 reference), GQA and attention sinks included."""
    from svrmad_local.engine.attention import _prefix_causal

    g = torch.Generator().manual_seed(0)
    for H, KVH, qn, prefix in [(9, 3, 5, 7), (4, 4, 16, 1), (6, 2, 33, 100)]:
        q = torch.randn(1, H, qn, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, KVH, prefix + qn, 64, generator=g).to(dtype) for _ in range(2))
        sinks = torch.randn(H, generator=g) if with_sinks else None
        mask = torch.ones(qn, prefix + qn, dtype=torch.bool).tril(prefix)
        kk, vv = (t.double().repeat_interleave(H // KVH, 1) for t in (k, v))
        s = (q.double() @ kk.transpose(-1, -2) * 0.125).masked_fill(~mask, float("-inf"))
        if with_sinks:  # a sink is one more logit per head with no value
            s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(1, H, qn, 1)], -1)
        ref = (torch.softmax(s, -1)[..., : prefix + qn] @ vv)
        out = _prefix_causal(q, k, v, prefix, 0.125, sinks)
        assert out.dtype == dtype and out.shape == ref.shape
        assert (out.double() - ref).abs().max() < (2e-6 if dtype == torch.float32 else 2e-2)


def test_every_forward_of_the_engine_runs_on_its_one_worker_thread(tiny_model, monkeypatch):
    """The probe included: a forward on the caller's thread would start a second OpenMP team, and
    with more OpenMP threads than cores every step's barriers sleep instead of spinning (1.7x slower
    on 2 cores, docs/engine.md). Every forward goes through models/hf.run_body (the probe, the modules)
    or the runner's run_body (every step, our decoder's too)."""
    import threading

    from svrmad_local.engine.runner import ModelRunner
    from svrmad_local.models import hf

    threads = []
    for owner, name in ((hf, "run_body"), (ModelRunner, "run_body")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _f=real: (threads.append(threading.get_ident()), _f(*a))[1])
    eng = engine(tiny_model)
    assert eng.runner.decoder is not None
    eng.generate_sync([rand_prompt(9, 3), rand_prompt(5, 4)], GREEDY)
    eng.close()
    assert len(threads) > 2 and len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_a_context_set_after_build_reaches_the_stop_rule(tiny_model):
    """Engine.max_model_len is one limit: the prompt check and the step's stop rule (engine/step.py)
    read the same value, also when a caller lowers it after the engine is built."""
    eng = engine(tiny_model)
    prompt = rand_prompt(10, 5)
    eng.max_model_len = len(prompt) + 3
    out = eng.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(out.completions[0].token_ids) == 3 and out.completions[0].finish_reason == "length"


def test_steps_run_back_to_back_and_a_finished_request_returns_at_once(tiny_model, monkeypatch):
    """The worker runs steps until a request finishes (each hand-off to the event loop costs a thread wake each
    way): a lone request's steps take one call; a request that arrives while another runs is admitted at a
    step of that call, and its result comes back as soon as it finishes, before the longer one's."""
    from svrmad_local.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STEPS_FOR_S", 60.0)
    eng = engine(tiny_model)
    calls = []
    steps = eng._steps
    monkeypatch.setattr(eng, "_steps", lambda: calls.append(eng.totals.steps) or steps())
    eng.generate_sync([rand_prompt(6, 3)], GREEDY)
    assert len(calls) == 1 and eng.totals.steps == 12  # the prompt and its first token, then 11 tokens

    async def both():
        order = []
        long = asyncio.ensure_future(eng.generate(rand_prompt(5, 4), SamplingParams(temperature=0, max_tokens=60,
                                                                                    ignore_eos=True)))
        long.add_done_callback(lambda _: order.append("long"))
        while eng.totals.steps < 16:  # the long request is decoding, inside one call to the worker
            await asyncio.sleep(0.001)
        short = await eng.generate(rand_prompt(5, 5), GREEDY)
        order.append("short")
        await long
        return order, short

    order, short = asyncio.run(both())
    assert order == ["short", "long"] and len(short.completions[0].token_ids) == 12
    assert short.completions[0].token_ids == eng.generate_sync([rand_prompt(5, 5)], GREEDY)[0].completions[0].token_ids


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_fail_their_request_in_one_line_and_the_others_go_on(tiny_model, monkeypatch, bad):
    """A NaN or an infinity in a sampled row's logits (an overflow in the forward) once made the draw index
    position -1 and failed every request in flight; now that request fails, saying why in one line, its
    blocks go back, and the request beside it computes what it computes alone."""
    from svrmad_local.engine.step import NonFiniteLogits

    other = rand_prompt(7, 8)
    alone = engine(tiny_model).generate_sync([other], GREEDY)[0].completions[0].token_ids
    eng = engine(tiny_model)
    logits, poisoned = eng.runner.logits, []

    def poison(hidden):
        out = logits(hidden)
        if eng.totals.steps == 4 and not poisoned:  # a decode step of both: row 0 is the sampled request's
            out[0, 5] = bad
            poisoned.append(out.shape[0])
        return out

    monkeypatch.setattr(eng.runner, "logits", poison)
    sampled = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, ignore_eos=True, seed=3, n=2)

    async def both():
        return await asyncio.gather(eng.generate(rand_prompt(6, 7), sampled), eng.generate(other, GREEDY),
                                    return_exceptions=True)

    failed, fine = asyncio.run(both())
    assert poisoned == [3]  # the two samples of the first request and the greedy one
    assert isinstance(failed, NonFiniteLogits) and "NaN or infinity" in str(failed) and "\n" not in str(failed)
    assert fine.completions[0].token_ids == alone
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.generate_sync([other], GREEDY)[0].completions[0].token_ids == alone
