"""kernels.prefix_attention: torch references vs naive attention, triton (interpreter) vs torch."""
import math
import os

# Triton only runs kernels on CPU tensors in interpreter mode, which is read when triton is first
# imported: set it before `kernels` imports triton (if nothing imported triton earlier).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.kernels import Level, attend_partial, cascade_attention, merge_states, reference_attention  # noqa: E402


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
    out, lse = attend_partial(q, k, v, bt, kv_len, 0.25, impl="torch")
    ref = reference_attention(q, _run(k, bt, kv_len), _run(v, bt, kv_len), 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    kf = _run(k, bt, kv_len).float().repeat_interleave(hq // hkv, 1)
    ref_lse = torch.logsumexp(torch.einsum("nhd,lhd->nhl", q.float(), kf) * 0.25, -1)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attend_partial_empty_run():
    k, v = _cache()
    out, lse = attend_partial(torch.randn(3, 4, 16), k, v, torch.tensor([1]), 0, 0.25, impl="torch")
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_merge_states_is_exact(request, impl):
    if impl == "triton":
        request.getfixturevalue("interp")
    k, v = _cache()
    q = torch.randn(3, 4, 16)
    bt = torch.tensor([5, 9, 1, 3])
    a = attend_partial(q, k, v, bt[:2], 6, 0.25, impl="torch")  # tokens 0..5
    b = attend_partial(q, k, v, bt[2:], 8, 0.25, impl="torch")  # tokens 8..15 (disjoint)
    out, lse = merge_states(*a, *b, impl=impl)
    kf = torch.cat([_run(k, bt[:2], 6), _run(k, bt[2:], 8)])
    vf = torch.cat([_run(v, bt[:2], 6), _run(v, bt[2:], 8)])
    torch.testing.assert_close(out, reference_attention(q, kf, vf, 0.25), atol=1e-5, rtol=1e-5)
    full = attend_partial(q, k, v, torch.tensor([5, 9]), 8, 0.25, impl="torch")
    _, lse_ab = merge_states(*attend_partial(q, k, v, torch.tensor([5]), 4, 0.25, impl="torch"),
                             *attend_partial(q, k, v, torch.tensor([9]), 4, 0.25, impl="torch"), impl=impl)
    torch.testing.assert_close(lse_ab, full[1], atol=1e-5, rtol=1e-5)
    # -inf on either side is the identity; both sides empty stays empty and NaN-free
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    for x, y in ((a, empty), (empty, a)):
        o, l = merge_states(*x, *y, impl=impl)
        torch.testing.assert_close(o, a[0])
        torch.testing.assert_close(l, a[1])
    o, l = merge_states(*empty, *empty, impl=impl)
    assert (o == 0).all() and torch.isneginf(l).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cascade_torch_three_levels(dtype):
    k, v = _cache(num_blocks=40, hkv=2, dtype=dtype, seed=1)
    q = torch.randn(6, 4, 16).to(dtype)
    levels = _three_levels(6, torch.randperm(40, generator=torch.Generator().manual_seed(3)))
    out = cascade_attention(q, k, v, levels, 0.25, impl="torch")
    assert out.dtype == dtype
    ref = _naive_cascade(q, k, v, levels, 0.25)
    torch.testing.assert_close(out.float(), ref, atol=OUT_ATOL[dtype], rtol=1e-2)
    _, lse = cascade_attention(q, k, v, levels, 0.25, impl="torch", return_lse=True)
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
    out, lse = attend_partial(q, k, v, bt, kv_len, d**-0.5, impl="triton", num_splits=splits)
    ref_out, ref_lse = attend_partial(q, k, v, bt, kv_len, d**-0.5, impl="torch")
    assert out.dtype == torch.float32 and lse.shape == (9, hq)
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=1e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attend_partial_triton_strided_query(interp):
    k, v = _cache(seed=5)
    q = torch.randn(4, 16, 3)[:, :, 1].reshape(4, 1, 16).expand(4, 4, 16)  # odd strides, stride-0 heads
    bt = torch.tensor([3, 0, 8])
    got = attend_partial(q, k, v, bt, 11, 0.3, impl="triton", num_splits=2)
    ref = attend_partial(q, k, v, bt, 11, 0.3, impl="torch")
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("splits", [None, 4])
def test_cascade_triton_three_levels(interp, dtype, splits):
    k, v = _cache(num_blocks=40, hkv=2, dtype=dtype, seed=6)
    q = torch.randn(7, 4, 16).to(dtype)
    levels = _three_levels(7, torch.randperm(40, generator=torch.Generator().manual_seed(7)))
    levels.append(Level(torch.tensor([], dtype=torch.long), torch.tensor([0]), 3))  # nobody listed
    got, lse = cascade_attention(q, k, v, levels, 0.25, impl="triton", num_splits=splits, return_lse=True)
    ref, ref_lse = cascade_attention(q, k, v, levels, 0.25, impl="torch", return_lse=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=OUT_ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, _naive_cascade(q, k, v, levels, 0.25), atol=1e-5, rtol=1e-5)


def test_cascade_query_with_no_level(interp):
    k, v = _cache()
    q = torch.randn(3, 4, 16)
    levels = [Level(torch.tensor([0, 2]), torch.tensor([4, 1]), 5)]
    for impl in ("torch", "triton"):
        out = cascade_attention(q, k, v, levels, 0.25, impl=impl)
        assert (out[1] == 0).all() and not torch.isnan(out).any()
