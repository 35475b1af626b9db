"""The GPU paths, on a CUDA device (skipped without one; CI has none; docs/gpu-check.md runs them):

* every architecture of the zoo token-exact against a cache-free transformers loop on the GPU, through
  the SDPA path with CUDA graphs (engine/graphs.py) and without, and through the compiled Triton
  cascade kernels (fp32, TF32 off: exactness is a statement about the same arithmetic, not about
  reduced-precision matmuls);
* the compiled Triton kernels (cascade attention with windows and sinks, merge, token statistics, the
  decoder's fused ops, paged decode in one split and into the caller's output, the sampling kernels)
  against their torch references on CUDA tensors in fp32, fp16 and bf16;
* our decoder (engine/decoder.py) over the Triton fused ops, against the modules and a cache-free loop; its
  RoPE tables filled at build, the rotary module's bits;
* the few-row linear (kernels/skinny.py) against its reference and from a graph, its tensor-descriptor configs
  against their pointer twins, its normed prologue against add_rms_norm then the kernel, and the engine over it;
* where a step's sampling runs, timed at build (engine/choices.py `sampling_choice`) and kept;
* programmatic dependent launch on an sm_90 GPU: able, and the same bits as without it.

Run on a GPU machine, from a process where triton was not imported in interpreter mode:
    TRITON_INTERPRET=0 python -m pytest -q tests/test_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from svrmad_local import kernels  # noqa: E402

# The suite's conftest puts Triton in interpreter mode (for the CPU tests): on a GPU that interprets every
# kernel, copying through the host, so the graphs and the timings here would fail for that alone.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(kernels._backend.interpreter_ready(),
                                 reason="Triton is in interpreter mode (the suite's default, TRITON_INTERPRET=1): "
                                        "run TRITON_INTERPRET=0 python -m pytest tests/test_gpu.py")]
from svrmad_local.engine.engine import Engine, EngineConfig  # noqa: E402
from svrmad_local.engine.params import SamplingParams  # noqa: E402
from svrmad_local.kernels import Level, cascade_attention, merge_states, reference_token_stats, token_stats  # noqa: E402

from .model_zoo import EXACT, WINDOW, full_logprobs, loop_greedy, make_zoo_model, rand_prompt  # noqa: E402
from .rounding import assert_one_rounding  # noqa: E402

NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
CUDA = torch.device("cuda")


def _compiled_triton():
    if not kernels.HAS_TRITON:
        pytest.skip("triton is not installed")
    if kernels._backend.interpreter_ready():
        pytest.skip("triton was imported in interpreter mode (run with TRITON_INTERPRET=0)")


@pytest.fixture(autouse=True)
def _exact_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module", params=EXACT)
def zoo(request):
    return request.param, make_zoo_model(request.param).to(CUDA)


@pytest.mark.parametrize("path", ["sdpa", "sdpa-no-graphs", "cascade-triton"])
def test_zoo_is_token_exact_on_the_gpu(zoo, path):
    name, model = zoo
    # 64 MiB: the graphs keep ~36 MiB of it on an H200 (the allocator hands the pool whole 20 MiB segments)
    kw = dict(kv_cache_memory=64 * 2**20, block_size=4, cuda_graphs="off" if path == "sdpa-no-graphs" else "auto")
    if path == "cascade-triton":
        _compiled_triton()
        kw.update(cascade="on", kernel_impl="triton")
    eng = Engine(model, None, EngineConfig(**kw))
    assert eng.runner.device.type == "cuda"
    head = rand_prompt(3 * WINDOW + 1, 1)
    prompts = [head + rand_prompt(n, 10 + n) for n in (2, 7, 13)] + [rand_prompt(2 * WINDOW + 5, 2)]
    refs = [loop_greedy(model, p, NEW) for p in prompts]
    assert [o.completions[0].token_ids for o in eng.generate_sync(prompts, GREEDY)] == refs, name
    assert [o.completions[0].token_ids for o in eng.generate_sync(prompts[:3], GREEDY)] == refs[:3], name
    forks = eng.generate_sync([prompts[1]], SamplingParams(n=3, temperature=0, max_tokens=NEW, ignore_eos=True))[0]
    assert [c.token_ids for c in forks.completions] == [refs[1]] * 3, name
    # teacher-forced statistics on the GPU equal log_softmax of a plain forward
    cont = rand_prompt(WINDOW + 3, 41)
    got = eng.score_sync(prompts[3], cont, topk=4)
    rows = full_logprobs(model, prompts[3] + cont)[len(prompts[3]) - 1: len(prompts[3]) + len(cont) - 1]
    assert got.logprobs == pytest.approx([rows[i, t].item() for i, t in enumerate(cont)], abs=1e-4), name
    if path == "sdpa":  # decode steps replayed from CUDA graphs captured at start-up
        graphs = eng.info["cuda_graphs"]
        static = eng.runner.static
        if name in ("llama", "qwen2", "qwen3", "mistral-sliding", "phi3-sliding", "gemma3", "qwen2-sliding"):
            # dense models capture every shape and replay every decode step
            assert graphs.startswith("on (") and static.failed == {} and static.replays > 0, (name, graphs)
        else:  # fp32 MoE: transformers' experts may copy to the host inside an op, which the probe cannot see; the
            # info then names the shapes that failed and why; gpu_probe.py holds the packed bf16 ones to all shapes
            assert graphs.startswith("on (") or graphs.startswith("off: the decode step returns to the host"), \
                (name, graphs)
            assert static is None or static.replays > 0 or "failed, run eagerly" in graphs, (name, graphs)


@pytest.mark.parametrize("graphs", ["auto", "off"])
@pytest.mark.parametrize("name", EXACT)
def test_our_decoder_on_the_gpu_is_the_modules(name, graphs):
    """decoder='ours' on CUDA runs the Triton fused ops (kernels/fused_triton.py): token-exact against a
    cache-free loop of the same model (its norms swapped for the same ops), log-probs within 1e-4 of the
    modules' engine, with and without graphs. What "auto" needs before it takes ours on a GPU."""
    _compiled_triton()
    model = make_zoo_model(name).to(CUDA)
    kw = dict(kv_cache_memory=64 * 2**20, block_size=4, cuda_graphs=graphs)
    eng = Engine(model, None, EngineConfig(decoder="ours", **kw))
    assert eng.execution.decoder.value == "ours" and "Triton" in eng.execution.decoder.reason, eng.execution.line()
    prompts = [rand_prompt(2 * WINDOW + 5, 2), rand_prompt(7, 3)]
    outs = eng.generate_sync(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in outs] == [loop_greedy(model, p, NEW) for p in prompts], name
    assert not any(k.startswith("fused_") for k in kernels._backend.disabled()), kernels._backend.disabled()
    modules = Engine(model, None, EngineConfig(decoder="modules", **kw)).generate_sync(prompts, GREEDY)
    for a, b in zip(outs, modules):
        assert a.completions[0].token_ids == b.completions[0].token_ids, name
        assert a.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-4), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_decoder_on_the_gpu_reads_rope_from_tables_with_the_modules_bits(dtype):
    """On CUDA our decoder fills its RoPE tables at build (engine/families.Rotary.prepare), kept only where the
    module's rows at a step's shapes are the tables' bits: here for every zoo architecture (each a static rope
    type), and at 64 random positions at once the rows read are the module's."""
    for name in EXACT:
        model = make_zoo_model(name).to(CUDA).to(dtype)
        eng = Engine(model, None, EngineConfig(decoder="ours", kv_cache_memory=64 * 2**20, block_size=4,
                                               cuda_graphs="off"))
        rot = eng.runner.decoder.rotary
        eng.close()
        assert rot.fixed, name
        n = model.config.max_position_embeddings
        pos = torch.randint(0, n, (1, 64), device=CUDA, generator=torch.Generator(device="cuda").manual_seed(1))
        h = torch.zeros(1, 64, 1, dtype=dtype, device=CUDA)
        for key, got in rot(h, pos).items():
            assert all(torch.equal(g, w) for g, w in zip(got, rot._rows(key, h, pos))), (name, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_triton_ops_on_cuda_match_their_references(dtype):
    """The residual add, RoPE and the cache writes bit for bit; norms and activations within rounding."""
    _compiled_triton()
    from svrmad_local.kernels import fused

    ops = fused.Ops(CUDA, dtype)
    assert ops.impl == "triton"
    g = torch.Generator(device=CUDA).manual_seed(0)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, device=CUDA, generator=g) * s).to(dtype)  # noqa: E731
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for style in (fused.PLAIN, fused.CAST_LAST, fused.GEMMA):
        x, res, w = rnd(9, 576, s=3), rnd(9, 576), rnd(576)
        y, s_ = ops.add_rms_norm(x, res, w, 1e-6, style)
        y_ref, s_ref = fused.reference_add_rms_norm(x, res, w, 1e-6, style)
        assert torch.equal(s_, s_ref)
        torch.testing.assert_close(y, y_ref, **close)
    T, H, KVH, D = 7, 8, 2, 64
    q, k, v = rnd(T, H, D, s=4), rnd(T, KVH, D, s=4), rnd(T, KVH, D)
    ang = torch.randn(T, D // 2, device=CUDA, generator=g) * 30
    cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
    slots = torch.tensor([5, 1, 9, 3, 0, 11, 7], device=CUDA)
    caches = [torch.zeros(12, KVH, D, dtype=dtype, device=CUDA) for _ in range(4)]
    got = ops.rope_store(q, k, v, cos, sin, caches[0], caches[1], slots)
    want = fused.reference_rope_store(q, k, v, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    gate, up = rnd(9, 1536, s=3), rnd(9, 1536)
    for act in ("silu", "gelu_tanh"):
        torch.testing.assert_close(ops.act_mul(gate, up, act), fused.reference_act_mul(gate, up, act), **close)


DTYPES = {"fp32": (torch.float32, 1e-5), "fp16": (torch.float16, 2e-2), "bf16": (torch.bfloat16, 3e-2)}


def _naive(q, k, v, levels, scale, q_pos, window, sinks):
    """Every query over the concatenation of its levels' runs, in float64 on the CPU."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    g = q.shape[1] // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        keys, vals, pos = [], [], []
        for lv in levels:
            if (lv.query_idx.cpu() == i).any() and lv.kv_len:
                keys.append(k[lv.block_table.cpu()].flatten(0, 1)[:lv.kv_len])
                vals.append(v[lv.block_table.cpu()].flatten(0, 1)[:lv.kv_len])
                pos.append(torch.arange(lv.kv_len) + lv.kv_start)
        kf, vf, pf = torch.cat(keys).repeat_interleave(g, 1), torch.cat(vals).repeat_interleave(g, 1), torch.cat(pos)
        s = torch.einsum("hd,khd->hk", q[i], kf) * scale
        if window is not None:
            s[:, pf <= int(q_pos[i]) - window] = float("-inf")
        if sinks is not None:
            s = torch.cat([s, sinks.double().cpu()[:, None]], 1)
            vf = torch.cat([vf, torch.zeros(1, *vf.shape[1:], dtype=vf.dtype)])
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vf)
    return out


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("window,sinks", [(None, False), (40, False), (None, True), (24, True)])
def test_triton_cascade_on_cuda_matches_float64(dtype, window, sinks):
    """A shared prefix, a subgroup's history and one suffix per query, blocks scattered in the cache."""
    _compiled_triton()
    dt, tol = DTYPES[dtype]
    g = torch.Generator(device=CUDA).manual_seed(0)
    nq, hq, hkv, d, bs, nblocks = 6, 8, 2, 64, 16, 64
    k = torch.randn(nblocks, bs, hkv, d, generator=g, device=CUDA).to(dt)
    v = torch.randn(nblocks, bs, hkv, d, generator=g, device=CUDA).to(dt)
    q = torch.randn(nq, hq, d, generator=g, device=CUDA).to(dt)
    perm = torch.randperm(nblocks, generator=g, device=CUDA)
    levels = [Level(torch.arange(nq, device=CUDA), perm[:5], 75, 0),  # 4.7 blocks of question
              Level(torch.tensor([0, 2, 3], device=CUDA), perm[5:8], 40, 80)]
    q_pos = torch.zeros(nq, dtype=torch.long, device=CUDA)
    start = 8
    for i in range(nq):
        first = 128 if i in (0, 2, 3) else 80  # block-aligned, after the history
        n = 1 + 7 * i
        levels.append(Level(torch.tensor([i], device=CUDA), perm[start:start + 4], n, first))
        q_pos[i] = first + n - 1
        start += 4
    sk = torch.randn(hq, generator=g, device=CUDA) * 2 if sinks else None
    scale = d ** -0.5
    ref = _naive(q, k, v, levels, scale, q_pos, window, sk)
    for impl in ("torch", "triton"):
        got = cascade_attention(q, k, v, levels, scale, q_pos=q_pos, window=window, sinks=sk, kernel_impl=impl)
        err = ((got.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < tol, (impl, err)


def test_triton_merge_on_cuda_matches_torch():
    _compiled_triton()
    g = torch.Generator(device=CUDA).manual_seed(1)
    oa, ob = (torch.randn(33, 8, 64, generator=g, device=CUDA) for _ in range(2))
    la, lb = (torch.randn(33, 8, generator=g, device=CUDA) for _ in range(2))
    la[3], lb[5], la[7], lb[7] = float("-inf"), float("-inf"), float("-inf"), float("-inf")
    o1, l1 = merge_states(oa, la, ob, lb, kernel_impl="triton")
    o2, l2 = merge_states(oa, la, ob, lb, kernel_impl="torch")
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_triton_token_stats_on_cuda_match_the_reference(dtype, softcap):
    _compiled_triton()
    dt = DTYPES[dtype][0]
    g = torch.Generator(device=CUDA).manual_seed(2)
    T, H, V = 37, 256, 50_000  # V not a multiple of any tile
    hidden = torch.randn(T, H, generator=g, device=CUDA).to(dt)
    weight = (torch.randn(V, H, generator=g, device=CUDA) * H ** -0.5 * 4).to(dt)
    targets = torch.randint(0, V, (T,), generator=g, device=CUDA)
    got = token_stats(hidden, weight, targets, topk=20, kernel_impl="triton", softcap=softcap)
    ref = reference_token_stats(hidden, weight, targets, topk=20, softcap=softcap)
    for name in ("logprob", "entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), atol=2e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, atol=2e-4, rtol=1e-4)
    same = (got.topk_ids == ref.topk_ids).float().mean().item()
    assert same > 0.99, same  # ids may swap only where two logits tie to rounding


def test_auto_uses_triton_on_cuda_and_the_engine_reports_it():
    _compiled_triton()
    assert kernels.select_impl("auto", CUDA) == "triton"
    eng = Engine(make_zoo_model("llama").to(CUDA), None, EngineConfig(kv_cache_memory=4 * 2**20, block_size=4,
                                                                        cascade="on"))
    assert "cascade:triton" in eng.info["attention"], eng.info["attention"]
    assert os.environ.get("SVRMAD_KERNELS", "") != "torch"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_compiled_paged_kernels_fit_the_device_at_every_head_dim(dtype, head_dim):
    """Paged decode and prefill compiled for real (kernel_impl="triton": a compile error raises instead of
    falling back), up to fp32 at head dim 256, whose 64x64 tiles would pass the H100's shared memory
    and fail to compile: the tiles are fitted from their arithmetic (kernels._backend.fit_attn_tiles)."""
    _compiled_triton()
    from svrmad_local.kernels.paged_decode import paged_decode, reference_paged_decode
    from svrmad_local.kernels.paged_prefill import paged_prefill, reference_paged_prefill

    dt, tol = DTYPES[dtype]
    g = torch.Generator(device=CUDA).manual_seed(3)
    bs, blocks, hq, hkv = 16, 64, 8, 2
    k = torch.randn(blocks * bs, hkv, head_dim, generator=g, device=CUDA).to(dt)
    v = torch.randn(blocks * bs, hkv, head_dim, generator=g, device=CUDA).to(dt)
    table = torch.randperm(blocks, generator=g, device=CUDA)[:30].view(3, 10).int()
    lens = [150, 37, 160]
    q = torch.randn(3, hq, head_dim, generator=g, device=CUDA).to(dt)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    got = paged_decode(q, k, v, table, lens_t, bs, head_dim ** -0.5, kernel_impl="triton")
    ref = reference_paged_decode(q, k, v, table, lens_t, bs, head_dim ** -0.5)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < tol
    rows = [70, 37, 5]
    cu = [0, 70, 107, 112]
    qp = torch.randn(sum(rows), hq, head_dim, generator=g, device=CUDA).to(dt)
    got = paged_prefill(qp, k, v, table, cu, lens, bs, head_dim ** -0.5, kernel_impl="triton")
    ref = reference_paged_prefill(qp, k, v, table, cu, lens, bs, head_dim ** -0.5)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < tol


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_paged_decode_in_one_split_and_into_the_callers_output(dtype):
    """The one-split path (the split kernel stores the output, no merge) and `out=` (rows of a wider
    tensor) compiled: the bits of the merged path (a -inf sink runs the merge over the same math)."""
    _compiled_triton()
    from svrmad_local.kernels.paged_decode import paged_decode, reference_paged_decode

    dt, tol = DTYPES[dtype]
    g = torch.Generator(device=CUDA).manual_seed(5)
    bs, blocks, hq, hkv, d = 16, 64, 16, 8, 128
    k = torch.randn(blocks * bs, hkv, d, generator=g, device=CUDA).to(dt)
    v = torch.randn(blocks * bs, hkv, d, generator=g, device=CUDA).to(dt)
    table = torch.randperm(blocks, generator=g, device=CUDA)[:16].view(1, 16).int()
    q = torch.randn(1, hq, d, generator=g, device=CUDA).to(dt)
    lens = torch.tensor([200], dtype=torch.int32, device=CUDA)
    wide = torch.zeros(3, hq, d, dtype=dt, device=CUDA)
    one = paged_decode(q, k, v, table, lens, bs, d ** -0.5, kernel_impl="triton", num_splits=1, out=wide[1:2])
    merged = paged_decode(q, k, v, table, lens, bs, d ** -0.5, sinks=torch.full((hq,), float("-inf"), device=CUDA),
                          kernel_impl="triton", num_splits=1)
    assert one.data_ptr() == wide[1:2].data_ptr() and torch.equal(one, merged)
    assert (wide[0] == 0).all() and (wide[2] == 0).all()
    ref = reference_paged_decode(q, k, v, table, lens, bs, d ** -0.5)
    assert ((one.float() - ref.float()).norm() / ref.float().norm()).item() < tol


@pytest.mark.parametrize("rows,vocab", [(1, 151936), (32, 151936), (8, 49152)])
def test_compiled_sampling_kernels_give_the_torch_ops_rows_and_replay_from_a_graph(rows, vocab):
    """kernels/sample_pack.py compiled: tokens and top ids the torch ops' (engine/sampler.py `draw`,
    engine/stats.py), log-probs within 2e-5, entropies 1e-4; the same rows replayed from a CUDA graph."""
    _compiled_triton()
    from svrmad_local.engine import sampler, stats
    from svrmad_local.kernels.sample_pack import sample_pack

    g = torch.Generator(device=CUDA).manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=g, device=CUDA) * 4
    gen = torch.Generator().manual_seed(vocab)
    table = torch.stack([torch.rand(rows, generator=gen) + 0.3, torch.randint(1, 41, (rows,), generator=gen).double(),
                         torch.rand(rows, generator=gen) * 0.7 + 0.3, torch.rand(rows, generator=gen),
                         (torch.arange(rows) % 4 == 0).double()]).double().to(CUDA)
    toks = sampler.draw(logits, *sampler.columns(table, logits.dtype), 40)
    ref = stats.pack(toks, stats.stats_from_logits(logits, toks, 20))
    got = sample_pack(logits, table, 40, 20)
    assert torch.equal(got[:, 0], ref[:, 0]) and torch.equal(got[:, 23:], ref[:, 23:])
    torch.testing.assert_close(got[:, 1], ref[:, 1], atol=2e-5, rtol=0)
    torch.testing.assert_close(got[:, 2], ref[:, 2], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[:, 3:23], ref[:, 3:23], atol=2e-5, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_pack(logits, table, 40, 20)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_the_check_sees_a_blocking_copy_from_the_host():
    """Defect 5 on the device: `torch.tensor(values, device="cuda")` blocks the host; the staged copy
    (pinned, non_blocking) that the sampler and the runner use does not, and the sampler's step has none."""
    import random

    from svrmad_local.engine.graphs import HostSyncCheck
    from svrmad_local.engine.sampler import sample
    from svrmad_local.kernels._backend import staged

    with HostSyncCheck() as check:
        torch.tensor([1, 2, 3], device=CUDA)
    assert any("from the host, blocking" in s for s in check.syncs), check.syncs
    with HostSyncCheck() as check:
        staged([1, 2, 3], torch.long, CUDA)
        logits = torch.randn(4, 50, device=CUDA)
        sample(logits, [0.0, 0.7, 1.0, 0.5], [0, 5, 0, 20], [1.0, 0.9, 0.8, 1.0], [random.Random(i) for i in range(4)])
    assert check.syncs == [], check.syncs


@pytest.fixture(scope="module")
def quant_folders(tmp_path_factory):
    from .quant_zoo import write_all

    return write_all(tmp_path_factory.mktemp("quant"))


@pytest.mark.parametrize("name", ["gpt-oss", "deepseek", "deepseek-fused"])
def test_packed_checkpoints_are_token_exact_on_the_gpu(quant_folders, name):
    """The published formats kept packed, computed by the compiled Triton GEMMs (MXFP4 grouped experts,
    FP8 dense and grouped) and, for DeepSeek, absorbed MLA decode, in fp32 (the kernels' exact dot): greedy
    tokens and log-probs equal the dequantized fp32 checkpoint's cache-free loop, and decode replays graphs."""
    _compiled_triton()
    from svrmad_local.models.loader import load_model
    from svrmad_local.models.quant import Fp8Experts, Mxfp4Experts

    qdir, rdir = quant_folders[name]
    ref = load_model(rdir, device="cuda", dtype="fp32").model
    eng = Engine.from_pretrained(qdir, device="cuda", dtype="fp32", quantization="native",
                                 kv_cache_memory=64 * 2**20, block_size=4)
    try:
        assert any(isinstance(m, (Mxfp4Experts, Fp8Experts)) for m in eng.model.modules()), name
        assert eng.info["cuda_graphs"].startswith("on ("), eng.info["cuda_graphs"]
        if name.startswith("deepseek"):
            assert "mla-absorbed:triton" in eng.info["attention"], eng.info["attention"]
        prompts = [rand_prompt(2 * WINDOW + 3, 1), rand_prompt(WINDOW + 1, 2), rand_prompt(5, 3)]
        outs = eng.generate_sync(prompts, GREEDY)
        for p, o in zip(prompts, outs):
            c = o.completions[0]
            assert c.token_ids == loop_greedy(ref, p, NEW), name
            lp = full_logprobs(ref, p + c.token_ids)
            want = [lp[len(p) + i - 1, t].item() for i, t in enumerate(c.token_ids)]
            assert c.logprobs == pytest.approx(want, abs=1e-4), name
        assert eng.runner.static.replays > 0 and kernels._backend.disabled() == {}
    finally:
        eng.close()


def test_tensor_parallel_on_one_gpu_matches_one_process(tmp_path):
    """Two tensor-parallel ranks sharing the one GPU over gloo (SVRMAD_DIST_BACKEND=gloo: nccl wants a
    GPU a rank), fp32: the split shapes, the packed experts by expert (MXFP4 GPT-OSS, FP8 DeepSeek-V3)
    and their compiled kernels on the device give a single GPU process's greedy tokens and seeded forks,
    and its log-probs within 1e-4 (the row-parallel sums add in another order)."""
    _compiled_triton()
    from svrmad_local.models.loader import load_model

    from .test_tp import run_worker, write_checkpoints
    from .tp_worker import CONFIG, workload

    ckpts = write_checkpoints(tmp_path / "ckpt")
    out = tmp_path / "tp.json"
    got = run_worker(out, "--device", "cuda", str(out), *map(str, ckpts.values()),
                     env={"SVRMAD_DIST_BACKEND": "gloo", "TRITON_INTERPRET": "0"})
    for name, path in ckpts.items():
        tp = got[str(path)]
        one = workload(Engine(load_model(path, device="cuda", dtype="fp32").model, None, EngineConfig(**CONFIG)))
        assert tp["world"] == 2 and tp["collectives"]["all_reduce"] > 0, name
        assert tp["greedy"] == one["greedy"] and tp["forks"] == one["forks"], name
        for a, b in zip(tp["greedy_logprobs"], one["greedy_logprobs"]):
            assert a == pytest.approx(b, abs=1e-4), name
        assert tp["score"] == pytest.approx(one["score"], abs=1e-4), name


def test_a_one_rank_nccl_group_captures_the_decode_graph_with_its_all_reduce_inside(monkeypatch):
    """Graphs under --tp on a GPU: a world-size-1 NCCL group taken as a tensor-parallel group (the engine's
    size check waived), so our decoder calls its two all-reduces a layer. Every decode shape is captured
    at start-up with them inside: replayed steps call no all-reduce from the host, the steps that run
    eagerly call 2 a layer, and the tokens are a cache-free loop's."""
    import torch.distributed as dist

    from svrmad_local.engine import tp

    if not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_zoo_model("llama").to(CUDA)
        model.svrmad_tp = tp.Group((0,), 0, dist.group.WORLD)
        monkeypatch.setattr(tp, "group_of", lambda m: getattr(m, "svrmad_tp", None))
        eng = Engine(model, None, EngineConfig(kv_cache_memory=64 * 2**20, block_size=4, max_num_seqs=4))
        static = eng.runner.static
        assert eng.built.sharded and static is not None and static.capture, eng.info["cuda_graphs"]
        assert static.failed == {} and set(static.graphs) == set(static.shapes), eng.info["cuda_graphs"]
        counts = {"all_reduce": 0, "steps": 0}
        all_reduce, execute = dist.all_reduce, eng.runner.execute

        def counted_reduce(*a, **k):
            counts["all_reduce"] += 1
            return all_reduce(*a, **k)

        def counted_step(step, *rest):
            counts["steps"] += 1
            return execute(step, *rest)

        monkeypatch.setattr(dist, "all_reduce", counted_reduce)
        eng.runner.execute = counted_step
        prompts = [rand_prompt(2 * WINDOW + 5 + i, 300 + i) for i in range(3)]
        got = eng.generate_sync(prompts, GREEDY)
        assert [o.completions[0].token_ids for o in got] == [loop_greedy(model, p, NEW) for p in prompts]
        layers = model.config.num_hidden_layers
        assert static.replays > 0 and counts["all_reduce"] == 2 * layers * (counts["steps"] - static.replays)
        eng.close()
    finally:
        if made:
            dist.destroy_process_group()


def test_the_sampling_choice_is_timed_on_the_gpu_and_kept(tmp_path):
    """engine/choices.py `sampling_choice` on CUDA: both sides timed in a graph at each power of two, the
    kernels taken where faster (the reason gives the figures), the figures kept for the next build."""
    from svrmad_local.engine import choices

    _compiled_triton()
    head = torch.zeros(151936, 64, device=CUDA, dtype=torch.bfloat16)
    rule, said = choices.sampling_choice(head, "auto", 8, cache=tmp_path)
    assert [r for r, _ in rule.picks] == [1, 2, 4, 8] and said.value == str(rule), said
    assert "at build" in said.reason and "did not run" not in said.reason, said.reason
    again, said_again = choices.sampling_choice(head, "auto", 8, cache=tmp_path)
    assert again == rule and "kept from an earlier build" in said_again.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_skinny_linear_on_cuda_matches_its_reference_and_replays_from_a_graph(dtype):
    """kernels/skinny.py compiled: every config the engine may pick, at 1-8 rows (the tl.dot ones to 32), odd N
    and K, with a bias, within a few fp32 ulps of the fp32 reference (fp32) or one rounding (fp16/bf16,
    tests/rounding.py); captured in a CUDA graph and replayed, the same bits as eager (no host sync; split-K
    summed in order). A launch that asks for more shared memory than the device has (the widest fp32 tiles
    at 32 rows) is no candidate there, as the build's timing treats it (gemv.time_all); the configs
    gemv="skinny" forces (skinny.default) must hold at every row count."""
    _compiled_triton()
    from triton.runtime.errors import OutOfResources

    from svrmad_local.kernels import skinny

    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 1003, 2053
    w = (torch.randn(n, k, device=CUDA, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=CUDA, generator=g).to(dtype)
    too_large = []
    for cfg in skinny.CONFIGS:
        ran = None
        for m in [m for m in range(1, skinny.MAX_ROWS + 1) if skinny.runs(cfg, m)]:
            x = torch.randn(m, k, device=CUDA, generator=g).to(dtype)
            try:
                got = skinny.skinny_linear(x, w, b, cfg)
            except OutOfResources:
                too_large.append((str(cfg), m))
                continue
            ref, ran = skinny.reference(x, w, b), x
            if dtype == torch.float32:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            else:
                assert_one_rounding(got, ref, (cfg, m))
        assert ran is not None, (cfg, too_large)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = skinny.skinny_linear(ran, w, b, cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, skinny.skinny_linear(ran, w, b, cfg)), cfg
    assert not {(str(skinny.default(m)), m) for m in range(1, skinny.MAX_ROWS + 1)} & set(too_large), too_large


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_skinny_tma_configs_read_their_twins_tiles_on_cuda(dtype):
    """The `tma` configs compiled, where a tensor descriptor reads the weight (K = 2,048: aligned rows), at
    1-32 rows, plain and gated: the same bits as the same config loading by pointer, eager and replayed from
    a CUDA graph (the descriptor is a launch argument, captured by value)."""
    _compiled_triton()
    from dataclasses import replace

    from triton.runtime.errors import OutOfResources

    from svrmad_local.kernels import skinny

    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 1003, 2048
    w = (torch.randn(n, k, device=CUDA, generator=g) / k ** 0.5).to(dtype)
    assert skinny.reads_by_tma(w)
    ran = []
    for cfg in (c for c in skinny.CONFIGS if c.tma):
        for m in (1, 3, 8, 16, 32):
            gate_up = torch.randn(m, 2 * k, device=CUDA, generator=g).to(dtype)
            gate, up = gate_up[:, :k], gate_up[:, k:]
            for u in (None, up):
                try:
                    got = skinny.skinny_linear(gate, w, None, cfg, up=u)
                except OutOfResources:  # fp32 tiles at 32 rows: no candidate here (gemv.time_all leaves them out)
                    continue
                assert torch.equal(got, skinny.skinny_linear(gate, w, None, replace(cfg, tma=False), up=u)), (cfg, m)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = skinny.skinny_linear(gate, w, None, cfg, up=u)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, got), (cfg, m)
                ran.append((str(cfg), m))
    assert {c for c, _m in ran} == {str(c) for c in skinny.CONFIGS if c.tma}, ran


def test_the_skinny_normed_prologue_is_add_rms_norm_then_the_kernel_on_cuda():
    """Every config with the add + RMSNorm in its prologue (bf16, Qwen3-1.7B's hidden size, 1, 8 and 32 rows:
    each a compile of its own, ~80 in all), x a tensor and a split-K linear's shares: the new residual bit for
    bit add_rms_norm's, and the output the bits of add_rms_norm then the same config, eager and replayed from
    a CUDA graph. Exact, because the rows are small integers: their sum of squares is exact in any order, so
    the prologue's norm is add_rms_norm's to the bit (on other rows it may differ by the rounding of that sum:
    tests/test_kernels_skinny.py)."""
    _compiled_triton()
    from triton.runtime.errors import OutOfResources

    from svrmad_local.kernels import fused_triton, skinny
    from svrmad_local.kernels.norms import PLAIN
    from svrmad_local.kernels.shares import Shares

    g, dtype = torch.Generator(device="cuda").manual_seed(0), torch.bfloat16
    n, k = 1003, 2048
    w = (torch.randn(n, k, device=CUDA, generator=g) / k ** 0.5).to(dtype)
    norm = ((1 + 0.1 * torch.randn(k, device=CUDA, generator=g)).to(dtype), 1e-6, PLAIN)
    ran = set()
    for cfg in skinny.CONFIGS:
        for m in [m for m in (1, 8, 32) if skinny.runs(cfg, m)]:
            ints = lambda *shape: torch.randint(-2, 3, shape, device=CUDA, generator=g).float()  # noqa: E731
            res, parts = ints(m, k).to(dtype), ints(2, m, k)
            for x in (ints(m, k).to(dtype), Shares(parts, dtype)):
                try:
                    got, new = skinny.skinny_linear(x, w, None, cfg, norm=norm, residual=res)
                except OutOfResources:  # no candidate here (gemv.time_all leaves it out)
                    continue
                y, new_ref = fused_triton.add_rms_norm(x, res, *norm)
                assert torch.equal(new, new_ref), (cfg, m)
                assert torch.equal(got, skinny.skinny_linear(y, w, None, cfg)), (cfg, m)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = skinny.skinny_linear(x, w, None, cfg, norm=norm, residual=res)[0]
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, got), (cfg, m)
                ran.add(str(cfg))
    assert ran >= {str(skinny.default(m)) for m in (1, 32)}, ran


@pytest.mark.parametrize("gemv", ["skinny", "auto"])
def test_the_engine_over_the_skinny_linears_is_token_exact_on_the_gpu(gemv, tmp_path, monkeypatch):
    """gemv='skinny' (every decode linear and the LM head through the kernel) and 'auto' (timed, though the
    test model is far below the size auto times from), graphs on: token-exact against a cache-free loop,
    log-probs within 1e-4 of gemv='torch'; the record says what ran."""
    from svrmad_local.engine import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "MIN_BYTES", 0)
    _compiled_triton()
    model = make_zoo_model("qwen3").to(CUDA)
    kw = dict(kv_cache_memory=64 * 2**20, block_size=4, cache_dir=str(tmp_path))
    eng = Engine(model, None, EngineConfig(gemv=gemv, **kw))
    line = eng.execution.line()
    assert eng.execution.gemv.value.startswith("skinny for") or (gemv == "auto" and eng.execution.gemv.value == "torch"), line
    prompts = [rand_prompt(2 * WINDOW + 5, 2), rand_prompt(7, 3)]
    outs = eng.generate_sync(prompts, GREEDY)
    assert [o.completions[0].token_ids for o in outs] == [loop_greedy(model, p, NEW) for p in prompts], line
    assert eng.info["cuda_graphs"].startswith("on ("), eng.info["cuda_graphs"]
    plain = Engine(model, None, EngineConfig(gemv="torch", **kw)).generate_sync(prompts, GREEDY)
    for a, b in zip(outs, plain):
        assert a.completions[0].logprobs == pytest.approx(b.completions[0].logprobs, abs=1e-4), line


def test_pdl_runs_on_an_sm90_gpu_and_changes_no_bit(tmp_path):
    """On an H100/H200 the probe finds programmatic dependent launch able (kernels/pdl.py) and the record says
    it is on; an engine with it (bf16, graphs on, the skinny linears) gives the same tokens and the same
    log-prob bits as one with every kernel launched plainly (pdl='off')."""
    from svrmad_local.kernels import pdl

    _compiled_triton()
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip(f"compute capability {major}.{minor}: PDL needs 9.0 or later")
    assert pdl.why_not(CUDA) is None
    model = make_zoo_model("qwen3").to(CUDA).to(torch.bfloat16)
    kw = dict(kv_cache_memory=64 * 2**20, block_size=4, cache_dir=str(tmp_path), gemv="skinny")
    prompts = [rand_prompt(2 * WINDOW + 5, 2), rand_prompt(7, 3)]
    runs, before = {}, pdl.use(True)  # the engines set it; restored after
    try:
        for mode in ("auto", "off"):
            eng = Engine(model, None, EngineConfig(pdl=mode, **kw))
            assert eng.execution.pdl.value == ("on" if mode == "auto" else "off"), eng.execution.line()
            outs = eng.generate_sync(prompts, GREEDY)
            runs[mode] = [(o.completions[0].token_ids, o.completions[0].logprobs) for o in outs]
            eng.close()
    finally:
        pdl.use(before)
    assert runs["auto"] == runs["off"]
