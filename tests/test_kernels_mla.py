"""kernels.mla_decode: the torch reference and the Triton kernel (interpreter mode on the CPU) against a
float64 computation of absorbed MLA decode attention, on random block tables (shuffled, shared and
padded blocks), contexts from 1 token to several splits, and head counts that do not fill a tile."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.kernels import HAS_TRITON
from svrmad_local.kernels.mla_decode import mla_decode, plan, reference_mla_decode


def _case(lens, heads, c_dim, r_dim, bs, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens) + 1  # one padding column past the longest context
    num_blocks = len(lens) * width + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[: len(lens) * width].view(len(lens), width).clone()
    table[1:, 0] = table[0, 0]  # rows share their first block (a forked prefix)
    c = torch.randn(num_blocks * bs, 1, c_dim, generator=g).to(dtype)
    kr = torch.randn(num_blocks * bs, 1, r_dim, generator=g).to(dtype)
    q_lat = torch.randn(len(lens), heads, c_dim, generator=g).to(dtype)
    q_rot = torch.randn(len(lens), heads, r_dim, generator=g).to(dtype)
    return q_lat, q_rot, c, kr, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _f64(q_lat, q_rot, c, kr, table, lens, bs, scale):
    out = []
    for i, n in enumerate(lens.tolist()):
        slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs for p in range(n)])
        cc, kk = c[slots, 0].double(), kr[slots, 0].double()
        s = (q_lat[i].double() @ cc.T + q_rot[i].double() @ kk.T) * scale
        out.append(torch.softmax(s, -1) @ cc)
    return torch.stack(out)


CASES = [([1, 5, 17], 4, 16, 8, 4), ([33, 2], 20, 24, 8, 8), ([1100, 40, 2300], 3, 16, 8, 16)]


@pytest.mark.parametrize("lens,heads,c_dim,r_dim,bs", CASES)
def test_reference_matches_float64(lens, heads, c_dim, r_dim, bs):
    args = _case(lens, heads, c_dim, r_dim, bs, seed=len(lens))
    got = reference_mla_decode(*args, bs, 0.3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _f64(*args, bs, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("lens,heads,c_dim,r_dim,bs", CASES)
def test_triton_matches_float64(lens, heads, c_dim, r_dim, bs):
    args = _case(lens, heads, c_dim, r_dim, bs, seed=len(lens))
    got = mla_decode(*args, bs, 0.3, kernel_impl="triton")
    torch.testing.assert_close(got.double(), _f64(*args, bs, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_bf16_cache_close_to_float64():
    args = _case([7, 40], 4, 16, 8, 4, seed=5, dtype=torch.bfloat16)
    got = mla_decode(*args, 4, 0.3, kernel_impl="triton")
    torch.testing.assert_close(got.double(), _f64(*args, 4, 0.3), atol=2e-2, rtol=2e-2)


def test_the_plan_depends_on_shapes_only_and_covers_the_table():
    for width in (1, 16, 1024, 1025, 5000, 70000):
        for rows, heads in ((1, 128), (32, 128), (1, 16), (8, 16)):
            block_h, n, chunk = plan(rows, heads, width, 512, 64, 2, 32)
            assert n * chunk >= width and (n - 1) * chunk < width and chunk % 32 == 0
            assert block_h == min(64, heads)


def test_the_plan_reads_deepseeks_latent_once_a_head_tile_and_fills_the_gpu_at_16k():
    """DeepSeek-V3.1 at batch 1 and 16k tokens: 128 heads in two tiles of 64 (the latent read twice a split,
    not 8 times as with 16 heads a program), split until about two programs an SM or until a split's fp32
    partials would pass half its latent bytes; a tensor-parallel rank's 16 heads: one tile."""
    block_h, n, chunk = plan(1, 128, 16_384, 512, 64, 2, 32, sms=132)
    partial, latent = 2 * 128 * 512 * 4, chunk * 576 * 2
    assert block_h == 64 and partial <= latent / 2 and n == -(-16_384 // chunk) == 18
    block_h, n, chunk = plan(1, 16, 16_384, 512, 64, 2, 32, sms=132)
    assert block_h == 16 and n * 1 >= 100  # one head tile: many splits fill the GPU
    assert plan(32, 128, 16_384, 512, 64, 2, 32, sms=132)[1] == 5  # 64 tiles: five splits make 2 an SM


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("heads, block_h", [(128, 64), (16, 16), (16, 64)])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_triton_at_deepseeks_shape_with_the_gpu_tiles(heads, block_h, splits):
    """DeepSeek's latent (512) and RoPE key (64) at 128 heads and a TP-8 rank's 16, with the GPU's heads a
    program (64: two tiles at 128 heads; one tile past the heads at 16) and any split count."""
    args = _case([37, 300, 5], heads, 512, 64, 16, seed=heads + splits)
    got = mla_decode(*args, 16, 0.07, kernel_impl="triton", block_h=block_h, splits=splits)
    torch.testing.assert_close(got.double(), _f64(*args, 16, 0.07), atol=1e-5, rtol=1e-5)


def test_shapes_are_checked():
    q_lat, q_rot, c, kr, table, lens = _case([3], 2, 16, 8, 4, seed=0)
    with pytest.raises(ValueError, match="disagree"):
        mla_decode(q_lat, q_rot[..., :4], c, kr, table, lens, 4, 1.0, kernel_impl="torch")
    with pytest.raises(ValueError, match="block_table"):
        mla_decode(q_lat, q_rot, c, kr, table, lens[:0], 4, 1.0, kernel_impl="torch")


@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if HAS_TRITON else []))
def test_slots_no_token_wrote_never_reach_the_output(impl):
    """The cache is allocated empty: rows past a context's length may hold NaN. A zero softmax weight
    times NaN is NaN, so they must be kept out, not only masked in the scores."""
    q_lat, q_rot, c, kr, table, lens = _case([3, 9], 4, 16, 8, 4, seed=5)
    want = _f64(q_lat, q_rot, c, kr, table, lens, 4, 0.3)
    written = torch.zeros(c.shape[0], dtype=torch.bool)
    for i, n in enumerate(lens.tolist()):
        for p in range(n):
            written[int(table[i, p // 4]) * 4 + p % 4] = True
    c[~written], kr[~written] = float("nan"), float("nan")
    got = mla_decode(q_lat, q_rot, c, kr, table, lens, 4, 0.3, kernel_impl=impl)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
