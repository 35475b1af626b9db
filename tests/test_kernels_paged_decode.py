"""kernels.paged_decode: the torch reference and the Triton split-K kernel (numpy interpreter) against
a float64 dense attention written here, on shuffled non-contiguous block tables, GQA ratios, sliding
windows, GPT-OSS sinks and lengths that are not multiples of the block size.

Tolerance: |out - ref| <= ATOL[dtype]. fp32 runs exact fp32 dots (1e-5). fp16 and bf16 outputs are
rounded to their dtype once; fp16 kernels also round the softmax weights to fp16 before P @ V, as
flash attention does (values are O(1): 1e-2 for bf16's 8-bit mantissa, 5e-3 for fp16).
"""
import importlib
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (see conftest)

import pytest  # noqa: E402
import torch  # noqa: E402

from svrmad_local.kernels import paged_decode, reference_paged_decode  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def dense_f64(q, k_cache, v_cache, block_table, lens, block_size, scale, window=None, sinks=None):
    """Each sequence's context copied out of the cache in order, then plain softmax attention in
    float64: scores of query head h against KV head h // G, the sink as one extra column."""
    b, h, _ = q.shape
    g = h // k_cache.shape[1]
    out = torch.zeros(b, h, v_cache.shape[2], dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        slots = [int(block_table[i, p // block_size]) * block_size + p % block_size for p in range(n)]
        first = 0 if window is None else max(0, n - window)  # keys p > (n - 1) - window
        k, v = k_cache[slots[first:]].double(), v_cache[slots[first:]].double()
        for hd in range(h):
            s = (k[:, hd // g] @ q[i, hd].double()) * scale
            if sinks is not None:
                s = torch.cat([s, sinks[hd:hd + 1].double()])
            if s.numel() == 0:
                continue
            p = torch.softmax(s, 0)[:k.shape[0]]
            out[i, hd] = p @ v[:, hd // g]
    return out


def case(seed, b=4, h=4, hkv=2, d=16, dv=16, block_size=4, lens=(1, 7, 16, 13), num_blocks=24,
         dtype=torch.float32, sinks=False):
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, dv, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    width = max(math.ceil(n / block_size) for n in lens) + 1  # one spare column: never read
    perm = torch.randperm(num_blocks, generator=g)
    assert b * width <= num_blocks
    table = perm[:b * width].reshape(b, width).to(torch.int32)  # shuffled, no two sequences share
    lens = torch.tensor(lens, dtype=torch.int32)
    sk = torch.randn(h, generator=g) * 2 if sinks else None
    return q, k, v, table, lens, sk


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (6, 1)])
def test_gqa_and_dtypes(request, impl, dtype, h, hkv):
    if impl == "triton":
        request.getfixturevalue("interp")
    q, k, v, table, lens, _ = case(1, h=h, hkv=hkv, dtype=dtype)
    out = paged_decode(q, k, v, table, lens, 4, 0.3, kernel_impl=impl)
    assert out.dtype == dtype and out.shape == (4, h, 16)
    ref = dense_f64(q, k, v, table, lens, 4, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("window,sinks", [(None, True), (1, False), (5, True), (16, False), (64, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_windows_sinks_splits(request, impl, window, sinks, splits):
    if impl == "triton":
        request.getfixturevalue("interp")
    elif splits == 3:
        pytest.skip("splits only exist in the triton path")
    lens = (1, 9, 30, 22, 0)  # 0: an empty context (out 0, or 0 whatever the sink)
    q, k, v, table, lens, sk = case(2, b=5, h=4, hkv=2, d=8, dv=24, block_size=3, lens=lens, num_blocks=60,
                                    sinks=sinks)
    out = paged_decode(q, k, v, table, lens, 3, 0.5, window=window, sinks=sk, kernel_impl=impl,
                       num_splits=splits)
    ref = dense_f64(q, k, v, table, lens, 3, 0.5, window=window, sinks=sk)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert (out[4] == 0).all()


def test_bf16_window_sinks_long_context(interp):
    """A context spanning many BLOCK_N tiles and several splits, bf16 as the engine runs on a GPU."""
    q, k, v, table, lens, sk = case(3, b=2, h=8, hkv=2, d=32, dv=32, block_size=16, lens=(200, 77),
                                    num_blocks=30, dtype=torch.bfloat16, sinks=True)
    for window in (None, 40):
        ref = dense_f64(q, k, v, table, lens, 16, 32**-0.5, window=window, sinks=sk)
        for impl in ("torch", "triton"):
            out = paged_decode(q, k, v, table, lens, 16, 32**-0.5, window=window, sinks=sk, kernel_impl=impl,
                               num_splits=4)
            torch.testing.assert_close(out.double(), ref, atol=ATOL[torch.bfloat16], rtol=0)


def test_triton_matches_the_torch_reference(interp):
    q, k, v, table, lens, sk = case(4, lens=(3, 16, 5, 11), sinks=True)
    a = paged_decode(q, k, v, table, lens, 4, 0.25, window=6, sinks=sk, kernel_impl="triton", num_splits=2)
    b = reference_paged_decode(q, k, v, table, lens, 4, 0.25, window=6, sinks=sk)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bad_input_is_one_line():
    q, k, v, table, lens, _ = case(5)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        paged_decode(q[:, :3], k, v, table, lens, 4, 0.3)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode(q, k, v, table, lens[:2], 4, 0.3)
    with pytest.raises(ValueError, match="whole blocks of 5"):
        paged_decode(q, k, v, table, lens, 5, 0.3)
    with pytest.raises(ValueError, match="window"):
        paged_decode(q, k, v, table, lens, 4, 0.3, window=0)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode(q, k, v, table, lens, 4, 0.3, sinks=torch.zeros(3))


def _count_merges(monkeypatch):
    """Counts the merge kernel's launches (its grid lookups) from here on."""
    module = importlib.import_module("svrmad_local.kernels.paged_decode")  # (the package exports the function)
    launches, kernel = [], module._decode_merge_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, "_decode_merge_kernel", Counted())
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_split_without_sinks_stores_the_output_itself(interp, monkeypatch, dtype):
    """One split and no sink: the split kernel stores the output and no merge is launched (a short-context
    decode step's layer, one kernel fewer), with the bits the merge of that one partial gives: a sink of
    -inf makes the merge run over the same math (its term is exp(-inf) = 0)."""
    q, k, v, table, lens, _ = case(6, b=5, lens=(1, 9, 30, 22, 0), num_blocks=60, dtype=dtype)
    launches = _count_merges(monkeypatch)
    one = paged_decode(q, k, v, table, lens, 4, 0.3, kernel_impl="triton", num_splits=1)
    assert launches == []
    merged = paged_decode(q, k, v, table, lens, 4, 0.3, sinks=torch.full((4,), float("-inf")), kernel_impl="triton",
                          num_splits=1)
    assert len(launches) == 1
    assert torch.equal(one, merged)
    torch.testing.assert_close(one.double(), dense_f64(q, k, v, table, lens, 4, 0.3), atol=ATOL[dtype], rtol=0)
    assert (one[4] == 0).all()  # an empty context


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("splits,sinks", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_out_is_written_in_place_whatever_its_strides(request, impl, splits, sinks, dtype):
    """`out=`: the caller's tensor (here rows of a wider one, as the decode rows of a layer's attention
    output are) receives the same bits a new output would, and nothing around it is touched."""
    if impl == "triton":
        request.getfixturevalue("interp")
    q, k, v, table, lens, sk = case(7, lens=(3, 16, 5, 11), dtype=dtype, sinks=sinks)
    new = paged_decode(q, k, v, table, lens, 4, 0.3, sinks=sk, kernel_impl=impl, num_splits=splits)
    wide = torch.full((6, 4, 20), 7.0, dtype=dtype)
    view = wide[1:5, :, 2:18]
    got = paged_decode(q, k, v, table, lens, 4, 0.3, sinks=sk, kernel_impl=impl, num_splits=splits, out=view)
    assert got.data_ptr() == view.data_ptr() and torch.equal(view, new)
    wide[1:5, :, 2:18] = 7.0
    assert (wide == 7.0).all()


def test_a_wrong_out_is_refused_by_name():
    q, k, v, table, lens, _ = case(8)
    for out in (torch.empty(4, 4, 15), torch.empty(4, 4, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="paged_decode: out must be"):
            paged_decode(q, k, v, table, lens, 4, 0.3, out=out)
