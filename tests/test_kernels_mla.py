"""kernels.mla_decode: the torch reference and the Triton kernel (interpreter mode on the CPU) against a
float64 computation of absorbed MLA decode attention, on random block tables (shuffled, shared and
padded blocks), contexts from 1 token to several splits, and head counts that do not fill a tile."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.kernels import HAS_TRITON
from svrmad_local.kernels.mla_decode import _splits, mla_decode, reference_mla_decode


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


def test_splits_depend_on_the_table_width_only_and_cover_it():
    for width in (1, 16, 1024, 1025, 5000, 70000):
        n, chunk = _splits(width, 16)
        assert n * chunk >= width and (n - 1) * chunk < width and chunk % 16 == 0 and n <= 16


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
