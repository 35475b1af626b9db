"""Every architecture we claim is token-exact against a cache-free transformers loop, and every other
one is refused in one line: the engine is never silently wrong.

Prompts are longer than the sliding windows, share prefixes (n > 1 forks, partial-block copies, a
warm cache) and go through preemption; teacher-forced statistics equal log_softmax of a plain forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.engine.spec import UnsupportedModel

from .model_zoo import EXACT, REFUSED, WINDOW, assert_cascade_matches_plain, full_logprobs, make_zoo_model, rand_prompt
from .model_zoo import loop_greedy as zoo_loop_greedy

NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def loop_greedy(model, prompt, n=NEW):
    return zoo_loop_greedy(model, prompt, n)


@pytest.fixture(scope="module", params=EXACT)
def zoo(request):
    return request.param, make_zoo_model(request.param)


def engine(model, **kw):
    kw.setdefault("kv_cache_memory", 4 * 2**20)
    kw.setdefault("block_size", 4)
    return Engine(model, None, EngineConfig(**kw))


def test_greedy_is_exact_across_windows_forks_and_a_warm_cache(zoo):
    name, model = zoo
    head = rand_prompt(3 * WINDOW + 1, 1)  # ends inside a block: later prompts copy its partial block
    prompts = [head + rand_prompt(n, 10 + n) for n in (2, 7, 13)] + [rand_prompt(2 * WINDOW + 5, 2)]
    refs = [loop_greedy(model, p) for p in prompts]
    eng = engine(model)
    assert eng.spec.arch.startswith(type(model).__name__)
    cold = eng.generate_sync(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in cold] == refs, name
    warm = eng.generate_sync(prompts[:3], GREEDY)  # every prompt now mostly from the cache
    assert [o.completions[0].token_ids for o in warm] == refs[:3], name
    assert sum(o.usage.computed_tokens for o in warm) < sum(len(p) for p in prompts[:3]) / 4
    forks = eng.generate_sync([prompts[1]], SamplingParams(n=3, temperature=0, max_tokens=NEW, ignore_eos=True))[0]
    assert [c.token_ids for c in forks.completions] == [refs[1]] * 3, name


MOE = {"qwen3-moe", "gpt-oss", "deepseek-v3"}


def test_log_probs_do_not_depend_on_batch_mates(zoo):
    """A seeded request's tokens and log-probs alone and among batch mates: bitwise the same for dense
    models on our linear kernel (each row's linears, norms and attention are computed alone); within 2e-6
    for MoE models, whose
    experts (transformers' grouped GEMM) multiply each expert's rows together, so the GEMM's size and its
    rounding depend on how many tokens chose that expert."""
    name, model = zoo
    p = rand_prompt(30, 1)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    mates = [rand_prompt(10 + 7 * i, 2 + i) for i in range(5)]
    eng = engine(model)
    alone = eng.generate_sync([p], params)[0].completions[0]
    among = engine(model).generate_sync([p] + mates, [params] + [SamplingParams(max_tokens=12 + i, seed=i)
                                                                 for i in range(5)])[0].completions[0]
    assert among.token_ids == alone.token_ids, name
    if name in MOE or not eng.info["linear"].startswith("panels"):  # oneDNN picks its GEMM by row count
        assert among.logprobs == pytest.approx(alone.logprobs, abs=2e-6), name
    else:
        assert among.logprobs == alone.logprobs, name


def test_preemption_keeps_tokens_exact(zoo):
    name, model = zoo
    prompts = [rand_prompt(2 * WINDOW + 3 + i, 30 + i) for i in range(4)]
    refs = [loop_greedy(model, p) for p in prompts]
    probe = engine(model)
    per_seq = -(-(len(prompts[-1]) + NEW) // 4) + 1
    eng = engine(model, kv_cache_memory=(per_seq * 2 + 1) * probe.built.budget.block_bytes)  # about two sequences at a time
    outs = eng.generate_sync(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in outs] == refs, name
    assert sum(o.usage.preemptions for o in outs) > 0, "the budget was meant to force preemption"


def test_teacher_forced_statistics_equal_a_plain_forward(zoo):
    name, model = zoo
    prompt, cont = rand_prompt(2 * WINDOW + 1, 40), rand_prompt(WINDOW + 3, 41)
    eng = engine(model)
    eng.generate_sync([prompt[:WINDOW + 2]], GREEDY)  # part of the prompt comes from the cache
    got = eng.score_sync(prompt, cont, topk=4)
    ref = full_logprobs(model, prompt + cont)
    rows = ref[len(prompt) - 1 : len(prompt) + len(cont) - 1]
    assert got.logprobs == pytest.approx([rows[i, t].item() for i, t in enumerate(cont)], abs=1e-4), name
    assert got.entropies == pytest.approx((-(rows.exp() * rows).sum(-1)).tolist(), abs=1e-4), name
    assert [r[:4] for r in got.topk_ids] == rows.topk(4).indices.tolist()


def test_sampled_logprobs_equal_a_plain_forward(zoo):
    name, model = zoo
    prompt = rand_prompt(2 * WINDOW, 50)
    c = engine(model).generate_sync([prompt], SamplingParams(max_tokens=NEW, seed=7, ignore_eos=True))[0].completions[0]
    ref = full_logprobs(model, prompt + c.token_ids)
    assert c.logprobs == pytest.approx([ref[len(prompt) + i - 1, t].item() for i, t in enumerate(c.token_ids)], abs=1e-4)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_architectures_are_refused_in_one_line(name):
    with pytest.raises(UnsupportedModel, match=REFUSED[name]) as exc:
        engine(make_zoo_model(name))
    assert "\n" not in str(exc.value)


def test_cascade_decode_keeps_the_architectures_exact(zoo):
    """Shared-prefix decode (forks of one prompt) through kernels.cascade_attention, torch path."""
    name, model = zoo
    prompt = rand_prompt(2 * WINDOW + 5, 60)
    params = SamplingParams(n=3, max_tokens=NEW, seed=3, ignore_eos=True)
    plain = engine(model).generate_sync([prompt], params)[0]
    eng = engine(model, cascade="on", kernel_impl="torch")
    got = eng.generate_sync([prompt], params)[0]
    assert [c.token_ids for c in got.completions] == [c.token_ids for c in plain.completions], name
    for a, b in zip(got.completions, plain.completions):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert eng.generate_sync([prompt], GREEDY)[0].completions[0].token_ids == loop_greedy(model, prompt)


def test_each_layer_spec_is_read_from_the_model():
    def spec(name):
        return engine(make_zoo_model(name)).spec

    oss = spec("gpt-oss")
    assert [s.window for s in oss.layers] == [WINDOW, None, WINDOW] and all(s.sinks for s in oss.layers)
    assert [s.window for s in spec("qwen2-sliding").layers] == [None, WINDOW, WINDOW]
    assert [s.window for s in spec("gemma3").layers] == [WINDOW, None, WINDOW]
    assert [s.window for s in spec("mistral-sliding").layers] == [WINDOW] * 3
    plain = spec("llama")
    assert all(s.kind == "kv" and s.window is None and not s.sinks for s in plain.layers)
    assert plain.layers[0].k_shape == (2, 16)
    ds = spec("deepseek-v3")  # the latent (kv_lora_rank 16) and the shared RoPE key (8) per token
    assert all(s.kind == "latent" and s.k_shape == (1, 16) and s.v_shape == (1, 8) for s in ds.layers)
    naive = 3 * 4 * ((16 + 8) + 16) * 4  # per-head K (nope + rope) and V, 4 heads, 3 layers, fp32
    assert ds.bytes_per_token() == 3 * (16 + 8) * 4 and ds.bytes_per_token() * 6 < naive


def _patch_attention(model, layer, **extra):
    """Make one layer's attention pass extra keyword arguments to the attention function."""
    attn = model.model.layers[layer].self_attn
    forward = attn.forward

    def patched(*args, **kwargs):
        return forward(*args, **kwargs, **extra)

    attn.forward = patched


def test_unknown_attention_features_are_refused_at_engine_start():
    from .conftest import make_model

    m = make_model("llama", layers=3)
    _patch_attention(m, 1, alibi_slopes=torch.ones(4))
    with pytest.raises(UnsupportedModel, match=r"layer 1 \(LlamaAttention\) passes alibi_slopes"):
        engine(m)
    m = make_model("llama", layers=3)
    _patch_attention(m, 2, softcap=30.0)
    with pytest.raises(UnsupportedModel, match="soft-capping"):
        engine(m)
    m = make_model("llama", layers=3)
    m.model.layers[2].self_attn.is_causal = False
    with pytest.raises(UnsupportedModel, match="layer 2 .* not causal"):
        engine(m)
    m = make_model("llama", layers=3)
    m.model.layers[1].self_attn.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnsupportedModel, match=r"layers \[1\] do not run attention through"):
        engine(m)
    m = make_model("llama", layers=2)
    m.config.alibi = True
    with pytest.raises(UnsupportedModel, match="ALiBi"):
        engine(m)
    m = make_model("mistral", layers=2)
    m.config.sliding_window = 5  # the modules pass it (Mistral reads the config), the masks would too
    assert [s.window for s in engine(m).spec.layers] == [5, 5]


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, return_attn_probs=False,
                      block_table=None):
    """flash_attn_varlen_func's contract, in plain torch (bottom-right causal, window (left, 0); with
    a block table, k/v are [blocks, page, heads, dim] pages and sequence i's keys are its pages)."""
    assert causal
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]]
        if block_table is None:
            ki, vi = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        else:
            n = int(cu_k[i + 1] - cu_k[i])
            ki = k[block_table[i].long()].flatten(0, 1)[:n]
            vi = v[block_table[i].long()].flatten(0, 1)[:n]
        g = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(g, 1), vi.repeat_interleave(g, 1)
        qn, L = qi.shape[0], ki.shape[0]
        pq = torch.arange(L - qn, L)[:, None]
        pk = torch.arange(L)[None]
        vis = pk <= pq
        if window_size[0] >= 0:
            vis &= pk >= pq - window_size[0]
        s = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * softmax_scale
        s = s.masked_fill(~vis, float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vi.float()).to(q.dtype))
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    return (out, lse, None) if return_attn_probs else out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", ["gpt-oss", "mistral-sliding", "llama"])
def test_flash_attn_path_passes_windows_sinks_and_block_tables(monkeypatch, name, paged):
    """The flash-attn wiring (GPU only in real use) against a torch stand-in with the same contract:
    over a gather of the context, or in place through the block table (pages of 256 tokens on a GPU;
    the stand-in takes our small blocks)."""
    from svrmad_local.engine import attention

    model = make_zoo_model(name)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", _reference_varlen)
    eng = engine(model)
    eng.runner.paths = dataclasses.replace(eng.runner.paths, flash=True, flash_paged=paged)  # what a GPU would choose
    prompts = [rand_prompt(2 * WINDOW + 3, 70), rand_prompt(WINDOW + 1, 71)]
    outs = eng.generate_sync(prompts + prompts[:1], GREEDY)  # the repeat reads a cached prefix
    assert [o.completions[0].token_ids for o in outs] == [loop_greedy(model, p) for p in prompts + prompts[:1]]

@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
def test_cascade_kernels_carry_windows_and_sinks_in_the_engine(kernel_impl):
    """GPT-OSS decode through the cascade kernels (Triton in the interpreter): sliding layers pass
    each query's position and the window, full layers the sinks."""
    from svrmad_local import kernels

    if kernel_impl == "triton" and not (kernels.HAS_TRITON and kernels._backend.interpreter_ready()):
        pytest.skip("triton interpreter not available in this process")
    assert_cascade_matches_plain(engine, make_zoo_model("gpt-oss"), rand_prompt(2 * WINDOW + 5, 80),
                                 SamplingParams(n=3, max_tokens=6, seed=5, ignore_eos=True), kernel_impl)
