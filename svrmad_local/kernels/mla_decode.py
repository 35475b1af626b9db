"""Decode attention of multi-head latent attention (DeepSeek-V2/V3 MLA) in its absorbed form, read in
place from the paged latent cache.

With W_UK folded into the query (q_lat = q_nope @ W_UK, done by the caller), every head attends to the
same cached rows: the normalised KV latent c [C = kv_lora_rank] and the shared roped key k_rot [R]. It is
multi-query attention with a (C + R)-wide key and c itself as the value:
    score = (q_lat . c + q_rot . k_rot) * scale,  out_lat = softmax(score) @ c   [H, C]
and the caller applies W_UV per head afterwards. One read of the latent serves all heads, instead of
expanding every cached token through kv_b_proj at every step.

Shapes: q_lat [N, H, C], q_rot [N, H, R] (one decode query per row); c_cache [S, C] and kr_cache [S, R]
(flat slots, S = blocks * block_size; a singleton head dim [S, 1, C] is accepted); block_table [N, W]
block ids (padding ignored); lens [N] the context length of each row, its own token included. Returns
out_lat [N, H, C] fp32.

The Triton path splits the context (grid: head tiles x rows x splits, the head tiles of one split
adjacent, so the second reads the latent chunk the first brought into L2) and merges the splits with
torch ops. A program takes up to 64 heads (`MAX_BLOCK_H`: a [64, 512] fp32 accumulator), so at DeepSeek's
128 heads each split's latent is read twice (once per tile), at a tensor-parallel rank's 16 once. The
split count (`plan`) aims at two programs an SM, each split long enough that the fp32 partial outputs it
writes and the merge reads stay under half the latent bytes it reads; it depends on shapes only (the
table's width, rows, heads), never on `lens` (values), so no call waits for the GPU: it can be captured
in a CUDA graph.
"""
from __future__ import annotations

import torch

from ._attn_tiles import softmax_update
from ._backend import HAS_TRITON, cdiv, fall_back, interpreting, next_pow2, resolve_impl, tl, triton
from .pdl import launch

LOG2E = 1.4426950408889634


def mla_decode(q_lat, q_rot, c_cache, kr_cache, block_table, lens, block_size: int, scale: float, *,
               kernel_impl: str = "auto", block_h: int | None = None, splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode attention over the paged latent cache; [N, H, C] fp32 (see the module doc).
    `block_h`, `splits`: the Triton path's heads a program and context splits (default: `plan`)."""
    c2, kr2 = c_cache.reshape(c_cache.shape[0], -1), kr_cache.reshape(kr_cache.shape[0], -1)
    _check(q_lat, q_rot, c2, kr2, block_table, lens)
    impl = resolve_impl(kernel_impl, q_lat.device, "mla_decode")
    if impl == "triton" and q_lat.shape[0]:
        try:
            return _mla_triton(q_lat, q_rot, c2, kr2, block_table, lens, block_size, scale, block_h, splits)
        except Exception as e:  # noqa: BLE001 - a kernel problem degrades speed under "auto", not the run
            fall_back("mla_decode", e, kernel_impl)
    return reference_mla_decode(q_lat, q_rot, c2, kr2, block_table, lens, block_size, scale)


def reference_mla_decode(q_lat, q_rot, c_cache, kr_cache, block_table, lens, block_size: int, scale: float):
    """The torch reference: a padded gather of every row's context (block table width x block_size
    tokens), fp32 scores and softmax, positions at or past `lens` masked."""
    c_cache, kr_cache = c_cache.reshape(c_cache.shape[0], -1), kr_cache.reshape(kr_cache.shape[0], -1)
    dev = q_lat.device
    pos = torch.arange(block_table.shape[1] * block_size, device=dev)
    slots = block_table.long()[:, pos // block_size] * block_size + pos % block_size  # [N, L]
    past = pos[None, :] >= lens.to(dev).long()[:, None]  # [N, L]: slots no token has written yet
    c = c_cache[slots].float().masked_fill(past[..., None], 0.0)  # [N, L, C]; never-written rows may hold
    kr = kr_cache[slots].float()  # NaN, and a zero softmax weight times NaN is still NaN
    s = (q_lat.float() @ c.transpose(1, 2) + q_rot.float() @ kr.transpose(1, 2)) * scale  # [N, H, L]
    s = s.masked_fill(past[:, None, :], float("-inf"))
    return torch.softmax(s, -1) @ c


def _check(q_lat, q_rot, c_cache, kr_cache, block_table, lens) -> None:
    n, h, c = q_lat.shape
    if q_rot.shape[:2] != (n, h) or q_rot.shape[2] != kr_cache.shape[1] or c_cache.shape[1] != c:
        raise ValueError(f"mla_decode: q_lat {tuple(q_lat.shape)}, q_rot {tuple(q_rot.shape)}, latent cache "
                         f"{tuple(c_cache.shape)} and rope cache {tuple(kr_cache.shape)} disagree")
    if block_table.dim() != 2 or block_table.shape[0] != n or lens.shape != (n,):
        raise ValueError(f"mla_decode: block_table {tuple(block_table.shape)} and lens {tuple(lens.shape)} must be "
                         f"[{n}, W] and [{n}]")


# ----------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:
    from .pdl import enter

    @triton.jit
    def _mla_decode_kernel(
        QL, QR, C, KR, BT, LENS, O, LSE,
        qk_scale, chunk, H, CD, RD,
        s_qln, s_qlh, s_qrn, s_qrh, s_c, s_kr, s_bt,
        BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program: a tile of heads of one row x one chunk of its context; online softmax in the
        exp2 domain, writing the chunk's normalised output and its lse (natural log; -inf for an
        empty chunk). Every tile of latent rows is loaded once for the BLOCK_H heads."""
        enter(PDL)
        hb = tl.program_id(0)
        n = tl.program_id(1)
        split = tl.program_id(2)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        cc = tl.arange(0, BLOCK_C)
        cmask = cc < CD
        rr = tl.arange(0, BLOCK_R)
        rmask = rr < RD
        ql = tl.load(QL + n * s_qln + heads[:, None] * s_qlh + cc[None, :], mask=hmask[:, None] & cmask[None, :],
                     other=0.0)
        qr = tl.load(QR + n * s_qrn + heads[:, None] * s_qrh + rr[None, :], mask=hmask[:, None] & rmask[None, :],
                     other=0.0)
        if DOT_F32:
            ql = ql.to(tl.float32)
            qr = qr.to(tl.float32)
        kv_len = tl.load(LENS + n)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_len)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            pos = t0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            blk = tl.load(BT + n * s_bt + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
            c = tl.load(C + slot[:, None] * s_c + cc[None, :], mask=pmask[:, None] & cmask[None, :], other=0.0)
            kr = tl.load(KR + slot[:, None] * s_kr + rr[None, :], mask=pmask[:, None] & rmask[None, :], other=0.0)
            if DOT_F32:
                c = c.to(tl.float32)
                kr = kr.to(tl.float32)
                s = tl.dot(ql, tl.trans(c), input_precision="ieee")
                s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
            else:
                s = tl.dot(ql, tl.trans(c))
                s = tl.dot(qr, tl.trans(kr), s)
            m_i, l_i, acc = softmax_update(s * qk_scale, pmask[None, :], c, m_i, l_i, acc, DOT_F32)
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        row = (split * tl.num_programs(1) + n) * H + heads
        tl.store(O + row[:, None] * CD + cc[None, :], out, mask=hmask[:, None] & cmask[None, :])
        tl.store(LSE + row, lse, mask=hmask)


MAX_BLOCK_H = 64  # heads a program at most: its [BLOCK_H, kv_lora_rank] fp32 accumulator lives in registers
SMS_DEFAULT = 132  # an H100's SMs: the split target where the device cannot be asked (the interpreter)


def plan(rows: int, heads: int, max_len: int, c_dim: int, r_dim: int, item: int, block_n: int,
         sms: int = SMS_DEFAULT, block_h: int | None = None, splits: int | None = None) -> tuple[int, int, int]:
    """(heads a program, number of splits, tokens a split) for `rows` decode queries of `heads` heads over
    tables of `max_len` tokens: up to MAX_BLOCK_H heads a program; splits toward two programs an SM, each
    at least `min_chunk` tokens, where its fp32 partial output (written, then read by the merge) is at
    most half the latent it reads. A shape-only choice: the same for every call at this table width."""
    block_h = block_h or min(MAX_BLOCK_H, max(16, next_pow2(heads)))
    tiles = rows * cdiv(heads, block_h)
    min_chunk = cdiv(2 * 2 * heads * c_dim * 4, (c_dim + r_dim) * item)
    if splits is None:
        splits = max(1, min(cdiv(2 * sms, tiles), cdiv(max_len, max(block_n, min_chunk))))
    chunk = cdiv(cdiv(max_len, splits), block_n) * block_n
    return block_h, cdiv(max_len, chunk), chunk


def _mla_triton(q_lat, q_rot, c_cache, kr_cache, block_table, lens, block_size, scale, block_h=None, splits=None):
    n, h, cd = q_lat.shape
    rd = q_rot.shape[2]
    dev = q_lat.device
    block_n = 16 if interpreting() else 32
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else SMS_DEFAULT
    block_h, n_split, chunk = plan(n, h, block_table.shape[1] * block_size, cd, rd, c_cache.element_size(), block_n,
                                   sms, block_h or (16 if interpreting() else None), splits)
    o_part = torch.empty(n_split, n, h, cd, device=dev)
    l_part = torch.empty(n_split, n, h, device=dev)
    dt = c_cache.dtype
    ql, qr = q_lat.to(dt).contiguous(), q_rot.to(dt).contiguous()
    # fp32 caches take an exact ieee dot; bf16 under the interpreter too (its bf16 dot is wrong)
    dot_f32 = dt == torch.float32 or (interpreting() and dt == torch.bfloat16)
    _mla_decode_kernel[(cdiv(h, block_h), n, n_split)](
        ql, qr, c_cache, kr_cache, block_table, lens, o_part, l_part,
        scale * LOG2E, chunk, h, cd, rd,
        ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1), c_cache.stride(0), kr_cache.stride(0),
        block_table.stride(0),
        BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_C=max(16, next_pow2(cd)),
        BLOCK_R=max(16, next_pow2(rd)), DOT_F32=dot_f32,
        num_warps=4 if interpreting() or cd * block_h < 256 * 16 else 8,  # a [BLOCK_H, C] fp32 accumulator
        **launch(ql),
    )
    if n_split == 1:
        return o_part[0]
    w = torch.softmax(l_part, 0)  # split 0 is never empty (lens >= 1), so no row is all -inf
    return (o_part * w.unsqueeze(-1)).sum(0)
