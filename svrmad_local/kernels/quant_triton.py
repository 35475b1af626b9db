"""Triton GEMMs that read packed weights as published: MXFP4 (GPT-OSS experts) and block-scaled FP8
(DeepSeek-V3 projections), so a quantized model keeps its packed bytes in GPU memory and never holds
a dense copy of a weight, not even one expert's.

Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K: it loads the packed weight tile,
decodes it in registers, and accumulates ``x_tile @ w_tile^T`` in fp32. The torch references that
these kernels are tested against, and the modules that call them, live in kernels/mxfp4.py and
kernels/fp8.py; here are only the kernels and their launchers.

MXFP4 (OCP microscaling, GPT-OSS's layout): ``blocks`` uint8 [N, K/32, 16] holds two e2m1 codes a
byte, the low nibble first (element 2j of a row is the low nibble of its byte j); ``scales`` uint8
[N, K/32] is an e8m0 exponent per 32 elements, value 2^(s-127). Rather than interleave the two nibbles
back into one tile, a K tile is split into its even and odd elements: ``x[:, 0::2] @ lo^T +
x[:, 1::2] @ hi^T``, two dots on the same bytes. The decoded value times its power-of-two scale is
exact in bf16 (two mantissa bits), so the dot runs in x's dtype on the tensor cores.

FP8 (DeepSeek's ``weight_scale_inv``): W = weight * scale_inv[n // bn, k // bk]. When the K tile lies
inside one scale block (bk a multiple of BLOCK_K) the kernel takes the dot of the raw e4m3 values
(exact in bf16/fp16) and scales the partial product per output column, as DeepSeek's own kernel does;
otherwise it scales the weight tile element-wise before the dot. Ragged N and K (partial edge
blocks) are masked. Triton has no e4m3 type before sm_89 (an A100 is sm_80): there the kernel reads
the weight as bytes and decodes them itself (`_e4m3`, exact), the same values on every GPU.

Tiles per shape (`tiles`): a short M tile at decode (a few rows: the GEMM streams the weights), larger
ones at prefill, from a small table per GPU generation; and at decode, where the output is narrow (DeepSeek's
kv_a projection, 576 x 7,168, makes 9 column tiles for 132 SMs), split-K: each of `split_k` programs of a
tile walks its share of K and writes an fp32 partial, summed in torch (deterministic, no atomics). The
table's figures are chosen, not yet timed: benchmarks/bench_quant.py (a step of the GPU check) times them
against cuBLAS on the dequantized weights and the bytes they read.

The MoE expert GEMM needs no host sync (CUDA-graph safe): one small program reads the offsets once and
writes each row tile's expert, first row and end (`_tile_map_kernel`); the grid is an upper bound on the
number of row tiles (cdiv(M, BLOCK_M) + min(E, M): each expert with rows adds at most one partial tile),
each program reads its entry, and programs past the last tile do nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import HAS_TRITON, cdiv, interpreting, tl, triton
from .pdl import launch

if HAS_TRITON:
    from .pdl import enter

    @triton.jit
    def _e2m1(code):
        """e2m1 code (int32, 0..15) -> fp32: sign bit 3, exponent bits 2..1, mantissa bit 0.
        Values 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0)."""
        mag = code & 7
        e = mag >> 1
        m = (mag & 1).to(tl.float32)
        val = tl.where(e == 0, 0.5 * m, tl.exp2((e - 1).to(tl.float32)) * (1.0 + 0.5 * m))
        return tl.where(code >= 8, -val, val)

    @triton.jit
    def _mxfp4_tile(acc, X, W, S, rows, rmask, n, nmask, k0, K, e_w, e_s,
                    s_xm, s_xk, s_wn, s_wg, s_wb, s_sn, s_sg,
                    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
        """acc += x[rows, k0:k0+BLOCK_K] @ W[n, k0:k0+BLOCK_K]^T for one packed weight tile."""
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index within the row
        jmask = j < K // 2
        grp = j // 16
        wmask = nmask[:, None] & jmask[None, :]
        byte = tl.load(W + e_w + n[:, None] * s_wn + grp[None, :] * s_wg + (j % 16)[None, :] * s_wb,
                       mask=wmask, other=0).to(tl.int32)
        sc = tl.load(S + e_s + n[:, None] * s_sn + grp[None, :] * s_sg, mask=wmask, other=127).to(tl.float32)
        scale = tl.exp2(sc - 127.0)
        w_lo = _e2m1(byte & 15) * scale  # elements 2j
        w_hi = _e2m1(byte >> 4) * scale  # elements 2j + 1
        xmask = rmask[:, None] & jmask[None, :]
        x_lo = tl.load(X + rows[:, None] * s_xm + (2 * j)[None, :] * s_xk, mask=xmask, other=0.0)
        x_hi = tl.load(X + rows[:, None] * s_xm + (2 * j + 1)[None, :] * s_xk, mask=xmask, other=0.0)
        if DOT_F32:
            acc = tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), acc, input_precision="ieee")
            acc = tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), acc)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), acc)
        return acc

    @triton.jit
    def _mxfp4_kernel(X, W, S, B, O, M, N, K, K_SPLIT,
                      s_xm, s_xk, s_wn, s_wg, s_wb, s_sn, s_sg, s_os, s_om, s_on,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False):
        """Program (i, j, s): output tile (i, j) over K's s-th share [s * K_SPLIT, (s + 1) * K_SPLIT), written
        to partial s (one split: the output itself); the bias joins partial 0."""
        enter(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rmask, nmask = rows < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(split * K_SPLIT, tl.minimum(K, (split + 1) * K_SPLIT), BLOCK_K):
            acc = _mxfp4_tile(acc, X, W, S, rows, rmask, n, nmask, k0, K, 0, 0,
                              s_xm, s_xk, s_wn, s_wg, s_wb, s_sn, s_sg, BLOCK_K, DOT_F32)
        if HAS_BIAS:
            if split == 0:
                acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(O + split * s_os + rows[:, None] * s_om + n[None, :] * s_on, acc,
                 mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _tile_map_kernel(OFF, E, T, TE, TR, TEND, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                         PDL: tl.constexpr = False):
        """One program reads the expert offsets once and writes, for each row tile t of a grouped GEMM (each
        expert's rows OFF[e]:OFF[e+1] cut into tiles of BLOCK_M, experts in order), its expert, first row
        and its expert's end row; tiles t up to T past the last get expert -1."""
        enter(PDL)
        idx = tl.arange(0, BLOCK_T)
        seen = tl.full([], 0, tl.int32)
        for e in range(E):
            lo = tl.load(OFF + e).to(tl.int32)
            hi = tl.load(OFF + e + 1).to(tl.int32)
            n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
            for j0 in range(0, n_tiles, BLOCK_T):
                j = j0 + idx
                jmask = j < n_tiles
                tl.store(TE + seen + j, tl.zeros([BLOCK_T], tl.int32) + e, mask=jmask)
                tl.store(TR + seen + j, lo + j * BLOCK_M, mask=jmask)
                tl.store(TEND + seen + j, tl.zeros([BLOCK_T], tl.int32) + hi, mask=jmask)
            seen += n_tiles
        for t0 in range(seen, T, BLOCK_T):
            tl.store(TE + t0 + idx, tl.full([BLOCK_T], -1, tl.int32), mask=t0 + idx < T)

    @triton.jit
    def _grouped_tile(TE, TR, TEND, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (t, j) of a grouped GEMM, from the tile map: its expert (0 when past the last tile), rows
        and mask (all false past the end), output columns and mask, and how far to walk K (0 past the end)."""
        t = tl.program_id(0)
        expert = tl.load(TE + t)
        row0 = tl.load(TR + t, mask=expert >= 0, other=0)
        row_end = tl.load(TEND + t, mask=expert >= 0, other=0)
        rows = row0 + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return (tl.maximum(expert, 0).to(tl.int64), rows, rows < row_end, n, n < N,
                tl.where(expert >= 0, K, 0))

    @triton.jit
    def _mxfp4_grouped_kernel(X, TE, TR, TEND, W, S, B, O, N, K,
                              s_xm, s_xk, s_we, s_wn, s_wg, s_wb, s_se, s_sn, s_sg, s_be, s_om, s_on,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False):
        """Program (t, j): the t-th row tile over all experts (each expert's rows cut into tiles of
        BLOCK_M, read from the tile map), output columns tile j. A t past the last tile does nothing."""
        enter(PDL)
        e_safe, rows, rmask, n, nmask, k_end = _grouped_tile(TE, TR, TEND, N, K, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            acc = _mxfp4_tile(acc, X, W, S, rows, rmask, n, nmask, k0, K, e_safe * s_we, e_safe * s_se,
                              s_xm, s_xk, s_wn, s_wg, s_wb, s_sn, s_sg, BLOCK_K, DOT_F32)
        if HAS_BIAS:
            acc += tl.load(B + e_safe * s_be + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(O + rows[:, None] * s_om + n[None, :] * s_on, acc, mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _e4m3(code):
        """float8_e4m3fn bytes -> fp32, exact: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
        subnormal (m x 2^-9), S.1111.111 NaN (e4m3fn has no infinity)."""
        c = code.to(tl.int32) & 0xFF
        sign = (c & 0x80) << 24
        e = (c >> 3) & 0xF
        m = c & 7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125
        value = tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)
        return tl.where((e == 15) & (m == 7), float("nan"), value)

    @triton.jit
    def _fp8_tile(acc, X, W, S, rows, rmask, n, nmask, k0, K, bn, bk, e_w, e_s,
                  s_xm, s_xk, s_wn, s_wk, s_sn, s_sk,
                  SCALE_AFTER: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, BYTES: tl.constexpr):
        """acc += x[rows, k0:k0+BLOCK_K] @ W[n, k0:k0+BLOCK_K]^T for one e4m3 weight tile and its scales (BYTES:
        W is the weight's bytes, decoded here)."""
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(X + rows[:, None] * s_xm + k[None, :] * s_xk, mask=rmask[:, None] & kmask[None, :], other=0.0)
        at, wmask = W + e_w + n[:, None] * s_wn + k[None, :] * s_wk, nmask[:, None] & kmask[None, :]
        if BYTES:
            w = _e4m3(tl.load(at, mask=wmask, other=0))
        else:
            w = tl.load(at, mask=wmask, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
        w = w.to(x.dtype)  # e4m3 is exact in fp16, bf16 and fp32
        if SCALE_AFTER:  # the tile lies inside one K block: scale the partial product per column
            s = tl.load(S + e_s + (n // bn) * s_sn + (k0 // bk) * s_sk, mask=nmask, other=0.0)
            if DOT_F32:
                part = tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w))
            acc += part * s[None, :]
        else:  # the tile spans K blocks: scale each weight element first
            s = tl.load(S + e_s + (n // bn)[:, None] * s_sn + (k // bk)[None, :] * s_sk,
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            if DOT_F32:
                acc = tl.dot(x, tl.trans(w * s), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans((w.to(tl.float32) * s).to(x.dtype)), acc)
        return acc

    @triton.jit
    def _fp8_kernel(X, W, S, B, O, M, N, K, K_SPLIT, bn, bk,
                    s_xm, s_xk, s_wn, s_wk, s_sn, s_sk, s_os, s_om, s_on,
                    HAS_BIAS: tl.constexpr, SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, BYTES: tl.constexpr,
                    PDL: tl.constexpr = False):
        """Program (i, j, s): output tile (i, j) over K's s-th share, written to partial s (as the MXFP4 kernel)."""
        enter(PDL)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rmask, nmask = rows < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(split * K_SPLIT, tl.minimum(K, (split + 1) * K_SPLIT), BLOCK_K):
            acc = _fp8_tile(acc, X, W, S, rows, rmask, n, nmask, k0, K, bn, bk, 0, 0,
                            s_xm, s_xk, s_wn, s_wk, s_sn, s_sk, SCALE_AFTER, BLOCK_K, DOT_F32, BYTES)
        if HAS_BIAS:
            if split == 0:
                acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(O + split * s_os + rows[:, None] * s_om + n[None, :] * s_on, acc,
                 mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _fp8_grouped_kernel(X, TE, TR, TEND, W, S, O, N, K, bn, bk,
                            s_xm, s_xk, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_om, s_on,
                            SCALE_AFTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, BYTES: tl.constexpr,
                            PDL: tl.constexpr = False):
        """Program (t, j): the t-th row tile over all experts (from the tile map) against expert e's e4m3
        W [N, K]; a t past the last tile does nothing."""
        enter(PDL)
        e_safe, rows, rmask, n, nmask, k_end = _grouped_tile(TE, TR, TEND, N, K, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            acc = _fp8_tile(acc, X, W, S, rows, rmask, n, nmask, k0, K, bn, bk, e_safe * s_we, e_safe * s_se,
                            s_xm, s_xk, s_wn, s_wk, s_sn, s_sk, SCALE_AFTER, BLOCK_K, DOT_F32, BYTES)
        tl.store(O + rows[:, None] * s_om + n[None, :] * s_on, acc, mask=rmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class Tiles:
    """One launch's tiling: output tiles of block_m x block_n, K walked block_k at a time, split over
    split_k programs a tile (fp32 partials summed after), and the kernel's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


# (block_m, block_n, block_k, warps, stages) by regime of rows, per GPU generation (compute capability
# major; 0: any other). Chosen, not yet timed: bench_quant.py times them (docs/kernels.md).
TILE_TABLE = {
    0: {"decode": (16, 64, 128, 4, 3), "mid": (64, 64, 64, 4, 3), "prefill": (128, 64, 64, 4, 3)},
    9: {"decode": (16, 64, 128, 4, 4), "mid": (64, 128, 64, 4, 3), "prefill": (128, 128, 64, 8, 3)},
}
SMS_DEFAULT = 132  # an H100's SMs: the split-K target where the device cannot be asked (the interpreter)


def regime(m: int) -> str:
    return "decode" if m <= 16 else "mid" if m <= 128 else "prefill"


def _device_facts(device) -> tuple[int, int]:
    """(compute capability major, SM count) of a CUDA device; (0, SMS_DEFAULT) elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0, SMS_DEFAULT
    props = torch.cuda.get_device_properties(device)
    return props.major, props.multi_processor_count


def split_k(tiles_mn: int, k: int, block_k: int, sms: int) -> int:
    """Programs a tile's K is split over: enough that the launch has about two programs an SM, each
    walking at least four K tiles (fewer is all partial-sum traffic); 1 where the tiles fill the GPU."""
    if tiles_mn >= sms:
        return 1
    return max(1, min(cdiv(2 * sms, tiles_mn), cdiv(k, block_k) // 4))


def tiles(m: int, n: int, k: int, k_unit: int, device, grouped: bool = False) -> Tiles:
    """The tiling of an [m, k] x [k, n] packed GEMM on `device`: the table's entry for its GPU generation
    and row regime, block_k at least the format's unit (32 for MXFP4), split-K where the output tiles do
    not fill the GPU (dense GEMMs at decode; the grouped ones' row tiles already spread over experts).
    Under the interpreter: small tiles (speed), no split, unless a test passes its own Tiles."""
    if interpreting():
        return Tiles(16, 16, max(32, k_unit))
    return gpu_tiles(m, n, k, k_unit, *_device_facts(device), grouped=grouped)


def gpu_tiles(m: int, n: int, k: int, k_unit: int, major: int, sms: int, grouped: bool = False) -> Tiles:
    """`tiles` on a GPU of compute capability `major` with `sms` SMs (a pure function: tests ask it for
    the GPUs they do not have)."""
    bm, bn, bk, warps, stages = TILE_TABLE.get(major, TILE_TABLE[0])[regime(m)]
    bk = max(bk, k_unit)
    splits = 1 if grouped else split_k(cdiv(m, bm) * cdiv(n, bn), k, bk, sms)
    return Tiles(bm, bn, bk, splits, warps, stages)


def _k_share(k: int, cfg: Tiles) -> int:
    """K per split: whole K tiles, the splits covering K."""
    return cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


def _out(m, n, x):
    """The output buffer, fp32 for bf16 under the interpreter: it truncates fp32 -> bf16 on store
    where a GPU rounds to nearest, so the rounding happens in torch there (:func:`_done`)."""
    dtype = torch.float32 if interpreting() and x.dtype == torch.bfloat16 else x.dtype
    return torch.empty(m, n, device=x.device, dtype=dtype)


def _done(out, x):
    return out.to(x.dtype)


def _dot_f32(x):
    # fp32 inputs get an exact (ieee) dot; the interpreter's bf16 dot is wrong, so it gets fp32 too
    return x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16)


def _check_x(x, k, name):
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be [M, K={k}], got {list(x.shape)}")
    if not x.is_floating_point() or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: x must be fp32, fp16 or bf16, got {x.dtype}")


def _check_mxfp4(blocks, scales, lead, name):
    """blocks [*lead, N, K/32, 16] uint8, scales [*lead, N, K/32] uint8; returns (N, K)."""
    nd = len(lead)
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != nd + 3
            or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1])
            or tuple(blocks.shape[:nd]) != tuple(lead)):
        raise ValueError(f"{name}: need uint8 blocks [{', '.join(map(str, lead)) + ', ' if lead else ''}N, K/32, 16] "
                         f"and scales of its first dims, got {blocks.dtype} {list(blocks.shape)}, "
                         f"{scales.dtype} {list(scales.shape)}")
    return blocks.shape[-3], blocks.shape[-2] * 32


def mxfp4_matmul_triton(x, blocks, scales, bias=None, cfg: Tiles | None = None):
    """``x @ W^T + bias`` for an MXFP4-packed W [N, K]: x [M, K] (fp32/fp16/bf16), blocks uint8
    [N, K/32, 16], scales uint8 [N, K/32], bias [N] or None. Returns [M, N] in x's dtype (fp32
    accumulation). `cfg`: the tiling (default `tiles` for the shape and device)."""
    n, k = _check_mxfp4(blocks, scales, (), "mxfp4_matmul")
    _check_x(x, k, "mxfp4_matmul")
    m = x.shape[0]
    if m == 0 or n == 0:
        return _done(_out(m, n, x), x)
    cfg = cfg or tiles(m, n, k, 32, x.device)
    out, parts = _outputs(m, n, x, cfg)
    b = bias if bias is not None else parts
    _mxfp4_kernel[(cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), cfg.split_k)](
        x, blocks, scales, b, parts, m, n, k, _k_share(k, cfg), *x.stride(), *blocks.stride(), *scales.stride(),
        *_part_strides(parts), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_F32=_dot_f32(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch(x))
    return _finish(out, parts, x, cfg)


def _outputs(m, n, x, cfg: Tiles):
    """(the output, the buffer the kernel writes): the output itself, or fp32 partials [split_k, M, N]."""
    out = _out(m, n, x)
    if cfg.split_k == 1:
        return out, out
    return out, torch.empty(cfg.split_k, m, n, device=x.device, dtype=torch.float32)


def _part_strides(parts):
    """(split, row, column) strides of the kernel's output buffer (a plain [M, N] output: split stride 0)."""
    return (parts.stride(0), *parts.stride()[1:]) if parts.dim() == 3 else (0, *parts.stride())


def _finish(out, parts, x, cfg: Tiles):
    if cfg.split_k > 1:
        torch.sum(parts, 0, out=out) if out.dtype == torch.float32 else out.copy_(parts.sum(0))
    return _done(out, x)


def _tile_map(offsets, e: int, m: int, block_m: int):
    """(tiles, expert [T], first row [T], end row [T]) of a grouped GEMM's row tiles, on the device, from
    one program that reads the offsets once (`_tile_map_kernel`); T an upper bound, a shape only."""
    t = cdiv(m, block_m) + min(e, m)
    dev = offsets.device
    te, tr, tend = (torch.empty(t, dtype=torch.int32, device=dev) for _ in range(3))
    _tile_map_kernel[(1,)](offsets, e, t, te, tr, tend, BLOCK_M=block_m, BLOCK_T=64, **launch(offsets))
    return t, te, tr, tend


def mxfp4_grouped_matmul_triton(x, offsets, blocks, scales, bias=None, cfg: Tiles | None = None):
    """The MoE expert GEMM: rows ``offsets[e]:offsets[e+1]`` of x [M, K] (sorted by expert) times
    expert e's MXFP4 W [N, K]^T, plus ``bias[e]``. offsets int [E+1] (on x's device, non-decreasing,
    offsets[E] <= M; rows past it are left unwritten), blocks [E, N, K/32, 16], scales [E, N, K/32],
    bias [E, N] or None. Returns [M, N] in x's dtype. Reads offsets on the device only (no sync)."""
    if blocks.dim() != 4:
        raise ValueError(f"mxfp4_grouped_matmul: blocks must be [E, N, K/32, 16], got {list(blocks.shape)}")
    e = blocks.shape[0]
    n, k = _check_mxfp4(blocks, scales, (e,), "mxfp4_grouped_matmul")
    _check_x(x, k, "mxfp4_grouped_matmul")
    _check_offsets(offsets, e, "mxfp4_grouped_matmul")
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"mxfp4_grouped_matmul: bias must be [E, N]=[{e}, {n}], got {list(bias.shape)}")
    m = x.shape[0]
    out = _out(m, n, x)
    if m == 0 or n == 0 or e == 0:
        return _done(out, x)
    cfg = cfg or tiles(max(1, m // max(1, e)), n, k, 32, x.device, grouped=True)
    off = offsets.to(device=x.device, dtype=torch.int32)
    t, te, tr, tend = _tile_map(off, e, m, cfg.block_m)
    b = bias if bias is not None else out
    s_be = bias.stride(0) if bias is not None else 0
    if bias is not None and bias.stride(1) != 1:
        b = bias.contiguous()
        s_be = b.stride(0)
    _mxfp4_grouped_kernel[(t, cdiv(n, cfg.block_n))](
        x, te, tr, tend, blocks, scales, b, out, n, k, *x.stride(), *blocks.stride(), *scales.stride(), s_be,
        *out.stride(), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_F32=_dot_f32(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch(x))
    return _done(out, x)


def _check_offsets(offsets, e, name):
    if offsets.dim() != 1 or offsets.numel() != e + 1 or offsets.is_floating_point():
        raise ValueError(f"{name}: offsets must be an int tensor [E+1]=[{e + 1}], "
                         f"got {offsets.dtype} {list(offsets.shape)}")


FP8_BYTES: bool | None = None  # read FP8 weights as bytes (True), as e4m3 (False), or by the GPU (None)


def fp8_bytes(device) -> bool:
    """Whether the FP8 kernels read the weight's bytes and decode them (`_e4m3`): on a GPU before sm_89,
    whose Triton has no e4m3 type; FP8_BYTES, where set, decides (the tests run both under the interpreter)."""
    if FP8_BYTES is not None:
        return FP8_BYTES
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def _fp8_k_tile(cfg: Tiles, bk_s: int, k: int, m: int, n: int, device) -> Tiles:
    """The K tile inside one scale block where the block allows it (the scale then multiplies the partial
    product, not every weight), the split recomputed for that tile."""
    if not (bk_s % cfg.block_k and bk_s % 32 == 0 and not interpreting()):
        return cfg
    splits = cfg.split_k
    if splits > 1:
        splits = split_k(cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), k, 32, _device_facts(device)[1])
    return Tiles(cfg.block_m, cfg.block_n, 32, splits, cfg.num_warps, cfg.num_stages)


def fp8_grouped_matmul_triton(x, offsets, weight, scale_inv, block, cfg: Tiles | None = None):
    """The MoE expert GEMM for block-scaled FP8 experts: rows ``offsets[e]:offsets[e+1]`` of x [M, K]
    (sorted by expert) times expert e's W [N, K]^T; weight float8_e4m3fn [E, N, K], scale_inv
    [E, ceil(N/bn), ceil(K/bk)]. Rows past offsets[E] are left unwritten. Returns [M, N] in x's
    dtype. Reads offsets on the device only (no sync)."""
    bn_s, bk_s = (int(v) for v in block)
    if weight.dim() != 3 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_grouped_matmul: weight must be float8_e4m3fn [E, N, K], got {weight.dtype} "
                         f"{list(weight.shape)}")
    e, n, k = weight.shape
    if bn_s < 1 or bk_s < 1 or tuple(scale_inv.shape) != (e, cdiv(n, bn_s), cdiv(k, bk_s)):
        raise ValueError(f"fp8_grouped_matmul: weight {list(weight.shape)} with block {list(block)} needs scale_inv "
                         f"[{e}, {cdiv(n, max(bn_s, 1))}, {cdiv(k, max(bk_s, 1))}], got {list(scale_inv.shape)}")
    _check_x(x, k, "fp8_grouped_matmul")
    _check_offsets(offsets, e, "fp8_grouped_matmul")
    m = x.shape[0]
    out = _out(m, n, x)
    if m == 0 or n == 0 or e == 0:
        return _done(out, x)
    cfg = _fp8_k_tile(cfg or tiles(max(1, m // max(1, e)), n, k, 16, x.device, grouped=True), bk_s, k, m, n, x.device)
    s = scale_inv.float()
    off = offsets.to(device=x.device, dtype=torch.int32)
    t, te, tr, tend = _tile_map(off, e, m, cfg.block_m)
    raw = fp8_bytes(x.device)
    _fp8_grouped_kernel[(t, cdiv(n, cfg.block_n))](
        x, te, tr, tend, weight.view(torch.uint8) if raw else weight, s, out, n, k, bn_s, bk_s, *x.stride(),
        *weight.stride(), *s.stride(), *out.stride(), SCALE_AFTER=bk_s % cfg.block_k == 0, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_F32=_dot_f32(x), BYTES=raw, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch(x))
    return _done(out, x)


def fp8_matmul_triton(x, weight, scale_inv, block, bias=None, cfg: Tiles | None = None):
    """``x @ W^T + bias`` for a block-scaled FP8 W: weight float8_e4m3fn [N, K], scale_inv fp32
    [ceil(N/bn), ceil(K/bk)] (W = weight * scale_inv of its block), block = (bn, bk). Ragged N and K
    are partial edge blocks. Returns [M, N] in x's dtype (fp32 accumulation)."""
    bn_s, bk_s = (int(v) for v in block)
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_matmul: weight must be float8_e4m3fn [N, K], got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    if bn_s < 1 or bk_s < 1 or tuple(scale_inv.shape) != (cdiv(n, bn_s), cdiv(k, bk_s)):
        raise ValueError(f"fp8_matmul: weight {list(weight.shape)} with block {list(block)} needs scale_inv "
                         f"[{cdiv(n, max(bn_s, 1))}, {cdiv(k, max(bk_s, 1))}], got {list(scale_inv.shape)}")
    _check_x(x, k, "fp8_matmul")
    m = x.shape[0]
    if m == 0 or n == 0:
        return _done(_out(m, n, x), x)
    cfg = _fp8_k_tile(cfg or tiles(m, n, k, 16, x.device), bk_s, k, m, n, x.device)
    out, parts = _outputs(m, n, x, cfg)
    s = scale_inv.float()
    b = bias if bias is not None else parts
    raw = fp8_bytes(x.device)
    _fp8_kernel[(cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), cfg.split_k)](
        x, weight.view(torch.uint8) if raw else weight, s, b, parts, m, n, k, _k_share(k, cfg), bn_s, bk_s,
        *x.stride(), *weight.stride(), *s.stride(), *_part_strides(parts), HAS_BIAS=bias is not None,
        SCALE_AFTER=bk_s % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_F32=_dot_f32(x), BYTES=raw, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch(x))
    return _finish(out, parts, x, cfg)
