"""The panel linear kernel (kernels/cpu_linear.py): x @ W.T + b within fp32 (bf16) rounding of float64,
and its arithmetic independent of the batch: a row's output is bitwise the same alone or among others.
bf16: every instruction level the CPU has (AVX2, avx512_bf16, AMX) is run here, capped with
set_isa_level, and the AVX2 path must give avx512_bf16's bits."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

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
    with pytest.raises(RuntimeError, match="panel_rows: id 48 outside the panels' 48 rows"):
        cpu_linear.rows_of(panels, torch.tensor([3, 48]))


def test_bad_inputs_are_refused_in_one_line():
    panels = cpu_linear.pack(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and panels \[P, K, 16\]"):
        cpu_linear.linear(torch.randn(2, 15), panels, 8)
    with pytest.raises(RuntimeError, match="fp32 panels take fp32 inputs"):
        cpu_linear.linear(torch.randn(2, 16, dtype=torch.float64), panels, 8)
    with pytest.raises(RuntimeError, match="bf16 panels take bf16 inputs"):
        cpu_linear.linear(torch.randn(2, 16), cpu_linear.pack(torch.randn(8, 16).bfloat16()), 8)
    with pytest.raises(RuntimeError, match="fp32 or bf16 panels only"):
        cpu_linear.linear(torch.randn(2, 16).half(), panels.half(), 8)


# ---- bf16 ----------------------------------------------------------------------------------------------

LEVELS = {"avx2": 0, "avx512": 1, "avx512_bf16": 2, "amx": 3}


@contextmanager
def isa(name: str):
    """The kernel capped at instruction level `name` (skipped where this CPU has less)."""
    mod = cpu_linear._KERNEL.module()
    full = mod.set_isa_level(99)
    if LEVELS[name] > mod.isa_level():
        mod.set_isa_level(full)
        pytest.skip(f"this CPU has no {name}")
    mod.set_isa_level(LEVELS[name])
    try:
        yield
    finally:
        mod.set_isa_level(full)


@pytest.mark.parametrize("n,k", [(200, 576), (70, 2100), (100, 37)])
def test_fp32_16_lane_tiles_give_the_8_lane_bits(n, k):
    """On AVX-512 a tile of rows runs 16-lane vectors (lane j: column j's FMA chain, as before): the bits of
    the AVX2 tiles at every row count, and one row's alone."""
    torch.manual_seed(n)
    w, b, x = torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(203, k)
    panels = cpu_linear.pack(w)
    out = {}
    for level in ("avx2", "avx512"):
        with isa(level):
            out[level] = cpu_linear.linear(x, panels, n, b)
            for m in (2, 5, 12, 13, 97):
                assert torch.equal(cpu_linear.linear(x[:m], panels, n, b), out[level][:m]), (level, m)
    assert torch.equal(out["avx2"], out["avx512"])


def bf16_case(n, k, m, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    return w, torch.randn(n, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()


@pytest.mark.parametrize("level", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 37), (960, 576), (70, 2100), (17, 1024), (3, 8)])
def test_bf16_panels_match_float64_within_one_rounding(level, n, k):
    """fp32 sums of exact products, then one rounding to bf16: within a bf16 ulp (2^-8 relative) of float64."""
    w, b, x = bf16_case(n, k, 40, n + k)
    panels = cpu_linear.pack(w)
    with isa(level):
        for m in (1, 3, 17, 40):  # one row, the micro-kernels, AMX tiles (16 rows and more) with a ragged edge
            got = cpu_linear.linear(x[:m], panels, n, b)
            want = x[:m].double() @ w.double().T + b.double()
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-3 * (k / 64) ** 0.5).all(), (level, m)


@pytest.mark.parametrize("level", ["avx2", "avx512_bf16", "amx"])
def test_bf16_outputs_are_the_exact_sums_rounded_to_nearest_even(level):
    """Small integers: every product and partial sum is exact in fp32, so any summation order (AMX's
    included) reaches the exact sum, and the output must be that sum plus the bias rounded to bf16 to
    nearest even (many ties above 256), a NaN row 0x7FC0: the epilogue's rounding, bit for bit, on
    whole panels and on a ragged last one, at decode and prefill sizes."""
    g = torch.Generator().manual_seed(7)
    n, k, m = 300, 576, 200
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()
    x = torch.randint(-8, 9, (m, k), generator=g).bfloat16()
    b = (torch.randint(-64, 65, (n,), generator=g) / 2).bfloat16()
    x[3, 5] = float("nan")
    want = (x.double() @ w.double().T + b.double()).float().bfloat16()
    want[3] = float("nan")
    panels = cpu_linear.pack(w)
    with isa(level):
        for rows in (1, 5, 16, 40, 200):
            got = cpu_linear.linear(x[:rows], panels, n, b)
            assert torch.equal(got.view(torch.int16), want[:rows].view(torch.int16)), (level, rows)
    assert (want.double().abs() > 256).float().mean() > 0.5  # most outputs need rounding


@pytest.mark.parametrize("n,k", [(200, 576), (70, 2101), (33, 8)])
def test_bf16_avx2_path_gives_the_bf16_instructions_bits_and_every_row_its_own(n, k):
    """The AVX2 path (two FMAs a pair under DAZ/FTZ) computes what vdpbf16ps does, denormals included, and
    below the AMX rows a row's output does not depend on the batch."""
    w, b, x = bf16_case(n, k, 15, k)
    tiny = torch.finfo(torch.bfloat16).tiny
    w[0, :5], x[1, :3], x[2, 4] = tiny / 4, tiny / 2, -tiny / 8  # denormal weights and inputs
    x[3, :] = x[3, :] * 1e-30  # products and sums below fp32's normal range
    panels = cpu_linear.pack(w)
    out = {}
    for level in ("avx2", "avx512_bf16"):
        with isa(level):
            out[level] = cpu_linear.linear(x, panels, n, b)
            for r in range(15):
                for width in (4, 2, 1):
                    assert torch.equal(cpu_linear.linear(x[r : r + 1], panels, n, b, row_width=width), out[level][r : r + 1])
    assert torch.equal(out["avx2"], out["avx512_bf16"])


def test_bf16_amx_rows_are_batch_invariant():
    """AMX sums in an order of its own; every call takes the tiles where the CPU has them, one row too,
    so a row's output is the same at any batch size there as well, across the 64-row blocks a call walks
    the panels in too."""
    w, b, x = bf16_case(300, 576, 300, 3)
    panels = cpu_linear.pack(w)
    with isa("amx"):
        full = cpu_linear.linear(x, panels, 300, b)
        for lo, hi in [(0, 16), (5, 37), (40, 70), (0, 33), (7, 8), (69, 70), (3, 5), (60, 200), (128, 129),
                       (250, 300), (1, 300)]:
            assert torch.equal(cpu_linear.linear(x[lo:hi], panels, 300, b), full[lo:hi]), (lo, hi)
            for width in (4, 1):
                assert torch.equal(cpu_linear.linear(x[lo:lo + 1], panels, 300, b, row_width=width), full[lo:lo + 1])


def test_bf16_pack_unpack_and_row_lookups_are_exact_copies():
    w = torch.randn(37, 11).bfloat16()
    w[3, 4] = torch.finfo(torch.bfloat16).tiny / 2
    panels = cpu_linear.pack(w)
    assert panels.shape == (3, 16, 32) and panels.dtype == torch.bfloat16
    flushed = w.clone()
    flushed[3, 4] = 0  # a denormal weight is stored as the bf16 instructions read it
    assert torch.equal(cpu_linear.unpack(panels, 37, 11), flushed)
    ids = torch.tensor([[0, 36, 16, 16], [15, 17, 1, 2]])
    assert torch.equal(cpu_linear.rows_of(panels, ids, 11), flushed[ids])
    assert torch.equal(cpu_linear.rows_of(panels, ids[0]), cpu_linear.unpack(panels, 48)[ids[0]])  # every pair held


def test_the_isa_cap_is_read_from_the_environment(monkeypatch):
    code = "from svrmad_local.kernels import cpu_linear; print(cpu_linear.isa())"
    env = {**os.environ, "SVRMAD_CPU_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "avx2"
    monkeypatch.setenv("SVRMAD_CPU_ISA", "avx3")
    with pytest.raises(cpu_linear.IsaSettingError, match="SVRMAD_CPU_ISA='avx3' names no instruction level: use one "
                                                         "of avx2, avx512, avx512_bf16, amx"):
        cpu_linear.available()
