"""The panel linear kernel (kernels/cpu_linear.py): x @ W.T + b within fp32 rounding of float64, and
its arithmetic independent of the batch: a row's output is bitwise the same alone or among others."""

from __future__ import annotations

import pytest
import torch

from svrmad_local.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason=f"no kernel: {cpu_linear.unavailable_reason()}")


@pytest.mark.parametrize("n,k", [(64, 64), (100, 37), (960, 576), (70, 2100), (17, 1024), (3, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_float64(n, k, bias):
    torch.manual_seed(n * 7 + k)
    w, x = torch.randn(n, k) / k**0.5, torch.randn(2, 5, k)
    b = torch.randn(n) if bias else None
    got = cpu_linear.linear(x, cpu_linear.pack(w), n, b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.shape == (2, 5, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * (k / 64) ** 0.5)


@pytest.mark.parametrize("k", [576, 2100])  # one K-block; three (KBLOCK = 1024), the last partial
def test_a_rows_output_does_not_depend_on_the_batch(k):
    torch.manual_seed(k)
    n = 200  # 13 panels, the last 8 columns wide
    w, b, x = torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(203, k)
    panels = cpu_linear.pack(w)
    full = cpu_linear.linear(x, panels, n, b)  # three passes of 96 rows, the last 11
    for lo, hi in [(0, 1), (5, 6), (7, 13), (95, 98), (0, 96), (100, 203), (202, 203)]:
        assert torch.equal(cpu_linear.linear(x[lo:hi], panels, n, b), full[lo:hi]), (lo, hi)
    assert torch.equal(cpu_linear.linear(x[3:4].expand(7, k).contiguous(), panels, n, b), full[3:4].expand(7, n))


@pytest.mark.parametrize("n", [5, 16, 33, 64, 100, 144, 200])  # 1-13 panels: 4, 2 and 1 at a time, a partial last
@pytest.mark.parametrize("k", [576, 2100])
def test_one_row_runs_its_own_path_to_the_same_bits(n, k):
    """M = 1 (batch-1 decode) takes several panels at once (csrc/cpu_linear.cpp, row_panels): each
    output must still be bitwise what the many-row tiles compute, with and without a bias, and with
    panels past n (a matrix packed wider than the columns asked for)."""
    torch.manual_seed(n + k)
    w, b, x = torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(7, k)
    panels = cpu_linear.pack(w)
    for bias in (None, b):
        many = cpu_linear.linear(x, panels, n, bias)
        for r in range(7):
            for width in (4, 2, 1):  # panels at once: the speed moves, never the bits
                one = cpu_linear.linear(x[r : r + 1], panels, n, bias, row_width=width)
                assert torch.equal(one, many[r : r + 1]), (r, width, bias is None)
    fewer = n - 16 if n > 16 else n - 3  # a panel (or part of one) past the columns asked for
    assert torch.equal(cpu_linear.linear(x[:1], panels, fewer), cpu_linear.linear(x[:2], panels, fewer)[:1])


def test_pack_unpack_and_row_lookups_are_exact_copies():
    w = torch.randn(37, 11)
    panels = cpu_linear.pack(w)
    assert panels.shape == (3, 11, 16) and panels[2, :, 5:].abs().sum() == 0  # zero columns past N
    assert torch.equal(cpu_linear.unpack(panels, 37), w)
    ids = torch.tensor([[0, 36, 16, 16], [15, 17, 1, 2]])
    assert torch.equal(cpu_linear.rows_of(panels, ids), w[ids])


def test_bad_inputs_are_refused_in_one_line():
    panels = cpu_linear.pack(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and panels \[P, K, 16\]"):
        cpu_linear.linear(torch.randn(2, 15), panels, 8)
    with pytest.raises(RuntimeError, match="fp32 only"):
        cpu_linear.linear(torch.randn(2, 16, dtype=torch.float64), panels, 8)
