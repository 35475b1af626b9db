"""kernels.prefix_attention: torch references vs naive attention, triton (interpreter) vs torch;
sliding windows and attention sinks against the naive oracle and transformers' GPT-OSS attention."""
import math
import os

# Triton only runs kernels on CPU tensors in interpreter mode, which is read when triton is first
# imported: set it before `kernels` imports triton (if nothing imported triton earlier).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.kernels import (Level, apply_sinks, attend_partial, cascade_attention, merge_states,  # noqa: E402
                                  reference_attention)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# fp16 kernels round the softmax weights to fp16 before the P @ V product (as flash attention does)
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-5}
# cascade_attention returns q's dtype: one more rounding of the output
OUT_ATOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _cache(num_blocks=24, block_size=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    return k, v


def _run(cache, block_table, kv_len):
    """The plain [kv_len, Hkv, D] tokens of a paged run (what a non-sharing engine would copy)."""
    return cache[block_table].reshape(-1, *cache.shape[2:])[:kv_len]


def _naive_cascade(q, k, v, levels, scale):
    """Every query attends to the concatenation of the runs of the levels listing it."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        mine = [lv for lv in levels if (lv.query_idx == i).any() and lv.kv_len]
        if mine:
            kf = torch.cat([_run(k, lv.block_table, lv.kv_len) for lv in mine])
            vf = torch.cat([_run(v, lv.block_table, lv.kv_len) for lv in mine])
            out[i] = reference_attention(q[i], kf, vf, scale)
    return out


def _three_levels(nq, perm):
    """question (all queries, 1 token) -> history of a subgroup -> own suffix per query
    (query 1's suffix empty, query 0's a single token), block tables scattered through the cache."""
    levels = [Level(torch.arange(nq), perm[0:1], 1),
              Level(torch.tensor([0, 2, 3]), perm[1:5], 14),  # 14 = 3.5 blocks of 4
              Level(torch.tensor([1, 4]), perm[5:8], 9)]
    lens = [1, 0, 6, 3, 7] + [5] * (nq - 5)
    start = 8
    for i in range(nq):
        nb = max(1, math.ceil(lens[i] / 4))
        levels.append(Level(torch.tensor([i]), perm[start:start + nb], lens[i]))
        start += nb
    return levels


# ---------------------------------------------------------------------------------------------
# torch references vs naive attention
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("kv_len", [1, 4, 13])
def test_attend_partial_torch(dtype, hq, hkv, kv_len):
    k, v = _cache(hkv=hkv, dtype=dtype)
    q = torch.randn(5, hq, 16).to(dtype)
    bt = torch.tensor([7, 2, 19, 11])  # non-contiguous, unordered
    out, lse = attend_partial(q, k, v, bt, kv_len, 0.25, kernel_impl="torch")
    ref = reference_attention(q, _run(k, bt, kv_len), _run(v, bt, kv_len), 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    kf = _run(k, bt, kv_len).float().repeat_interleave(hq // hkv, 1)
    ref_lse = torch.logsumexp(torch.einsum("nhd,lhd->nhl", q.float(), kf) * 0.25, -1)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attend_partial_empty_run():
    k, v = _cache()
    out, lse = attend_partial(torch.randn(3, 4, 16), k, v, torch.tensor([1]), 0, 0.25, kernel_impl="torch")
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
def test_merge_states_is_exact(request, kernel_impl):
    if kernel_impl == "triton":
        request.getfixturevalue("interp")
    k, v = _cache()
    q = torch.randn(3, 4, 16)
    bt = torch.tensor([5, 9, 1, 3])
    a = attend_partial(q, k, v, bt[:2], 6, 0.25, kernel_impl="torch")  # tokens 0..5
    b = attend_partial(q, k, v, bt[2:], 8, 0.25, kernel_impl="torch")  # tokens 8..15 (disjoint)
    out, lse = merge_states(*a, *b, kernel_impl=kernel_impl)
    kf = torch.cat([_run(k, bt[:2], 6), _run(k, bt[2:], 8)])
    vf = torch.cat([_run(v, bt[:2], 6), _run(v, bt[2:], 8)])
    torch.testing.assert_close(out, reference_attention(q, kf, vf, 0.25), atol=1e-5, rtol=1e-5)
    full = attend_partial(q, k, v, torch.tensor([5, 9]), 8, 0.25, kernel_impl="torch")
    _, lse_ab = merge_states(*attend_partial(q, k, v, torch.tensor([5]), 4, 0.25, kernel_impl="torch"),
                             *attend_partial(q, k, v, torch.tensor([9]), 4, 0.25, kernel_impl="torch"), kernel_impl=kernel_impl)
    torch.testing.assert_close(lse_ab, full[1], atol=1e-5, rtol=1e-5)
    # -inf on either side is the identity; both sides empty stays empty and NaN-free
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    for x, y in ((a, empty), (empty, a)):
        o, l = merge_states(*x, *y, kernel_impl=kernel_impl)
        torch.testing.assert_close(o, a[0])
        torch.testing.assert_close(l, a[1])
    o, l = merge_states(*empty, *empty, kernel_impl=kernel_impl)
    assert (o == 0).all() and torch.isneginf(l).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cascade_torch_three_levels(dtype):
    k, v = _cache(num_blocks=40, hkv=2, dtype=dtype, seed=1)
    q = torch.randn(6, 4, 16).to(dtype)
    levels = _three_levels(6, torch.randperm(40, generator=torch.Generator().manual_seed(3)))
    out = cascade_attention(q, k, v, levels, 0.25, kernel_impl="torch")
    assert out.dtype == dtype
    ref = _naive_cascade(q, k, v, levels, 0.25)
    torch.testing.assert_close(out.float(), ref, atol=OUT_ATOL[dtype], rtol=1e-2)
    _, lse = cascade_attention(q, k, v, levels, 0.25, kernel_impl="torch", return_lse=True)
    assert torch.isfinite(lse).all()


# ---------------------------------------------------------------------------------------------
# triton kernels (interpreter) vs torch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 3, 24), (8, 1, 16)])
@pytest.mark.parametrize("kv_len,splits", [(0, None), (1, None), (13, None), (50, 3)])
def test_attend_partial_triton(interp, dtype, hq, hkv, d, kv_len, splits):
    k, v = _cache(hkv=hkv, d=d, dtype=dtype, seed=2)
    q = torch.randn(9, hq, d).to(dtype)  # 9 * G rows: ragged row blocks
    bt = torch.randperm(24, generator=torch.Generator().manual_seed(4))[:13]
    out, lse = attend_partial(q, k, v, bt, kv_len, d**-0.5, kernel_impl="triton", num_splits=splits)
    ref_out, ref_lse = attend_partial(q, k, v, bt, kv_len, d**-0.5, kernel_impl="torch")
    assert out.dtype == torch.float32 and lse.shape == (9, hq)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=1e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attend_partial_triton_strided_query(interp):
    k, v = _cache(seed=5)
    q = torch.randn(4, 16, 3)[:, :, 1].reshape(4, 1, 16).expand(4, 4, 16)  # odd strides, stride-0 heads
    bt = torch.tensor([3, 0, 8])
    got = attend_partial(q, k, v, bt, 11, 0.3, kernel_impl="triton", num_splits=2)
    ref = attend_partial(q, k, v, bt, 11, 0.3, kernel_impl="torch")
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("splits", [None, 4])
def test_cascade_triton_three_levels(interp, dtype, splits):
    k, v = _cache(num_blocks=40, hkv=2, dtype=dtype, seed=6)
    q = torch.randn(7, 4, 16).to(dtype)
    levels = _three_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(7)))
    levels.append(Level(torch.tensor([], dtype=torch.long), torch.tensor([0]), 3))  # nobody listed
    got, lse = cascade_attention(q, k, v, levels, 0.25, kernel_impl="triton", num_splits=splits, return_lse=True)
    ref, ref_lse = cascade_attention(q, k, v, levels, 0.25, kernel_impl="torch", return_lse=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=OUT_ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, _naive_cascade(q, k, v, levels, 0.25), atol=1e-5, rtol=1e-5)


def test_a_cascade_plan_serves_every_layer_of_a_step(interp):
    """One plan (built once, as the engine does per step and window) gives each layer's q/k/v the same
    result as a plan built inside the call; a plan for other shapes is refused."""
    from svrmad_local.kernels import cascade_plan

    levels, q_pos = _window_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(27)))
    q0 = torch.randn(7, 4, 16)
    plan = cascade_plan(q0, _cache(num_blocks=40, hkv=2)[0], levels, q_pos=q_pos, window=9)
    for layer in range(3):
        k, v = _cache(num_blocks=40, hkv=2, seed=30 + layer)
        q = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(40 + layer))
        kw = dict(q_pos=q_pos, window=9, kernel_impl="triton")
        torch.testing.assert_close(cascade_attention(q, k, v, levels, 0.25, plan=plan, **kw),
                                   cascade_attention(q, k, v, levels, 0.25, **kw), atol=0, rtol=0)
        torch.testing.assert_close(cascade_attention(q, k, v, levels, 0.25, plan=plan, **kw),
                                   cascade_attention(q, k, v, levels, 0.25, q_pos=q_pos, window=9, kernel_impl="torch"),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="plan was built for"):
        cascade_attention(torch.randn(7, 2, 16), k[:, :, :1], v[:, :, :1], levels, 0.25, plan=plan, q_pos=q_pos,
                          window=9, kernel_impl="triton")


def test_cascade_query_with_no_level(interp):
    k, v = _cache()
    q = torch.randn(3, 4, 16)
    levels = [Level(torch.tensor([0, 2]), torch.tensor([4, 1]), 5)]
    for kernel_impl in ("torch", "triton"):
        out = cascade_attention(q, k, v, levels, 0.25, kernel_impl=kernel_impl)
        assert (out[1] == 0).all() and not torch.isnan(out).any()


# ---------------------------------------------------------------------------------------------
# sliding windows and attention sinks
# ---------------------------------------------------------------------------------------------

NEG_INF = float("-inf")
WINDOWS = [1, 3, 9, 20, 1000]  # own token only, inside the suffix, cuts the history, cuts the prefix, > context


def _naive_windowed(q, k, v, levels, scale, window=None, q_pos=None, sinks=None):
    """Per query: concatenate the runs of its levels with their absolute key positions and hand them
    to reference_attention; the lse straight from the masked scores (and the sink). Returns fp32
    (out [Nq, Hq, D], lse [Nq, Hq])."""
    nq, hq, d = q.shape
    out = torch.zeros(nq, hq, d)
    lse = torch.full((nq, hq), NEG_INF)
    for i in range(nq):
        mine = [lv for lv in levels if (lv.query_idx == i).any() and lv.kv_len]
        if mine:
            kf = torch.cat([_run(k, lv.block_table, lv.kv_len) for lv in mine])
            vf = torch.cat([_run(v, lv.block_table, lv.kv_len) for lv in mine])
            kp = torch.cat([lv.kv_start + torch.arange(lv.kv_len) for lv in mine])
            qp = None if q_pos is None else q_pos[i]
            out[i] = reference_attention(q[i], kf, vf, scale, window=window, q_pos=qp, k_pos=kp, sinks=sinks)
            scores = torch.einsum("hd,lhd->hl", q[i].float(), kf.float().repeat_interleave(hq // k.shape[2], 1)) * scale
            if window is not None:
                scores[:, kp <= q_pos[i] - window] = NEG_INF
            lse[i] = torch.logsumexp(scores, -1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.float())
    return out, lse


def _window_levels(nq, perm, block_size=4):
    """Decode geometry with absolute positions: a 36-token prefix (all queries) -> a 16-token
    history at 36.. (queries 0, 2, 3) -> each query's own suffix (lengths 1, 0, 6, 3, 7, 5...)
    starting where its previous level ends; the last query (``nq - 1``, "blind") is listed only by
    the prefix and sits at position 500, so a window below 465 hides every key from it.
    Returns (levels, q_pos)."""
    levels = [Level(torch.arange(nq), perm[0:9], 36, 0), Level(torch.tensor([0, 2, 3]), perm[9:13], 16, 36)]
    lens = [1, 0, 6, 3, 7] + [5] * (nq - 6)
    q_pos, blk = [], 13
    for i, n in enumerate(lens):
        start = 52 if i in (0, 2, 3) else 36
        nb = max(1, math.ceil(n / block_size))
        levels.append(Level(torch.tensor([i]), perm[blk:blk + nb], n, start))
        blk += nb
        q_pos.append(start + n - 1)  # the suffix ends with the query's own token
    return levels, torch.tensor(q_pos + [500])


def _sinks(hq, seed=11):
    return torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2


def test_reference_matches_transformers_gpt_oss_eager():
    """Our semantics are transformers': GPT-OSS eager attention (softmax over [scores, sink], sink
    dropped) under a hand-built causal + sliding-window mask (masking_utils.sliding_window_overlay:
    kv_idx > q_idx - window), read at a few rows, equals the cascade over paged levels with
    q_pos / window / sinks, and the naive reference."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    L, hq, hkv, d, window, bs = 23, 4, 2, 16, 6, 4
    g = torch.Generator().manual_seed(21)
    qs, ks, vs = (torch.randn(L, h, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = torch.nn.Parameter(sinks), hq // hkv
    module.eval()
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    mask = torch.zeros(L, L).masked_fill(~((j <= i) & (j > i - window)), NEG_INF)
    ref, _ = gpt_oss.eager_attention_forward(module, qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                             vs.transpose(0, 1)[None], mask[None, None], scaling=d**-0.5)
    ref = ref[0]  # [L, Hq, D]
    # the sequence in a paged cache (blocks scattered); queries at rows 7, 8, 15, 22
    perm = torch.randperm(8, generator=g)
    k_cache, v_cache = torch.zeros(8, bs, hkv, d), torch.zeros(8, bs, hkv, d)
    k_cache[perm[:6]] = ks.new_zeros(24, hkv, d).index_copy(0, torch.arange(L), ks).reshape(6, bs, hkv, d)
    v_cache[perm[:6]] = vs.new_zeros(24, hkv, d).index_copy(0, torch.arange(L), vs).reshape(6, bs, hkv, d)
    rows = torch.tensor([7, 8, 15, 22])
    levels = [Level(torch.arange(4), perm[:2], 8, 0)]  # blocks [0, 2): shared by all four
    levels += [Level(torch.tensor([n]), perm[2:6], int(r) + 1 - 8, 8) for n, r in enumerate(rows)]
    levels[1] = Level(torch.tensor([0]), perm[2:6], 0, 8)  # row 7 sees only the shared level
    with torch.no_grad():
        got = cascade_attention(qs[rows], k_cache, v_cache, levels, d**-0.5, q_pos=rows, window=window,
                                sinks=sinks, kernel_impl="torch")
        naive = reference_attention(qs[rows], ks, vs, d**-0.5, window=window, q_pos=rows, sinks=sinks)
    causal = [reference_attention(qs[r], ks[:r + 1], vs[:r + 1], d**-0.5, window=window, q_pos=r, sinks=sinks)
              for r in rows]
    torch.testing.assert_close(got, ref[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(causal), ref[rows], atol=1e-5, rtol=1e-5)
    # no causal mask in reference_attention: keys after a query count, so it differs from `ref` ...
    assert (naive - ref[rows]).abs().max() > 1e-2
    # ... except for the last row, which has no later key
    torch.testing.assert_close(naive[-1], ref[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_cascade_window_torch(dtype, window, hq, hkv):
    k, v = _cache(num_blocks=40, hkv=hkv, dtype=dtype, seed=12)
    q = torch.randn(7, hq, 16, generator=torch.Generator().manual_seed(13)).to(dtype)
    levels, q_pos = _window_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(14)))
    out, lse = cascade_attention(q, k, v, levels, 0.25, q_pos=q_pos, window=window, kernel_impl="torch", return_lse=True)
    ref, ref_lse = _naive_windowed(q, k, v, levels, 0.25, window, q_pos)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=OUT_ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    if window < 465:  # the blind query sees nothing
        assert (out[-1] == 0).all() and torch.isneginf(lse[-1]).all()
    if window == 1:  # exactly one key, the query's own position (query 1's: the prefix's last token)
        assert torch.isfinite(lse[:6]).all()
        own = torch.stack([_run(v, levels[2 + i].block_table, levels[2 + i].kv_len)[-1] for i in (0, 2, 3, 4, 5)])
        own1 = _run(v, levels[0].block_table, 36)[-1:]
        torch.testing.assert_close(out[[0, 2, 3, 4, 5, 1]].float(),
                                   torch.cat([own, own1]).float().repeat_interleave(hq // hkv, 1),
                                   atol=OUT_ATOL[dtype], rtol=1e-2)


@pytest.mark.parametrize("dtype,splits", [(torch.float32, None), (torch.float32, 3), (torch.float16, 3),
                                          (torch.bfloat16, 3)], ids=["fp32", "fp32-split3", "fp16-split3", "bf16-split3"])
@pytest.mark.parametrize("window", WINDOWS)
def test_cascade_window_triton(interp, dtype, window, splits):
    k, v = _cache(num_blocks=40, hkv=2, dtype=dtype, seed=15)
    q = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(16)).to(dtype)
    levels, q_pos = _window_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(17)))
    kw = dict(q_pos=q_pos, window=window, return_lse=True)
    got, lse = cascade_attention(q, k, v, levels, 0.25, kernel_impl="triton", num_splits=splits, **kw)
    ref, ref_lse = cascade_attention(q, k, v, levels, 0.25, kernel_impl="torch", **kw)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), ref.float(), atol=OUT_ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, _naive_windowed(q, k, v, levels, 0.25, window, q_pos)[0],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
@pytest.mark.parametrize("window,splits", [(1, None), (5, None), (20, 2), (40, 3), (10**9, 2)])
def test_attend_partial_window_per_row(request, kernel_impl, window, splits):
    """Queries at different positions share one run (kv_start 8): row bounds differ inside a tile;
    q_pos 9 sees keys after itself (no causal mask; the last split must run to the run's end);
    q_pos 400 is outside every window but the huge one; splits > 1 leave some chunks masked."""
    if kernel_impl == "triton":
        request.getfixturevalue("interp")
    k, v = _cache(num_blocks=24, hkv=2, seed=18)
    q = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(19))
    bt = torch.randperm(24, generator=torch.Generator().manual_seed(20))[:13]
    q_pos = torch.tensor([57, 9, 44, 400, 58])
    out, lse = attend_partial(q, k, v, bt, 50, 0.25, kv_start=8, q_pos=q_pos, window=window, kernel_impl=kernel_impl,
                              num_splits=splits)
    ref, ref_lse = _naive_windowed(q, k, v, [Level(torch.arange(5), bt, 50, 8)], 0.25, window, q_pos)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    if window < 343:
        assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()


def test_window_larger_than_context_equals_no_window():
    k, v = _cache(num_blocks=40, seed=22)
    q = torch.randn(7, 4, 16)
    levels, q_pos = _window_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(23)))
    plain = cascade_attention(q, k, v, levels, 0.25, kernel_impl="torch", return_lse=True)
    wide = cascade_attention(q, k, v, levels, 0.25, q_pos=q_pos, window=501, kernel_impl="torch", return_lse=True)
    torch.testing.assert_close(wide, plain, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_apply_sinks(dtype):
    """Against the softmax over [scores, sink] with the sink dropped (reference_attention): random,
    dominating (+30) and vanishing (-inf = no sink) sinks; a row that saw no key stays 0."""
    k, v = _cache(hkv=2, dtype=dtype, seed=24)
    q = torch.randn(3, 4, 16).to(dtype)
    bt = torch.tensor([3, 8, 1])
    kf, vf = _run(k, bt, 10), _run(v, bt, 10)
    out, lse = attend_partial(q, k, v, bt, 10, 0.25, kernel_impl="torch")
    for sinks in (_sinks(4), torch.tensor([30.0, -1.0, 0.0, 30.0]), torch.full((4,), NEG_INF)):
        o, l = apply_sinks(out.to(dtype), lse, sinks)
        assert o.dtype == dtype and l.dtype == torch.float32
        ref = reference_attention(q, kf, vf, 0.25, sinks=sinks)
        torch.testing.assert_close(o.float(), ref, atol=OUT_ATOL[dtype], rtol=1e-2)
        torch.testing.assert_close(l, torch.logaddexp(lse, sinks), atol=0, rtol=0)
    assert apply_sinks(out, lse, torch.tensor([30.0, 0, 0, 30]))[0][:, [0, 3]].abs().max() < 1e-6  # dominated
    torch.testing.assert_close(apply_sinks(out, lse, torch.full((4,), NEG_INF)), (out, lse), atol=0, rtol=0)
    empty_o, empty_l = apply_sinks(torch.zeros(2, 4, 16), torch.full((2, 4), NEG_INF), _sinks(4))
    assert (empty_o == 0).all() and torch.equal(empty_l, _sinks(4).expand(2, 4))
    both = apply_sinks(torch.zeros(1, 4, 16), torch.full((1, 4), NEG_INF), torch.full((4,), NEG_INF))
    assert (both[0] == 0).all() and torch.isneginf(both[1]).all()


@pytest.mark.parametrize("kernel_impl", ["torch", "triton"])
@pytest.mark.parametrize("window", [None, 3, 20])
@pytest.mark.parametrize("sink_kind", ["random", "dominant", "none"])
def test_cascade_sinks_with_window(request, kernel_impl, window, sink_kind):
    if kernel_impl == "triton":
        request.getfixturevalue("interp")
    k, v = _cache(num_blocks=40, hkv=2, seed=25)
    q = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(26))
    levels, q_pos = _window_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(27)))
    sinks = {"random": _sinks(4), "dominant": torch.full((4,), 40.0), "none": torch.full((4,), NEG_INF)}[sink_kind]
    kw = dict(q_pos=q_pos, window=window) if window else {}
    out, lse = cascade_attention(q, k, v, levels, 0.25, sinks=sinks, kernel_impl=kernel_impl, num_splits=2, return_lse=True, **kw)
    ref, ref_lse = _naive_windowed(q, k, v, levels, 0.25, window, q_pos if window else None, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    if sink_kind == "none":
        plain = cascade_attention(q, k, v, levels, 0.25, kernel_impl=kernel_impl, num_splits=2, return_lse=True, **kw)
        torch.testing.assert_close((out, lse), plain, atol=0, rtol=0)
    if window == 3:  # the blind query: out 0, lse = the sink alone
        assert (out[-1] == 0).all() and torch.equal(lse[-1], sinks)


def test_window_and_sink_errors():
    k, v = _cache()
    q = torch.randn(3, 4, 16)
    lv = [Level(torch.arange(3), torch.tensor([1, 2]), 6, 0)]
    bad = [(dict(window=4), "needs q_pos"), (dict(window=0, q_pos=torch.zeros(3, dtype=torch.long)), "positive"),
           (dict(window=2.5, q_pos=torch.zeros(3, dtype=torch.long)), "positive"),
           (dict(window=4, q_pos=torch.zeros(2, dtype=torch.long)), "q_pos must be"),
           (dict(window=4, q_pos=torch.zeros(3)), "q_pos must be"), (dict(sinks=torch.zeros(3)), "sinks")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            cascade_attention(q, k, v, lv, 0.25, kernel_impl="torch", **kw)
    with pytest.raises(ValueError, match="kv_start"):
        cascade_attention(q, k, v, [lv[0]._replace(kv_start=-4)], 0.25, kernel_impl="torch")
    with pytest.raises(ValueError, match="apply_sinks"):
        apply_sinks(torch.zeros(3, 4, 16), torch.zeros(3, 4), torch.zeros(2))
