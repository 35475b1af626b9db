"""The CPU decode kernel (kernels/cpu_decode.py) reads K/V in place through block tables: equal to a
float64 dense reference, and in the engine token-exact against the gather + SDPA path it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.kv_cache import KVCache
from svrmad_local.engine.params import SamplingParams
from svrmad_local import kernels
from svrmad_local.kernels import cpu_decode
from svrmad_local.kernels._backend import interpreter_ready

from .model_zoo import EXACT, loop_greedy, make_zoo_model, rand_prompt

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason=f"no C++ toolchain: {cpu_decode.unavailable_reason()}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # fp32 accumulation either way; bf16 rounds the output


def dense_reference(q, k, v, table, lens, bs, scale, window, sinks):
    outs = []
    G = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        L = int(lens[b])
        pos = torch.arange(max(0, L - window) if window else 0, L)
        slots = table[b][pos // bs] * bs + pos % bs
        kk = k[slots].double().repeat_interleave(G, 1)
        vv = v[slots].double().repeat_interleave(G, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), kk) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        p = s.softmax(-1)[:, : len(pos)]
        outs.append(torch.einsum("hn,nhd->hd", p, vv))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window,with_sinks", [(4, 4, None, False), (6, 2, None, False),
                                                             (8, 2, 5, False), (4, 1, None, True), (6, 3, 7, True)])
# items of whole sequences / of one KV head (2 threads); a head size off the 8-lane vectors; and the
# default's shape (D = Dv = 64, blocks of 16), where eight keys share a reduction and a head's
# accumulator stays in registers over a block (windows cut those groups short)
@pytest.mark.parametrize("nseq,D,Dv,bs", [(5, 16, 8, 4), (2, 20, 8, 4), (5, 64, 64, 16), (2, 64, 64, 16)])
def test_matches_a_float64_reference_on_shuffled_block_tables(dtype, heads, kv_heads, window, with_sinks, nseq, D, Dv, bs):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    nblocks = 40
    lens = torch.tensor([1, 3, 4, 9, 30])[-nseq:]  # one key, partial and whole blocks, longer than the window
    width = -(-int(lens.max()) // bs)
    table = torch.stack([torch.randperm(nblocks, generator=g)[:width] for _ in lens])
    k = torch.randn(nblocks * bs, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(nblocks * bs, kv_heads, Dv, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, D, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    out = cpu_decode.paged_decode_cpu(q, k, v, table, lens, bs, 0.3, window, sinks)
    assert out.dtype == dtype and out.shape == (len(lens), heads, Dv)
    ref = dense_reference(q, k, v, table, lens, bs, 0.3, window, sinks)
    assert (out.double() - ref).abs().max() < TOL[dtype]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (8, 1), (16, 4)])
@pytest.mark.parametrize("nseq", [1, 6])  # items of one KV head, and of whole sequences (2 threads)
def test_sharing_a_kv_row_between_query_heads_changes_no_bit(heads, kv_heads, nseq):
    """The heads of one KV group read each K/V row once (up to three at a time, csrc `dots8_heads` /
    `axpy_heads`), with the arithmetic of one head at a time: the output equals, bit for bit, the
    same cache with every KV head repeated for its query heads (one head a group)."""
    g = torch.Generator().manual_seed(heads + kv_heads + nseq)
    bs, nblocks, G = 16, 48, heads // kv_heads
    lens = torch.tensor([70, 33, 16, 8, 1, 45])[:nseq]  # whole eight-key groups and a ragged tail
    table = torch.stack([torch.randperm(nblocks, generator=g)[:5] for _ in lens])
    k, v = (torch.randn(nblocks * bs, kv_heads, 64, generator=g) for _ in range(2))
    q = torch.randn(nseq, heads, 64, generator=g)
    grouped = cpu_decode.paged_decode_cpu(q, k, v, table, lens, bs, 0.125)
    alone = cpu_decode.paged_decode_cpu(q, k.repeat_interleave(G, 1).contiguous(), v.repeat_interleave(G, 1).contiguous(),
                                        table, lens, bs, 0.125)
    assert torch.equal(grouped, alone)


@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (300, False), (200, True)])
def test_long_contexts_cut_in_chunks_match_the_reference_whatever_the_thread_count(window, with_sinks):
    """A context longer than csrc CHUNK_TOKENS (128) is attended in chunks whose partial softmaxes are
    joined (windows starting mid-chunk, sinks joining once); the chunks are fixed by position, not by
    the threads, so one thread and two give the same bits, and a sequence of one chunk gets the bits
    it gets alone."""
    g = torch.Generator().manual_seed(7 + (window or 0))
    bs, heads, kv_heads = 16, 9, 3
    lens = torch.tensor([1, 128, 129, 700, 45, 1031])  # one key, one whole chunk, one key past it, ragged tails
    width = -(-int(lens.max()) // bs)
    nblocks = width * len(lens)
    table = torch.randperm(nblocks, generator=g).view(len(lens), width)
    k, v = (torch.randn(nblocks * bs, kv_heads, 64, generator=g) for _ in range(2))
    q = torch.randn(len(lens), heads, 64, generator=g)
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.paged_decode_cpu(q, k, v, table, lens, bs, 0.125, window, sinks)
        torch.set_num_threads(2)
        two = cpu_decode.paged_decode_cpu(q, k, v, table, lens, bs, 0.125, window, sinks)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    ref = dense_reference(q, k, v, table, lens, bs, 0.125, window, sinks)
    assert (two.double() - ref).abs().max() < 1e-5
    for i in (0, 1, 4):  # a sequence of one chunk, alone
        alone = cpu_decode.paged_decode_cpu(q[i:i + 1], k, v, table[i:i + 1], lens[i:i + 1], bs, 0.125, window, sinks)
        assert torch.equal(alone[0], two[i])


def engine(model, **kw):
    return Engine(model, None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4, **kw))


@pytest.mark.parametrize("name", EXACT)
def test_in_place_decode_is_token_exact_against_the_gather_path(name, monkeypatch):
    model = make_zoo_model(name)
    prompts = [rand_prompt(n, 70 + n) for n in (2, 9, 19)]
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    gathered = engine(model, attention="sdpa")
    assert "paged-decode" not in gathered.info["attention"]
    want = gathered.generate_sync(prompts, params)
    in_place = engine(model)
    latent = in_place.spec.has_latent
    assert "paged-decode:cpu" in in_place.info["attention"]
    gathers = []
    real = KVCache.gather
    monkeypatch.setattr(KVCache, "gather", lambda self, layer, slots: gathers.append(slots.shape) or real(self, layer, slots))
    got = in_place.generate_sync(prompts, params)
    for w, o in zip(want, got):
        for a, b in zip(w.completions, o.completions):
            assert a.token_ids == b.token_ids, name
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, name
    assert [c.token_ids for c in got[1].completions] == [loop_greedy(model, prompts[1], 8)] * 2, name
    if not latent:  # per-head K/V layers gather for prefill chunks only, never for decode rows
        decode_steps = sum(len(c.token_ids) for o in got for c in o.completions) - 2 * len(prompts)
        assert decode_steps > 0 and len(gathers) <= 3 * len(model.model.layers), name


def test_attention_paged_is_refused_where_it_cannot_run(monkeypatch):
    model = make_zoo_model("llama")
    monkeypatch.setattr(cpu_decode, "available", lambda: False)
    monkeypatch.setattr(cpu_decode, "unavailable_reason", lambda: "no compiler")
    with pytest.raises(ValueError, match="attention='paged' needs Triton .* the compiled kernel: no compiler"):
        engine(model, attention="paged")
    assert "paged-decode" not in engine(model).info["attention"]
    with pytest.raises(ValueError, match="attention must be auto, flash, sdpa or paged"):
        engine(model, attention="cpu-paged")


@pytest.mark.skipif(not kernels.HAS_TRITON or not interpreter_ready(), reason="needs Triton's interpreter")
@pytest.mark.parametrize("name", ["llama", "gpt-oss", "mistral-sliding"])
def test_the_triton_decode_path_is_token_exact_under_the_interpreter(name):
    """The GPU decode path (kernels.paged_decode's Triton kernel), run on the CPU by Triton's interpreter."""
    model = make_zoo_model(name)
    prompts = [rand_prompt(n, 90 + n) for n in (4, 13)]
    eng = engine(model, kernel_impl="triton", attention="paged")
    assert "paged-decode:triton" in eng.info["attention"]
    got = eng.generate_sync(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, 6) for p in prompts], name


@pytest.mark.parametrize("heads,kv_heads,window", [(9, 3, None), (6, 2, 5), (4, 4, None)])
@pytest.mark.parametrize("lens", [[1, 37, 300, 129], [300, 290, 1000, 77]])  # one KV head an item; all of them
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # read in place; widened into a buffer
def test_a_bf16_cache_gives_the_bits_of_its_fp32_copy(heads, kv_heads, window, lens, dtype):
    """bf16 K/V rows are widened to fp32 as the fp32 loops read them (eight keys a reduction, the heads of
    a KV group sharing each row), fp16 rows into a buffer first for the same loops: the output is the fp32
    kernel's on the widened cache, rounded to the cache's dtype."""
    g = torch.Generator().manual_seed(heads)
    bs, nblocks, D = 16, 80, 64
    lens = torch.tensor(lens)
    table = torch.stack([torch.randperm(nblocks, generator=g)[:63] for _ in lens])
    k, v = (torch.randn(nblocks * bs, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), heads, D, generator=g).to(dtype)
    out = cpu_decode.paged_decode_cpu(q, k, v, table, lens, bs, 0.125, window)
    wide = cpu_decode.paged_decode_cpu(q.float(), k.float(), v.float(), table, lens, bs, 0.125, window)
    assert out.dtype == dtype and torch.equal(out, wide.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,D,Dv,window,with_sinks", [(9, 3, 64, 64, None, False), (8, 2, 64, 128, 200, True),
                                                                 (6, 2, 32, 32, None, False), (4, 4, 40, 96, 37, False)])
def test_the_avx512_loops_give_the_avx2_loops_bits(dtype, heads, kv_heads, D, Dv, window, with_sinks):
    """Where the CPU has AVX-512 the kernel runs sixteen-lane loops (two keys' eight-lane chains in one
    vector, 64 value columns at a time, sixteen exponentials at once): every lane does the eight-lane
    loops' arithmetic in their order, so the output is the AVX2 build's, bit for bit. Lengths with tails of
    every size (fewer than eight keys, eight to fifteen past a multiple of sixteen), one KV head an item
    and whole rows, a window and sinks."""
    mod = cpu_decode._KERNEL.module()
    full = mod.set_isa_level(99)
    if mod.isa_level() < 1:
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(D + Dv)
    bs, nblocks = 16, 200
    lens = torch.tensor([1, 7, 8, 23, 300, 129, 1000, 77, 250, 16])
    table = torch.stack([torch.randperm(nblocks, generator=g)[:63] for _ in lens])
    k = torch.randn(nblocks * bs, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(nblocks * bs, kv_heads, Dv, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) if with_sinks else None
    outs = {}
    try:
        for level, batch in ((1, lens), (0, lens), (1, lens[:1]), (0, lens[:1])):  # whole rows; one KV head an item
            mod.set_isa_level(level)
            q = torch.randn(len(batch), heads, D, generator=torch.Generator().manual_seed(len(batch))).to(dtype)
            outs[level, len(batch)] = cpu_decode.paged_decode_cpu(q, k, v, table[:len(batch)], batch, bs, 0.125,
                                                                   window, sinks)
    finally:
        mod.set_isa_level(full)
    assert torch.equal(outs[1, len(lens)], outs[0, len(lens)]) and torch.equal(outs[1, 1], outs[0, 1])


def test_slots_no_token_wrote_never_reach_the_output():
    g = torch.Generator().manual_seed(3)
    bs, lens = 4, torch.tensor([2, 7])
    table = torch.tensor([[5, 1], [2, 4]])
    k, v = torch.randn(8 * bs, 2, 8, generator=g), torch.randn(8 * bs, 2, 8, generator=g)
    q = torch.randn(2, 4, 8, generator=g)
    want = dense_reference(q, k, v, table, lens, bs, 0.5, None, None)
    written = torch.zeros(k.shape[0], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        for p in range(n):
            written[int(table[i, p // bs]) * bs + p % bs] = True
    k[~written], v[~written] = float("nan"), float("nan")
    got = cpu_decode.paged_decode_cpu(q, k, v, table, lens, bs, 0.5)
    assert (got.double() - want).abs().max() < 1e-5
    from svrmad_local.kernels import paged_decode

    for impl in ["torch"] + (["triton"] if kernels.HAS_TRITON and interpreter_ready() else []):
        got = paged_decode(q, k, v, table.int(), lens.int(), bs, 0.5, kernel_impl=impl)
        assert (got.double() - want).abs().max() < 1e-5, impl


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux /proc")
def test_the_kernel_shares_torchs_openmp_runtime():
    """Built with -fopenmp (else its parallel_for runs on one thread), it must resolve libgomp to the
    copy torch loaded: a second OpenMP runtime would keep a second set of threads."""
    import subprocess
    import sys

    if not cpu_decode.available():
        pytest.skip(f"no kernel: {cpu_decode.unavailable_reason()}")
    # a fresh process that runs the kernel: other test modules import libraries with an OpenMP of their
    # own (scikit-learn for the signals study), which a run of the engine never loads
    script = ("import torch\nfrom pathlib import Path\nfrom svrmad_local.kernels import cpu_decode\n"
              "assert cpu_decode.available()\n"
              "print('\\n'.join({l.split()[-1] for l in Path('/proc/self/maps').read_text().splitlines() if 'libgomp' in l}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    gomp = set(out.split())
    assert len(gomp) <= 1, gomp
