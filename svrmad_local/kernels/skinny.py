"""A linear for few rows (a decode step's M <= 32): y = x @ W^T (+ bias), reading W once for every row.

Why: at decode a linear streams its weight once per step and does almost no arithmetic, so its time is
the weight's bytes over the memory's bandwidth. cuBLAS reads the weights at these shapes well below
the card's bandwidth (docs/kernels.md, "Skinny linears"); a kernel written for few rows may read them
closer to the copy rate. The engine takes it per shape only where it measured faster than `F.linear`
(engine/choices.py `gemv_choice`), and `F.linear` everywhere else.

What: program (j, s) owns a strip of BLOCK_N output columns and the s-th of `split_k` shares of K. It
walks its share BLOCK_K at a time, loading the [BLOCK_N, BLOCK_K] weight tile once (contiguous along K)
and the [BLOCK_M, BLOCK_K] rows of x, and accumulates in fp32 either by broadcast products summed along K
(`dot=False`, no tensor cores, BLOCK_M the rows rounded up to a power of two; where the products fit
LATE_VALUES registers a thread, kept element-wise and summed along K once at the end) or by one `tl.dot`
on a row tile padded to 16 (`dot=True`; with `tma=True` its weight tiles come through a tensor descriptor,
sm_90's bulk tensor copy, where the weight allows one). With one share it writes the output (bias added,
cast to x's dtype); with several it writes fp32 partials, which a second small kernel sums in share order,
adds the bias to and casts (or, where the output goes straight into an add + RMSNorm, that norm sums them as
it loads them: kernels/shares.py): the result never depends on which program ran first (no atomics), so a
step's log-probs are the same bits on every run with the same configuration.

Configurations (`Config`) are chosen per (rows, N, K) by timing at engine build, never by
`triton.autotune`: autotuning would time inside the first call, and the engine's first call of a shape
may be inside a CUDA graph's capture.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._backend import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton
from .pdl import launch
from .norms import PLAIN
from .shares import Shares

try:  # Triton's host-side tensor descriptor (3.3 and later): a `tma` config's weight tiles
    from triton.tools.tensor_descriptor import TensorDescriptor
    HAS_TENSOR_DESCRIPTOR = True
except ImportError:
    TensorDescriptor, HAS_TENSOR_DESCRIPTOR = None, False

log = logging.getLogger("svrmad_local")

MAX_ROWS = 32  # rows above this are prefill or a wide batch: F.linear (a GEMM) always
TMA_BOX = 256  # the most elements a tensor descriptor's tile spans in a dimension
# the row counts timed at build: the decode graphs' padded row counts (engine/graphs.batch_sizes) up to 8, then
# 16 and 32 (a graph of 24 rows takes 32's pick)
ROWS = (1, 2, 4, 8, 16, 32)
# the broadcast-product configs hold rows x block_n x block_k products in registers: above this many rows only the
# tl.dot configs run (their row tile goes through the tensor cores: 16 rows, or 32)
BROADCAST_ROWS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DOT_ROWS = 16  # tl.dot's smallest row tile on a GPU
# Products kept per thread (fp32) up to which a tile's products accumulate element-wise and are summed
# along K once at the end (as inductor's looped reductions do); above it, summed per tile (registers)
LATE_VALUES = 32

if HAS_TRITON:
    from .pdl import enter

    from .fused_triton import _round, _scale, act_times, rows_or_shares

    @triton.jit
    def _summed_rows(X, U, rows, k, mask, n_shares, s_xs, s_xm, s_xk, s_um, s_uk, HAS_RES: tl.constexpr,
                     SHARES: tl.constexpr, XIN_DT: tl.constexpr, S_DT: tl.constexpr, RNE: tl.constexpr):
        """A normed linear's rows before their norm at columns k (fp32): x (SHARES: a split-K linear's
        n_shares fp32 partials summed in share order and rounded to XIN_DT, as its sum kernel does), plus
        the residual U rounded to S_DT (HAS_RES): add_rms_norm's new residual."""
        x = rows_or_shares(X + rows[:, None] * s_xm + k[None, :] * s_xk, mask, n_shares, s_xs, SHARES, XIN_DT, RNE)
        if HAS_RES:
            r = tl.load(U + rows[:, None] * s_um + k[None, :] * s_uk, mask=mask, other=0.0).to(tl.float32)
            x = _round(r + x, S_DT, RNE).to(tl.float32)
        return x

    @triton.jit
    def _tiles(X, U, W, WD, NW, n0, n, rows, k0, kk, nmask, rmask, k_hi, s_xm, s_xk, s_um, s_uk, s_wn, s_wk,
               GATED: tl.constexpr, RNE: tl.constexpr, TMA: tl.constexpr = False, rstd=None, offset=0.0,
               n_shares=1, s_xs=0, NORMED: tl.constexpr = False, HAS_RES: tl.constexpr = False,
               SHARES: tl.constexpr = False, XIN_DT: tl.constexpr = tl.float32, S_DT: tl.constexpr = tl.float32,
               ROUND_FIRST: tl.constexpr = True, HAS_OFFSET: tl.constexpr = False):
        """The weight's [BLOCK_N, BLOCK_K] tile at columns k0 + kk (read once: evicted first, x stays cached) and
        x's rows there [BLOCK_M, BLOCK_K]; GATED: those rows are SiLU(X) * U, rounded as act_mul rounds them;
        NORMED: they are RMSNorm(X [+ U]) by the rows' `rstd` and the norm's weight NW, in the NormStyle's
        rounding, as add_rms_norm computes them from the same sum of squares. TMA: the weight's tile through its
        tensor descriptor WD (sm_90's bulk tensor copy, one instruction a tile; what lies past N or K reads as
        zero, as the masks make it): the same values."""
        k = k0 + kk
        kmask = k < k_hi
        if TMA:
            w = WD.load([n0, k0])
        else:
            w = tl.load(W + n[:, None] * s_wn + k[None, :] * s_wk, mask=nmask[:, None] & kmask[None, :], other=0.0,
                        eviction_policy="evict_first")
        mask = rmask[:, None] & kmask[None, :]
        if NORMED:
            h = _summed_rows(X, U, rows, k, mask, n_shares, s_xs, s_xm, s_xk, s_um, s_uk, HAS_RES, SHARES, XIN_DT,
                             S_DT, RNE) * rstd[:, None]
            nw = tl.load(NW + k, mask=kmask, other=0.0)
            x = _round(_scale(h, nw[None, :], offset, S_DT, ROUND_FIRST, HAS_OFFSET, RNE), W.dtype.element_ty, RNE)
        else:
            x = tl.load(X + rows[:, None] * s_xm + k[None, :] * s_xk, mask=mask, other=0.0)
        if GATED:
            u = tl.load(U + rows[:, None] * s_um + k[None, :] * s_uk, mask=mask, other=0.0)
            x = act_times(x.to(tl.float32), u.to(tl.float32), X.dtype.element_ty, X.dtype.element_ty, False, RNE)
        return w, x

    @triton.jit
    def _prefetch_rows(starts, nbytes: tl.constexpr):
        """An L2 prefetch of `nbytes` (a multiple of 16) from each address of `starts` (16-byte aligned):
        sm_90's bulk prefetch, one instruction a row, nothing waits for it."""
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                  [starts.to(tl.int64, bitcast=True), tl.full(starts.shape, nbytes, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _skinny_kernel(X, U, W, WD, B, O, NW, SO, M, N, K, K_SHARE, EARLY, eps, offset, n_shares, s_xs,
                       s_xm, s_xk, s_um, s_uk, s_wn, s_wk, s_os, s_om, s_on, s_som,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr, LATE: tl.constexpr,
                       GATED: tl.constexpr, RNE: tl.constexpr, PREFETCH: tl.constexpr = 0,
                       AHEAD: tl.constexpr = False, TMA: tl.constexpr = False, NORMED: tl.constexpr = False,
                       HAS_RES: tl.constexpr = False, SHARES: tl.constexpr = False, XIN_DT: tl.constexpr = tl.float32,
                       S_DT: tl.constexpr = tl.float32, ROUND_FIRST: tl.constexpr = True,
                       HAS_OFFSET: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (j, s): columns j*BLOCK_N.. over K's s-th share, into O's s-th slice (the output
        itself where there is one share; the bias only in share 0). LATE: the products accumulate
        element-wise and are summed along K once at the end (no reduction across threads per tile).
        GATED: the rows are SiLU(X) * U (an MLP's down projection reading its gate/up output: act_mul's
        launch folded in). PREFETCH (bytes, launched with PDL: kernels/pdl.py): before waiting for the
        kernel before it, each of the first EARLY programs (those placed while it runs) fetches the first
        PREFETCH bytes of each of its weight rows' share into L2; later ones go straight to their loads.
        AHEAD (broadcast products): each tile's loads are issued one iteration before its products, so a
        program keeps two tiles in flight rather than one; the same products summed in the same order. TMA
        (tl.dot configs): the weight's tiles through its tensor descriptor WD, pipelined through shared memory
        by the bulk tensor copy and its barriers rather than a cp.async a thread; the same tiles. NORMED: the rows
        are RMSNorm(X [+ U]) (an add + RMSNorm's launch folded in: every program first walks the whole row for
        its sum of squares, and program (0, 0) writes the new residual X + U to SO; X may be SHARES, a split-K
        linear's partials), in the norm's own rounding (`_tiles`)."""
        n0 = tl.program_id(0) * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        share = tl.program_id(1)
        k_lo = share * K_SHARE
        if PREFETCH > 0:  # the weights are no kernel's output: read before the wait
            if tl.program_id(0) + share * tl.num_programs(0) < EARLY:
                _prefetch_rows(W + tl.minimum(n, N - 1).to(tl.int64) * s_wn + k_lo * s_wk, PREFETCH)
        enter(PDL)
        rows = tl.arange(0, BLOCK_M)
        nmask, rmask = n < N, rows < M
        kk = tl.arange(0, BLOCK_K)
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if NORMED:  # the whole row's sum of squares first; the new residual written once, by program (0, 0)
            squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            written = tl.where((tl.program_id(0) == 0) & (share == 0), K, 0)  # the columns this program writes
            for k0 in range(0, K, BLOCK_K):
                k = k0 + kk
                mask = rmask[:, None] & (k < K)[None, :]
                h = _summed_rows(X, U, rows, k, mask, n_shares, s_xs, s_xm, s_xk, s_um, s_uk, HAS_RES, SHARES,
                                 XIN_DT, S_DT, RNE)
                squares += h * h
                if HAS_RES:
                    tl.store(SO + rows[:, None] * s_som + k[None, :], h, mask=rmask[:, None] & (k < written)[None, :])
            rstd = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=1) / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if LATE:
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        k_hi = tl.minimum(K, k_lo + K_SHARE)
        if AHEAD:
            w_next, x_next = _tiles(X, U, W, WD, NW, n0, n, rows, k_lo, kk, nmask, rmask, k_hi, s_xm, s_xk, s_um,
                                    s_uk, s_wn, s_wk, GATED, RNE, False, rstd, offset, n_shares, s_xs, NORMED, HAS_RES,
                                    SHARES, XIN_DT, S_DT, ROUND_FIRST, HAS_OFFSET)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if AHEAD:  # the next tile's loads before this one's products (past k_hi: masked, nothing read)
                w, x = w_next, x_next
                w_next, x_next = _tiles(X, U, W, WD, NW, n0, n, rows, k0 + BLOCK_K, kk, nmask, rmask, k_hi, s_xm,
                                        s_xk, s_um, s_uk, s_wn, s_wk, GATED, RNE, False, rstd, offset, n_shares, s_xs,
                                        NORMED, HAS_RES, SHARES, XIN_DT, S_DT, ROUND_FIRST, HAS_OFFSET)
            else:
                w, x = _tiles(X, U, W, WD, NW, n0, n, rows, k0, kk, nmask, rmask, k_hi, s_xm, s_xk, s_um, s_uk, s_wn,
                              s_wk, GATED, RNE, TMA, rstd, offset, n_shares, s_xs, NORMED, HAS_RES, SHARES, XIN_DT,
                              S_DT, ROUND_FIRST, HAS_OFFSET)
            if DOT:
                if DOT_F32:
                    acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
            elif LATE:
                acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if LATE:
            acc = tl.sum(acc3, axis=2)
        if HAS_BIAS:
            if share == 0:
                acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(O + share * s_os + rows[:, None] * s_om + n[None, :] * s_on, acc,
                 mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _sum_shares_kernel(P, B, O, N, SHARES, s_ps, s_pm, s_pn, s_om, s_on,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Row m, columns j*BLOCK..: the shares' fp32 partials summed in share order, plus the bias."""
        enter(PDL)
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = n < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, SHARES):
            acc += tl.load(P + s * s_ps + m * s_pm + n * s_pn, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(O + m * s_om + n * s_on, acc, mask=nmask)


@dataclass(frozen=True)
class Config:
    """One launch's shape: output strips of block_n columns, K walked block_k at a time, split over
    split_k programs a strip (0: as many as fill the GPU, `shares`), the kernel's warps and pipeline
    stages, and whether the rows go through tl.dot (padded to 16) or broadcast products."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False
    ahead: bool = False  # broadcast products only: the next tile's loads issued before this one's products
    tma: bool = False  # tl.dot only: the weight's tiles by its tensor descriptor (sm_90's bulk copy), where it reads

    def __post_init__(self):
        if self.ahead and self.dot:
            raise ValueError("Config: ahead is for the broadcast products; tl.dot's loads are pipelined by stages")
        if self.tma and not (self.dot and self.block_n <= TMA_BOX and self.block_k <= TMA_BOX):
            raise ValueError(f"Config: tma is for the tl.dot configs, tiles of at most {TMA_BOX} x {TMA_BOX}")

    def __str__(self) -> str:
        split = "auto" if self.split_k == 0 else self.split_k
        return (f"n{self.block_n}k{self.block_k}s{split}w{self.num_warps}p{self.num_stages}"
                + ("dot" if self.dot else "") + ("a" if self.ahead else "") + ("t" if self.tma else ""))


# The candidates timed at build: narrow strips with long K tiles (each row of a tile a long contiguous read;
# the broadcast product holds rows x block_n x block_k values, so these suit 1-2 rows), wider strips with
# shorter tiles (4-8 rows), split-K for narrow outputs, and the tensor-core tile (rows padded to 16 or 32,
# the product off the registers: the only ones above 8 rows). What paces a GEMV is the bytes it has in
# flight (by Little's law ~3 TB/s at ~1 us of memory latency wants ~3 MB). Compiled for sm_90: a
# broadcast-product loop without `ahead` issues one tile's loads and waits for them before the next tile's
# (Triton pipelines only the loads that feed tl.dot, and ptxas reuses a tile's registers rather than issue
# more loads early), so it keeps one tile a program in flight: at 16 x 256 that is 2 MB across a 4,096-column bf16 linear, about what the H100
# profile's ~2.0 TB/s implies. The tl.dot configs stream their tiles through shared memory with cp.async,
# num_stages - 1 tiles ahead: the last three keep 48-64 KB a program in flight (32 output columns a
# program: a 4,096-column linear is ~one program an SM), in 72-96 KB of shared memory (96-128 KB with the
# gated prologue: under an A100's 163 KB); at 32 rows 64-128 KB (144-192 KB gated: an A100 keeps act_mul
# there, `runs_gated`). In fp32 twice that: the 32 x 512 tiles at 32 rows ask 256 KB, over a Hopper's 227, and
# are no candidate there (the timing leaves out what does not compile). The last three load each tile an
# iteration ahead of its products (`ahead`: two tiles a program in flight, the same bits as their twins),
# for the H200, whose skinny linears ran at ~1.8 TB/s of ~3.5. The `tma` ones read the weight's tiles through a
# tensor descriptor (sm_90's bulk tensor copy: one instruction a 16 KB tile, its arrival counted by a barrier,
# where cp.async takes eight a thread), four to seven tiles ahead; compiled for sm_90 with Triton 3.6 and 3.9,
# 49-197 KB of shared memory in bf16. That an H200 ran ~1.8 TB/s where an H100 ran ~2.0 says the linears are
# paced by what they keep in flight, not by the card; the bulk copy keeps more in flight for fewer
# instructions. benchmarks/bench_skinny.py times each config; the build picks per shape and row count.
CONFIGS = (
    Config(8, 512, 1, 4, 3),
    Config(16, 256, 1, 4, 3),
    Config(32, 128, 1, 8, 3),
    Config(16, 256, 0, 4, 3),
    Config(16, 64, 0, 4, 4),
    Config(64, 128, 1, 4, 4, dot=True),
    Config(32, 256, 0, 4, 3, dot=True),
    Config(32, 256, 1, 4, 5, dot=True),
    Config(32, 512, 1, 4, 3, dot=True),
    Config(32, 256, 2, 4, 4, dot=True),
    Config(8, 512, 1, 4, 3, ahead=True),
    Config(16, 256, 1, 4, 3, ahead=True),
    Config(16, 256, 0, 4, 3, ahead=True),
    Config(32, 256, 1, 4, 5, dot=True, tma=True),
    Config(32, 256, 0, 4, 3, dot=True, tma=True),
    Config(32, 128, 1, 4, 8, dot=True, tma=True),
)
# Launched with PDL (kernels/pdl.py), each program of the first wave (one an SM: those the GPU places while
# the kernel before still runs) first fetches this many bytes of each of its weight rows into L2, before it
# waits for that kernel: ~32 KB a program at 32 columns, ~4 MB over an H100's SMs, about what its memory
# delivers in the microsecond or so a kernel boundary costs. (A later program would only delay its own loads
# by the prefetch's issue, ~0.3 us: 32 rows made warp-uniform one at a time.)
PREFETCH_BYTES = 1024
DEFAULT = CONFIGS[1]  # gemv="skinny" without timing (tests, A/B runs), up to BROADCAST_ROWS rows
DEFAULT_DOT = CONFIGS[6]  # above them (64 KB of shared memory at 32 rows, 96 KB gated: an A100 and an H100 hold it)
SMS_DEFAULT = 132  # an H100's SMs, where the device cannot be asked (the interpreter)


def shares(cfg: Config, n: int, k: int, sms: int) -> int:
    """Programs a strip's K is split over: cfg.split_k where fixed; for 0, about two programs an SM,
    each walking at least four K tiles; 1 where the strips alone fill the GPU."""
    if cfg.split_k:
        return max(1, min(cfg.split_k, cdiv(k, cfg.block_k)))
    strips = cdiv(n, cfg.block_n)
    if strips >= sms:
        return 1
    return max(1, min(cdiv(2 * sms, strips), cdiv(k, cfg.block_k) // 4))


def runs(cfg: Config, rows: int) -> bool:
    """Whether `cfg` takes `rows` rows: every config up to BROADCAST_ROWS, the tl.dot ones up to MAX_ROWS."""
    return 0 < rows <= (MAX_ROWS if cfg.dot else BROADCAST_ROWS)


def default(rows: int) -> Config:
    """gemv="skinny"'s config at `rows` rows (no timing)."""
    return DEFAULT if runs(DEFAULT, rows) else DEFAULT_DOT


def sums_late(cfg: Config, block_m: int) -> bool:
    """Whether the broadcast products of `block_m` rows fit LATE_VALUES fp32 registers a thread, so that they
    are summed along K once at the end rather than per tile."""
    return not cfg.dot and block_m * cfg.block_n * cfg.block_k <= LATE_VALUES * 32 * cfg.num_warps


@functools.lru_cache(maxsize=None)  # asked per call
def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return SMS_DEFAULT


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError naming what does not fit: x [M <= MAX_ROWS, K], weight [N, K] of x's dtype, bias [N]."""
    if len(x.shape) != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x must be [M, K] and weight [N, K], got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear: at most {MAX_ROWS} rows, got {x.shape[0]}: use F.linear")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"skinny_linear: x and weight must share one of fp32/fp16/bf16, got {x.dtype} and "
                         f"{weight.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"skinny_linear: bias must be [{weight.shape[0]}], got {list(bias.shape)}")


def rows_aligned(weight: torch.Tensor) -> bool:
    """Whether `weight` is contiguous along K with its start and each of its rows 16-byte aligned: what the bulk
    copies ask of an address (the PDL prefetch's, a tensor descriptor's)."""
    return weight.stride(1) == 1 and weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0


def prefetch_bytes(weight: torch.Tensor, k_share: int, split: int) -> int:
    """The bytes of each weight row's share a launch with PDL fetches into L2 before it waits (`PREFETCH_BYTES`,
    or the last, shortest share's bytes, in 16-byte units); 0 where a row's share does not start 16-byte
    aligned (the bulk prefetch's rule) or K is not contiguous."""
    e = weight.element_size()
    if not rows_aligned(weight) or k_share * e % 16:
        return 0
    last = weight.shape[1] - (split - 1) * k_share
    return min(PREFETCH_BYTES, last * e) // 16 * 16


def reads_by_tma(weight: torch.Tensor) -> bool:
    """Whether a tensor descriptor can read `weight` (a `tma` config's path; elsewhere the same config loads
    its tiles by pointer, the same values): `rows_aligned`, and Triton has host descriptors."""
    return HAS_TENSOR_DESCRIPTOR and rows_aligned(weight)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  cfg: Config = DEFAULT, up: torch.Tensor | None = None, unsummed: bool = False,
                  norm: tuple | None = None, residual: torch.Tensor | None = None):
    """x [M, K] (M <= 8, or <= 32 for a tl.dot config) @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype,
    fp32 accumulation. With `up` (x's shape and dtype), the rows multiplied are SiLU(x) * up, rounded as
    act_mul rounds them (x the gate: an MLP's down projection over its gate/up output). Launches one kernel
    (two where K is split); nothing returns to the host, so a CUDA graph captures it. `unsummed`: where K
    is split and there is no bias, the partials as kernels/shares.Shares, without the sum kernel (for a
    consumer that sums them: the decoder's add + RMSNorm).

    `norm` ((weight [K], eps, NormStyle): the norm the decoder runs before this linear): the rows multiplied
    are RMSNorm(x + residual), or RMSNorm(x) without `residual`, as fused_triton's add_rms_norm computes them
    (the same roundings; the sum of squares in another order), and the call returns (output, new residual:
    x + residual, or x itself): the norm's launch folded into this one. x may then be a split-K linear's
    Shares (summed as they are loaded), with a residual."""
    if isinstance(x, Shares) and (norm is None or residual is None):
        raise ValueError("skinny_linear: a split-K linear's shares are read only by a normed call with a residual")
    check(x, weight, bias)
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        raise ValueError(f"skinny_linear: up must match the gate, got {list(up.shape)} {up.dtype} and "
                         f"{list(x.shape)} {x.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if m and not runs(cfg, m):
        raise ValueError(f"skinny_linear: {cfg} takes at most {BROADCAST_ROWS} rows (its products are held in "
                         f"registers), got {m}: a tl.dot config takes up to {MAX_ROWS}")
    normed = _normed_args(x, weight, up, norm, residual) if norm is not None else {}
    so, nw = normed.pop("so", None), normed.pop("nw", weight)
    eps, offset = normed.pop("eps", 0.0), normed.pop("offset", 0.0)
    rows = x.parts if isinstance(x, Shares) else x
    # the interpreter truncates fp32 -> bf16/fp16 on store where a GPU rounds to nearest: round in torch there
    out_dtype = torch.float32 if interpreting() else x.dtype
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    done = (lambda y: (y, so if residual is not None else x)) if norm is not None else (lambda y: y)
    if m == 0 or n == 0:
        return done(out.to(x.dtype))
    sms = _sms(x.device)
    split = shares(cfg, n, k, sms)
    k_share = cdiv(cdiv(k, split), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_share)  # every share non-empty
    parts = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    part_strides = (0, *parts.stride()) if split == 1 else parts.stride()
    block_m = max(DOT_ROWS, next_pow2(m)) if cfg.dot else next_pow2(m)
    b = bias if bias is not None else weight
    u = up if up is not None else residual if residual is not None else rows
    n_parts, x_strides = (rows.shape[0], rows.stride()) if rows.dim() == 3 else (1, (0, *rows.stride()))
    pdl = launch(rows)
    tma = cfg.tma and reads_by_tma(weight)
    wd = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [cfg.block_n, cfg.block_k]) \
        if tma else weight
    _skinny_kernel[(cdiv(n, cfg.block_n), split)](
        rows, u, weight, wd, b, parts, nw, so if so is not None else out, m, n, k, k_share, sms, eps, offset,
        n_parts, *x_strides, *u.stride()[-2:], *weight.stride(), *part_strides, so.stride(0) if so is not None else 0,
        HAS_BIAS=bias is not None and split == 1, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT=cfg.dot, DOT_F32=x.dtype == torch.float32 or interpreting(), LATE=sums_late(cfg, block_m),
        GATED=up is not None, RNE=interpreting(), PREFETCH=prefetch_bytes(weight, k_share, split) if pdl else 0,
        AHEAD=cfg.ahead, TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **normed, **pdl)
    if split > 1 and unsummed and bias is None:
        return done(Shares(parts, x.dtype))
    if split > 1:
        block = 1024
        _sum_shares_kernel[(m, cdiv(n, block))](parts, b, out, n, split, *parts.stride(), *out.stride(),
                                                HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **launch(parts))
    return done(out.to(x.dtype))


def _normed_args(x, weight: torch.Tensor, up, norm: tuple, residual: torch.Tensor | None) -> dict:
    """The normed call's kernel arguments (`skinny_linear`'s `norm`), its new residual's buffer ("so") among
    them; ValueError naming what does not fit."""
    from .fused_triton import _TL, _norm_out, _style  # the norm kernel's own rules: one place

    nw, eps, style = norm
    if up is not None:
        raise ValueError("skinny_linear: a call is gated (up) or normed (norm), not both")
    if nw.dim() != 1 or nw.shape[0] != x.shape[1]:
        raise ValueError(f"skinny_linear: the norm's weight must be [{x.shape[1]}], got {list(nw.shape)}")
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype not in _TL):
        raise ValueError(f"skinny_linear: the residual must be {list(x.shape)} fp32/fp16/bf16, got "
                         f"{list(residual.shape)} {residual.dtype}")
    y_dtype = _norm_out(x.dtype, nw, style)
    if y_dtype != weight.dtype:
        raise ValueError(f"skinny_linear: the norm gives {y_dtype} rows, the weight is {weight.dtype}")
    s_dtype = torch.promote_types(residual.dtype, x.dtype) if residual is not None else x.dtype
    so = torch.empty(tuple(x.shape), device=x.device, dtype=s_dtype) if residual is not None else None
    return {"so": so, "nw": nw.contiguous(), "eps": float(eps), "offset": float(style.offset), "NORMED": True,
            "HAS_RES": residual is not None, "SHARES": isinstance(x, Shares), "XIN_DT": _TL[x.dtype],
            "S_DT": _TL[s_dtype], **_style(style)}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              up: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in fp32 (the kernel's accumulation), cast to x's dtype: what the tests compare with.
    With `up`: of F.silu(x) * up, as the model's MLP computes its down projection's input."""
    if up is not None:
        x = F.silu(x) * up
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def bound(weight: torch.Tensor, bias: torch.Tensor | None, picks: dict[int, Config], unsummed: bool = False):
    """x [M, K] -> linear(x, weight, bias): the skinny kernel with `picks[next_pow2(M)]` where it holds one
    (M <= 32: a decode step's rows, padded by the graphs to 1, 2, 4, 8, 16, 24, 32), else F.linear. A dict lookup at
    call time: nothing a CUDA graph cannot capture, and a graph is per row count, so it records one path.
    `unsummed`: a split-K pick's partials are left to the caller's consumer (`skinny_linear`)."""
    pick = _by_rows(picks)

    def call(x: torch.Tensor):
        cfg = pick(x)
        return F.linear(x, weight, bias) if cfg is None else skinny_linear(x, weight, bias, cfg, unsummed=unsummed)

    call.picks = picks  # what this call runs at each row count (tests, the record)
    return call


def bound_gated(weight: torch.Tensor, bias: torch.Tensor | None, picks: dict[int, Config], plain=None,
                unsummed: bool = False):
    """(gate, up, act_mul) -> linear(SiLU(gate) * up, weight, bias): an MLP's down projection. At the row
    counts of `picks` (the gated configs the build timed: engine/gemv.py), the activation is the kernel's
    prologue (one launch where act_mul and the linear were two); elsewhere `act_mul(gate, up, "silu")`, then
    `plain` (the shape's plain call: `bound` over its own picks, or F.linear; default `bound(weight, bias,
    picks)`). A picked config whose gated variant does not launch here keeps the two calls at its rows
    (`runs_gated`). `unsummed`: as `bound`'s (`plain` says its own)."""
    plain = bound(weight, bias, picks, unsummed) if plain is None else plain
    gated = {r: cfg for r, cfg in picks.items() if runs_gated(weight, bias, r, cfg)}
    pick = _by_rows(gated)

    def call(gate: torch.Tensor, up: torch.Tensor, act_mul):
        cfg = pick(gate)
        if cfg is None:
            return plain(act_mul(gate, up, "silu"))
        return skinny_linear(gate, weight, bias, cfg, up=up, unsummed=unsummed)

    call.picks = gated
    return call


def bound_normed(weight: torch.Tensor, bias: torch.Tensor | None, picks: dict[int, Config], norm: tuple):
    """(x, residual) -> (linear(RMSNorm(x + residual)), x + residual) at the row counts of `picks` (the normed
    configs the build timed: engine/gemv.py), the norm (`norm`: weight, eps, NormStyle) in the kernel's prologue,
    one launch where add_rms_norm and the linear were two (`skinny_linear`'s `norm`; residual None: RMSNorm(x),
    and x itself); None at other row counts, where the caller runs the two (engine/families.normed_columns)."""
    pick = _by_rows(picks)

    def call(x, residual):
        cfg = pick(x)
        return None if cfg is None else skinny_linear(x, weight, bias, cfg, norm=norm, residual=residual)

    call.picks = picks
    return call


_GATED_RUNS: dict[tuple, bool] = {}


def runs_gated(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, cfg: Config) -> bool:
    """Whether the gated variant of `cfg` launches on weight's device at `rows` rows, tried once a shape (at
    build, before any graph). Why try: it holds the gate's and up's tiles besides the weight's, so a
    pipelined config can ask for more shared memory a program than a GPU grants (99 KB on sm_86 and
    sm_89) where the plain variant fits; the build's timing leaves such a config out, `gemv="skinny"` (no
    timing) meets it here."""
    key = (tuple(weight.shape), weight.dtype, str(weight.device), bias is not None, rows, cfg)
    if key not in _GATED_RUNS:
        x = weight.new_zeros(rows, weight.shape[1])
        try:
            skinny_linear(x, weight, bias, cfg, up=x)
            _GATED_RUNS[key] = True
        except Exception as err:  # noqa: BLE001 - the two calls serve these rows
            log.info("skinny: %s with SiLU(gate) * up inside does not launch here (%s); act_mul then the kernel "
                     "at %d rows", cfg, str(err).splitlines()[0] if str(err) else type(err).__name__, rows)
            _GATED_RUNS[key] = False
    return _GATED_RUNS[key]


def _by_rows(picks: dict[int, Config]):
    """x -> the config picked for x's row count (by its padded count), or None: F.linear."""
    by_rows = [picks.get(next_pow2(m)) if m else None for m in range(MAX_ROWS + 1)]

    def pick(x) -> Config | None:  # x: a tensor, or a linear's Shares
        m = x.shape[0] if len(x.shape) == 2 else MAX_ROWS + 1
        return by_rows[m] if m <= MAX_ROWS else None

    return pick


def time_call(fn, reps: int = 5, inner: int = 10) -> float:
    """Seconds a call of `fn` takes on the device: `inner` calls captured in one CUDA graph (after an eager
    call, which compiles), the graph replayed between two events `reps` times, the median over the calls.
    In a graph, as a captured decode step runs it: the device's time, not the host's launch cost (a Triton
    launch costs the host more than cuBLAS's, which would otherwise decide between them). Where a capture
    fails, the same calls eagerly."""
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        run = graph.replay
    except RuntimeError:
        def run():
            for _ in range(inner):
                fn()
    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return sorted(times)[len(times) // 2]


def cuda_timer(weight: torch.Tensor, bias: torch.Tensor | None, plain: dict[int, Config] | None = None,
               prologue: str = "silu", unsummed: bool = False):
    """A timer for `gemv_choice`: (m, candidate) -> seconds of one call at m rows, the candidate "torch"
    (F.linear) or a Config; with `plain` (the shape's plain picks), the linear with its `prologue` as
    `bound_gated` ("silu") or `bound_normed` ("norm") runs it; `unsummed`: a split config's partials left
    unsummed, as the decoder's o_proj and down leave them (`timed_call`). The weight is rotated through
    copies that overflow the L2 cache (a decode step reads every layer's weights once, cold), so neither side
    is timed out of the cache."""
    weights = cold_copies(weight)

    def timer(m: int, candidate) -> float:
        run = timed_call(weights, bias, m, candidate, plain, prologue, unsummed)
        with torch.cuda.device(weight.device):  # the graph and the events on the weight's device
            return time_call(run)

    return timer


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and clones of it (at most 16 in all) that together hold twice the GPU's L2 cache: a timing that
    reads the next copy each call reads it from memory, as a decode step reads each layer's weight once."""
    l2 = int(getattr(torch.cuda.get_device_properties(weight.device), "L2_cache_size", 50 << 20))
    copies = max(1, min(16, cdiv(2 * l2, weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


PROLOGUES = ("silu", "norm")  # what a timed call folds in before its linear (`timed_call`)


def timed_call(weights: list[torch.Tensor], bias: torch.Tensor | None, m: int, candidate,
               plain: dict[int, Config] | None = None, prologue: str = "silu", unsummed: bool = False):
    """The call `cuda_timer` repeats, each time over the next of `weights` (copies of one weight): () -> the
    output at m random rows. "torch": F.linear; a Config: the kernel. With `plain` (the shape's plain picks
    {rows: Config}), the op before the linear too, by `prologue`: "silu", x the gate half of a gate/up output
    [m, 2K], "torch" act_mul then the plain pick at m rows (F.linear where none), a Config the kernel with
    SiLU(gate) * up in its prologue; "norm", x and a residual [m, K], "torch" add_rms_norm then the plain
    pick, a Config the kernel with the add + RMSNorm in its prologue. `unsummed`: the kernel's calls (the
    plain pick's too) leave a split config's partials unsummed (`skinny_linear`)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"timed_call: prologue must be one of {', '.join(PROLOGUES)}, got {prologue!r}")
    weight = weights[0]
    k = weight.shape[1]
    gated, normed = plain is not None and prologue == "silu", plain is not None and prologue == "norm"
    x = torch.randn(m, 2 * k if gated else k, device=weight.device, dtype=weight.dtype)
    gate, up = (x[:, :k], x[:, k:]) if gated else (x, None)
    residual = torch.randn_like(x) if normed else None
    norm = (1 + 0.1 * torch.randn(k, device=weight.device, dtype=weight.dtype), 1e-6, PLAIN) if normed else None
    before = None if plain is None else plain.get(next_pow2(m))
    if plain is not None:
        from .fused_triton import act_mul, add_rms_norm  # the decoder's ops on a GPU (kernels/fused.py)
    turn = iter(range(1 << 62))

    def run() -> torch.Tensor:
        w = weights[next(turn) % len(weights)]
        if candidate != "torch":
            out = skinny_linear(gate, w, bias, candidate, up=up, unsummed=unsummed, norm=norm, residual=residual)
            return out[0] if normed else out
        if plain is None:
            return F.linear(x, w, bias)
        y = act_mul(gate, up, "silu") if gated else add_rms_norm(x, residual, *norm)[0]
        return F.linear(y, w, bias) if before is None else skinny_linear(y, w, bias, before, unsummed=unsummed)

    run.operands = (x, residual, norm) if normed else (gate, up)  # what it multiplies (tests)
    return run
