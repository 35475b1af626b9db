"""kernels.paged_prefill: the torch reference and the Triton kernel (numpy interpreter) against a float64
dense causal attention written here: runs of several lengths continuing cached contexts of several
lengths (none, inside a block, across blocks), shuffled block tables, GQA ratios, sliding windows,
GPT-OSS sinks, fp32/fp16/bf16; and the refusals of malformed calls.

Tolerance: |out - ref| <= ATOL[dtype], as for paged_decode: fp32 runs exact fp32 dots (1e-5); fp16 and
bf16 round their inputs and output once, and the softmax weights before P @ V.
"""
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.kernels.paged_prefill import paged_prefill  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
BS = 4


def dense_f64(q, k_cache, v_cache, table, cu, lens, scale, window=None, sinks=None):
    """Each run's context copied out in order; query i of a run of n rows at position L - n + i sees keys
    p <= its position (and p > position - window); the sink is one more column without a value."""
    h = q.shape[1]
    g = h // k_cache.shape[1]
    out = torch.zeros(q.shape[0], h, v_cache.shape[2], dtype=torch.float64)
    for r in range(len(lens)):
        n, rows = lens[r], cu[r + 1] - cu[r]
        slots = [int(table[r, p // BS]) * BS + p % BS for p in range(n)]
        k, v = k_cache[slots].double(), v_cache[slots].double()
        for i in range(rows):
            qp = n - rows + i
            first = 0 if window is None else max(0, qp - window + 1)
            for hd in range(h):
                s = (k[first:qp + 1, hd // g] @ q[cu[r] + i, hd].double()) * scale
                if sinks is not None:
                    s = torch.cat([s, sinks[hd:hd + 1].double()])
                p = torch.softmax(s, 0)[:qp + 1 - first]
                out[cu[r] + i, hd] = p @ v[first:qp + 1, hd // g]
    return out


def case(seed, rows=(5, 1, 19, 8), lens=(5, 9, 30, 8), h=4, hkv=2, d=16, dv=16, dtype=torch.float32, sinks=False):
    g = torch.Generator().manual_seed(seed)
    width = max(math.ceil(n / BS) for n in lens) + 1  # a spare column, never read
    num_blocks = len(lens) * width + 3
    k = torch.randn(num_blocks * BS, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks * BS, hkv, dv, generator=g).to(dtype)
    q = torch.randn(sum(rows), h, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: len(lens) * width].reshape(len(lens), width).to(torch.int32)
    cu = [0]
    for n in rows:
        cu.append(cu[-1] + n)
    sk = torch.randn(h, generator=g) * 2 if sinks else None
    return q, k, v, table, cu, list(lens), sk


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (6, 1)])
def test_gqa_and_dtypes(request, impl, dtype, h, hkv):
    if impl == "triton":
        request.getfixturevalue("interp")
    q, k, v, table, cu, lens, _ = case(1, h=h, hkv=hkv, dtype=dtype)
    out = paged_prefill(q, k, v, table, cu, lens, BS, 0.3, kernel_impl=impl)
    assert out.dtype == dtype and out.shape == (q.shape[0], h, 16)
    torch.testing.assert_close(out.double(), dense_f64(q, k, v, table, cu, lens, 0.3), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("window,sinks", [(None, True), (1, False), (3, True), (8, False), (64, True)])
def test_windows_and_sinks(request, impl, window, sinks):
    if impl == "triton":
        request.getfixturevalue("interp")
    q, k, v, table, cu, lens, sk = case(2, sinks=sinks, dv=24)  # a value width unlike the key's
    out = paged_prefill(q, k, v, table, cu, lens, BS, 0.25, window=window, sinks=sk, kernel_impl=impl)
    ref = dense_f64(q, k, v, table, cu, lens, 0.25, window, sk)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_tensors_or_lists_and_empty_runs(interp):
    q, k, v, table, cu, lens, _ = case(3, rows=(0, 6, 0, 3), lens=(4, 6, 1, 12))
    ref = dense_f64(q, k, v, table, cu, lens, 0.5)
    for impl in ("torch", "triton"):
        out = paged_prefill(q, k, v, table, torch.tensor(cu, dtype=torch.int32), torch.tensor(lens), BS, 0.5,
                            kernel_impl=impl)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_malformed_calls_are_refused_naming_the_argument():
    q, k, v, table, cu, lens, _ = case(4)
    with pytest.raises(ValueError, match="cu_q must be R\\+1=5 non-decreasing row offsets"):
        paged_prefill(q, k, v, table, cu[:-1], lens, BS, 1.0)
    with pytest.raises(ValueError, match="run 2 has 19 new rows and context_len 10"):
        paged_prefill(q, k, v, table, cu, [5, 9, 10, 8], BS, 1.0)
    with pytest.raises(ValueError, match="block_table must be an int tensor \\[R=4"):
        paged_prefill(q, k, v, table.float(), cu, lens, BS, 1.0)
    with pytest.raises(ValueError, match="sinks must be \\[H\\]=\\[4\\]"):
        paged_prefill(q, k, v, table, cu, lens, BS, 1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window must be a positive int"):
        paged_prefill(q, k, v, table, cu, lens, BS, 1.0, window=0)
    with pytest.raises(ValueError, match="head dim must match"):
        paged_prefill(q[..., :8], k, v, table, cu, lens, BS, 1.0)


@pytest.mark.parametrize("name", ["llama", "gpt-oss", "mistral-sliding", "gemma3"])
def test_the_engine_prefills_in_place_token_exact_under_the_interpreter(interp, name, monkeypatch):
    """The GPU attention path (Triton decode and prefill, nothing gathered), run on the CPU by Triton's
    interpreter: chunked prefills over a warm cache, windows, sinks and forks, token-exact."""
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.engine.kv_cache import KVCache
    from svrmad_local.engine.params import SamplingParams

    from .model_zoo import WINDOW, loop_greedy, make_zoo_model, rand_prompt

    model = make_zoo_model(name)
    head = rand_prompt(2 * WINDOW + 3, 5)
    prompts = [head + rand_prompt(n, 20 + n) for n in (3, 11)] + [rand_prompt(9, 7)]
    eng = Engine(model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, kernel_impl="triton",
                                           max_num_batched_tokens=16))  # prompts prefill in chunks
    assert "paged-decode:triton+paged-prefill:triton" in eng.info["attention"]
    gathers = []
    real = KVCache.gather
    monkeypatch.setattr(KVCache, "gather", lambda self, layer, slots: gathers.append(layer) or real(self, layer, slots))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    refs = [loop_greedy(model, p, 5) for p in prompts]
    assert [o.completions[0].token_ids for o in eng.generate_sync(prompts, params)] == refs, name
    warm = eng.generate_sync([prompts[1]], SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert [c.token_ids for c in warm.completions] == [refs[1]] * 2, name
    assert gathers == [], name


def test_flash_attn_is_chosen_only_where_it_reads_in_place_or_nothing_else_can():
    from svrmad_local.engine.choices import choose_flash

    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    assert choose_flash("auto", True, cuda, bf16, False, 256, triton_ok=True)  # pages of 256: in place
    assert not choose_flash("auto", True, cuda, bf16, False, 16, triton_ok=True)  # ours read 16-token blocks
    assert choose_flash("auto", True, cuda, bf16, False, 16, triton_ok=False)  # a gather, better than SDPA's
    assert choose_flash("flash", True, cuda, bf16, False, 16, triton_ok=True)  # asked for
    assert not choose_flash("auto", False, cuda, bf16, False, 256, triton_ok=True)  # not installed
    assert not choose_flash("flash", True, cpu, bf16, False, 256, triton_ok=False)
    assert not choose_flash("flash", True, cuda, torch.float32, False, 256, triton_ok=False)
    assert not choose_flash("auto", True, cuda, bf16, True, 256, triton_ok=True)  # latent (MLA) layers
    assert not choose_flash("sdpa", True, cuda, bf16, False, 256, triton_ok=True)
    # a flash-attn whose varlen call takes no block table (before 2.5.7) would gather: ours read in place
    assert not choose_flash("auto", True, cuda, bf16, False, 256, triton_ok=True, paged=False)
    assert choose_flash("auto", True, cuda, bf16, False, 256, triton_ok=False, paged=False)  # gather, no Triton


def test_flash_attn_paging_is_read_from_the_call_it_would_make():
    from svrmad_local.engine.choices import flash_takes_block_table

    def new(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
            block_table=None):
        pass

    def old(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):
        pass

    assert flash_takes_block_table(new) and not flash_takes_block_table(old)
