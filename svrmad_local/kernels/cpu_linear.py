"""fp32 and bf16 linears on the CPU from weights kept in 16-column panels: one read of the weights a step.

Why: at decode a step multiplies 1-32 rows by every weight of the model, so its linears are a
stream of the weights through memory. oneDNN on its packed layout streamed them at ~14 GB/s on a
2-core AVX2 EPYC that reads ~20-25; this kernel, on weights stored the way it reads them, streams at
~21. Measured on the default's shapes over 30 layers and its LM head (distinct weights, so nothing
stays in cache), ms per step: M=1 39.0 -> 24.8, M=4 47.3 -> 30.3, M=8 61.5 -> 43.8, M=24 124 -> 105,
M=64 272 -> 243, M=512 1509 -> 1553 (benchmarks/bench_linear.py).

With 2-64 rows the FMAs pace the loads so slowly that the hardware's prefetch left the stream well
under the machine's bandwidth; the first row tile of a pass prefetches 64 k's (4 KB) ahead, and the last
of several tiles the next panel. On a 2-core AVX-512 EPYC (11-25, the same step, ms): M=4 20.9 -> 17.2,
M=8 28.8 -> 22.6, M=12 32.8 -> 21.9, M=24 47.2 -> 34.0, M=64 96.9 -> 85.0, M=512 717 -> 683; M=1
prefetches nothing. M=1 (a batch-1 decode step) walks four panels at once instead: eight FMA chains in
flight instead of two, the same arithmetic per output; on the 2-core AVX2 EPYC the default's whole
step of linears went from ~30 to ~35 GB/s (docs/kernels.md, "Batch-1 decode").

The layout: weight W [N, K] as panels [ceil(N / 16), K, 16], panel p holding columns 16p..16p+15 of
W^T (zero-padded past N): each panel is one contiguous run, read once per block of input rows. The
kernel (csrc/cpu_linear.cpp) keeps 6 rows x 16 columns of outputs in AVX2 registers (12 rows in 16-lane
vectors where the CPU has AVX-512) and walks k in order.

Its arithmetic is fixed: each output is one FMA chain over k, restarted every KBLOCK = 1024 k's, the
chains summed in order, then the bias added. Nothing depends on how many rows are in the call, where a
row sits or the vector width (a 16-lane lane does what an 8-lane one did), so a row's output is bitwise
the same at any batch size (a decode step equals the full-sequence reference) and on every x86 CPU.
That order is also the one oneDNN's fp32 AVX2 GEMM used on the machine we measured (bitwise equal at
every shape we tried), though no test relies on it: oneDNN is another library, free to change its
blocking by machine and version.

bf16 (half the bytes to stream): panels [ceil(N / 16), K2p, 32], each pair-row holding k = 2i, 2i + 1 of
the panel's 16 columns side by side, which is the operand layout of avx512_bf16's dot product and of an
AMX bf16 tile, so the same bytes serve three paths, chosen at run time by what the CPU has
(`isa()`; SVRMAD_CPU_ISA caps it): AMX tiles (every call; prefill chunks at tile speed), vdpbf16ps, or
AVX2 with two FMAs a pair. Each output is fp32: the exact products summed pair by pair (the odd k, then
the even one, each sum rounded), denormals read and written as zero, then the bias, then one rounding to
bf16. vdpbf16ps and the AVX2 path compute exactly that, the same bits at any batch size; AMX sums a
tile's products in an order of its own, so an AMX machine's bits are its own, still the same at any
batch size. csrc/cpu_linear.cpp has the details.
"""

from __future__ import annotations

import os

import torch

from svrmad_local.errors import UserError

from ._backend import choose
from ._cpu_build import Kernel

NR = 16  # columns a panel
KBLOCK = 1024
ROW_WIDTH = 4  # panels a one-row call walks at once: 4, 2 or 1 (the walk before it; benchmarks/bench_gemv.py)

NAME = "cpu_linear"  # its name for _backend.choose
_KERNEL = Kernel(NAME, "cpu_linear.cpp", "SVRMAD_CPU_LINEAR", "panel linear kernel", needs_avx2=True)


def digest() -> str:
    """The build's name (its source, headers and flags): a calibration made with another build is stale."""
    return _KERNEL.digest()


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_LINEAR=0 turns it off."""
    isa_cap()
    return choose("auto", "cpu", NAME).impl == "cpp"


def unavailable_reason() -> str | None:
    """Why the torch path runs instead (None where the kernel does)."""
    return choose("auto", "cpu", NAME).why


DTYPES = (torch.float32, torch.bfloat16)  # the weight dtypes the kernel packs
PAIRS_TILE = 16  # bf16: k-pairs a panel holds a multiple of (an AMX B tile's rows)


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels (a new tensor; the caller drops the dense one): fp32 [ceil(N / 16), K, 16]; bf16
    [ceil(N / 16), K2p, 32], pair-row i holding k = 2i, 2i + 1 of each of the panel's 16 columns side by
    side (K2p: ceil(K / 2) rounded up to 16, zero pairs past K). bf16 denormals (below 1.2e-38) are stored
    as zero, as the bf16 dot-product instructions read them."""
    n, k = w.shape
    p = -(-n // NR)
    if w.dtype == torch.bfloat16:
        k2p = -(-k // (2 * PAIRS_TILE)) * PAIRS_TILE
        w = torch.where(w.abs() < torch.finfo(torch.bfloat16).tiny, torch.zeros((), dtype=w.dtype), w)
        full = w.new_zeros(p * NR, 2 * k2p)
        full[:n, :k] = w
        return full.reshape(p, NR, k2p, 2).permute(0, 2, 1, 3).reshape(p, k2p, 2 * NR).contiguous()
    if p * NR != n:
        w = torch.cat([w, w.new_zeros(p * NR - n, k)])
    return w.reshape(p, NR, k).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
    """panels -> the dense [n, K] weight (a copy). bf16 panels hold K rounded up: `k` cuts it (default: all)."""
    p = panels.shape[0]
    if panels.dtype == torch.bfloat16:
        k2p = panels.shape[1]
        dense = panels.reshape(p, k2p, NR, 2).permute(0, 2, 1, 3).reshape(p * NR, 2 * k2p)
        return dense[:n, : 2 * k2p if k is None else k].contiguous()
    return panels.transpose(1, 2).reshape(p * NR, panels.shape[1])[:n].contiguous()


def rows_of(panels: torch.Tensor, ids: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Rows `ids` of the dense weight, read from the panels (an embedding lookup): a copy of exactly those values
    (bf16: the first `k` of each row), in one compiled call (see `pack` for where each value sits)."""
    return _KERNEL.module().panel_rows(panels, ids, -1 if k is None else k)


ISA_NAMES = ("avx2", "avx512", "avx512_bf16", "amx")


class IsaSettingError(UserError, ValueError):
    """SVRMAD_CPU_ISA names no instruction level."""


def isa_cap() -> str | None:
    """SVRMAD_CPU_ISA: the highest instructions the CPU kernels may take (each kernel reads it when it
    loads; csrc/simd.h), or None; any other value is refused in one line."""
    v = os.environ.get("SVRMAD_CPU_ISA", "")
    if v and v not in ISA_NAMES:
        raise IsaSettingError(f"SVRMAD_CPU_ISA={v!r} names no instruction level: use one of {', '.join(ISA_NAMES)}")
    return v or None


def isa() -> str:
    """The instructions the kernel takes on this CPU (avx2, avx512, avx512_bf16, amx), after SVRMAD_CPU_ISA."""
    isa_cap()
    return ISA_NAMES[_KERNEL.module().isa_level()]


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
           row_width: int = ROW_WIDTH) -> torch.Tensor:
    """x [..., K] @ W[:n].T + bias, W held as `panels` (see pack). `row_width` changes the speed of a
    one-row call, never its bits."""
    lead = x.shape[:-1]
    return _KERNEL.module().panel_linear(x.reshape(-1, x.shape[-1]), panels, n, bias, KBLOCK, row_width).view(*lead, n)


def bound(panels: torch.Tensor, n: int, bias: torch.Tensor | None = None, row_width: int = ROW_WIDTH):
    """x [M, K] -> linear(x, panels, n, bias) as one closure over the compiled call: what a decode step's
    ~121 calls cost in Python is a large share of a batch-1 step on a slow core (engine/decoder.py)."""
    fn = _KERNEL.module().panel_linear
    return lambda x: fn(x, panels, n, bias, KBLOCK, row_width)
