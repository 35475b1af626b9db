"""Prefill attention that reads K/V in place from the engine's paged cache (varlen, causal).

A step's prefill runs are chunks of new tokens, each continuing its sequence's cached context. The
engine's other GPU path gathers every run's whole context into a copy in every layer, then calls SDPA
with a mask; this one reads the cache slots through each run's block table, as flash-attn's varlen
call does with a paged cache, and needs flash-attn's 256-token pages nowhere.

Layout: ``q`` [T, H, D] holds the runs' new tokens back to back, run r owning rows
``cu_q[r] .. cu_q[r+1]``; its ``context_lens[r]`` keys (the new tokens' own K/V already written, last)
sit in the flat-slot caches (``k_cache`` [slots, Hkv, D], ``v_cache`` [slots, Hkv, Dv]) at
``block_table[r, p // block_size] * block_size + p % block_size``. Query i of a run of n rows is at
position ``L - n + i`` and sees keys p <= its position (and p > position - window with a sliding
window); sinks [H] (GPT-OSS) join every row's softmax denominator.

Triton path: program (tile, head) takes BLOCK_M query rows of one run (the tiles are laid out on the
host: prefill steps are never captured in a CUDA graph, their shapes vary by construction) and walks
only the keys its rows can see, from the window's start to its last row's position, with an online
softmax in the exp2 domain; the sink joins the denominator at the end. The torch path gathers each
run's context and runs one masked fp32 softmax: the reference, and the fallback.
"""
from __future__ import annotations

import torch

from ._attn_tiles import paged_scores, softmax_update
from ._backend import (HAS_TRITON, NUM_STAGES, fall_back, fit_attn_tiles, interpreting, next_pow2, resolve_impl,
                       smem_limit, staged, tl, triton)
from .pdl import launch
from .paged_decode import check_paged_call
from .prefix_attention import apply_sinks


def paged_prefill(q, k_cache, v_cache, block_table, cu_q, context_lens, block_size: int, scale: float,
                  window: int | None = None, sinks=None, kernel_impl: str = "auto"):
    """Causal attention of R prefill runs against their paged contexts. q [T, H, D]; block_table
    [R, max_blocks] int; cu_q [R + 1] int row offsets; context_lens [R] int, each at least its run's row
    count. Returns [T, H, Dv] in q's dtype. The Triton path lays out its tiles on the host, so cu_q and
    context_lens are host values: lists (what the engine passes, once per step), or tensors, which
    are read back here (a host sync on a GPU: for callers outside the engine)."""
    cu = [int(c) for c in (cu_q.tolist() if torch.is_tensor(cu_q) else cu_q)]
    lens = [int(n) for n in (context_lens.tolist() if torch.is_tensor(context_lens) else context_lens)]
    window = _check(q, k_cache, v_cache, block_table, cu, lens, block_size, window, sinks)
    if resolve_impl(kernel_impl, q.device, "paged_prefill") == "triton":
        try:
            return _paged_prefill_triton(q, k_cache, v_cache, block_table, cu, lens, block_size, scale, window,
                                         sinks)
        except Exception as err:
            fall_back("paged_prefill", err, kernel_impl)
    return reference_paged_prefill(q, k_cache, v_cache, block_table, cu, lens, block_size, scale, window, sinks)


def reference_paged_prefill(q, k_cache, v_cache, block_table, cu_q, context_lens, block_size, scale, window=None,
                            sinks=None):
    """The torch path: per run, its context gathered in order and one masked fp32 softmax."""
    h = q.shape[1]
    g = h // k_cache.shape[1]
    out = q.new_empty(q.shape[0], h, v_cache.shape[2])
    bt = block_table.to(q.device).long()
    for r in range(len(cu_q) - 1):
        r0, r1, n = cu_q[r], cu_q[r + 1], context_lens[r]
        if r1 == r0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = bt[r, pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(g, 1)  # [n, H, D]
        v = v_cache[slots].float().repeat_interleave(g, 1)
        qpos = torch.arange(n - (r1 - r0), n, device=q.device)
        visible = pos[None, :] <= qpos[:, None]
        if window is not None:
            visible &= pos[None, :] > qpos[:, None] - window
        s = torch.einsum("qhd,khd->hqk", q[r0:r1].float(), k) * scale
        s = s.masked_fill(~visible[None], float("-inf"))
        lse = torch.logsumexp(s, -1)  # [H, qn]: finite, every row sees its own key
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        if sinks is not None:
            o, _ = apply_sinks(o, lse.transpose(0, 1), sinks)
        out[r0:r1] = o.to(q.dtype)
    return out


def _check(q, k_cache, v_cache, block_table, cu, lens, block_size, window, sinks):
    runs = len(lens)
    window = check_paged_call("paged_prefill", "T", ("R", runs), q, k_cache, v_cache, block_table, block_size,
                              window, sinks)
    if len(cu) != runs + 1 or cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"paged_prefill: cu_q must be R+1={runs + 1} non-decreasing row offsets from 0 to "
                         f"T={q.shape[0]}, got {cu}")
    for r, n in enumerate(lens):
        if n < cu[r + 1] - cu[r] or n > block_table.shape[1] * block_size:
            raise ValueError(f"paged_prefill: run {r} has {cu[r + 1] - cu[r]} new rows and context_len {n}: "
                             f"the context must hold the rows and fit its {block_table.shape[1]} blocks")
    return window


# ----------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:
    from .pdl import enter

    @triton.jit
    def _prefill_kernel(
        Q, K, V, BT, TILES, SINKS, O, qk_scale, window,
        s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_btb, s_btp, s_ot, s_oh, s_od,
        BLOCK_SIZE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_F32: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Program (tile, head): rows [row0, row0 + m) of run `run`, whose first row sits at position
        pos0, against the keys they can see. TILES holds (run, row0, m, pos0) per tile."""
        enter(PDL)
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // G
        run = tl.load(TILES + tile * 4).to(tl.int64)
        row0 = tl.load(TILES + tile * 4 + 1)
        m = tl.load(TILES + tile * 4 + 2)
        pos0 = tl.load(TILES + tile * 4 + 3)
        i = tl.arange(0, BLOCK_M)
        imask = i < m
        qpos = pos0 + i
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        dv = tl.arange(0, BLOCK_DV)
        dvmask = dv < DV
        rows = (row0 + i).to(tl.int64)
        q = tl.load(Q + rows[:, None] * s_qt + head * s_qh + d[None, :] * s_qd,
                    mask=imask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        lo = 0
        if WINDOW:
            lo = tl.maximum(pos0 - window + 1, 0)
        hi = pos0 + m  # one past the last row's position
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            pos = t0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            s, v = paged_scores(q, K, V, BT, run * s_btb, pos, pmask, kvh, d, dmask, dv, dvmask, s_btp, s_kt, s_kh, s_kd,
                                s_vt, s_vh, s_vd, BLOCK_SIZE, DOT_F32)
            see = pmask[None, :] & (pos[None, :] <= qpos[:, None])
            if WINDOW:
                see = see & (pos[None, :] > qpos[:, None] - window)
            m_i, l_i, acc = softmax_update(s * qk_scale, see, v, m_i, l_i, acc, DOT_F32)
        den = l_i
        if HAS_SINKS:  # the sink's logit, natural log, joins the denominator in the exp2 domain
            sink = tl.load(SINKS + head).to(tl.float32) * 1.4426950408889634
            den += tl.exp2(sink - m_i)
        out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
        tl.store(O + rows[:, None] * s_ot + head * s_oh + dv[None, :] * s_od, out,
                 mask=imask[:, None] & dvmask[None, :])


_last_tiles: dict = {}  # the last layout built: every layer of a step asks for the same one


def _tiles(cu: list[int], lens: list[int], block_m: int, dev) -> torch.Tensor | None:
    """(run, row0, rows, pos0) per tile of at most block_m rows, int32 on `dev` (None: no rows), laid out
    on the host once per step and staged without blocking; later layers of the step reuse it."""
    key = (tuple(cu), tuple(lens), block_m, dev)
    if key in _last_tiles:
        return _last_tiles[key]
    tiles = []
    for r in range(len(lens)):
        n_rows = cu[r + 1] - cu[r]
        for i0 in range(0, n_rows, block_m):
            tiles.append((r, cu[r] + i0, min(block_m, n_rows - i0), lens[r] - n_rows + i0))
    _last_tiles.clear()
    _last_tiles[key] = staged(tiles, torch.int32, dev) if tiles else None
    return _last_tiles[key]


def _paged_prefill_triton(q, k_cache, v_cache, block_table, cu, lens, block_size, scale, window, sinks):
    t, h, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    dev = q.device
    dot_f32 = (q.dtype == torch.float32 or q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype
               or (interpreting() and q.dtype == torch.bfloat16))
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    block_m, block_n = (16, 16) if interpreting() else fit_attn_tiles(
        64, 64, block_d, block_dv, 4 if dot_f32 else q.element_size(), smem_limit(dev))
    tiles_t = _tiles(cu, lens, block_m, dev)
    # the interpreter truncates fp32 -> bf16 on store (a GPU rounds to nearest): store fp32 there
    out = torch.empty(t, h, dv, device=dev, dtype=torch.float32 if interpreting() and q.dtype == torch.bfloat16
                      else q.dtype)
    if tiles_t is None:
        return out.to(q.dtype)
    bt = block_table if block_table.device == dev else block_table.to(dev)
    _prefill_kernel[(tiles_t.shape[0], h)](
        q, k_cache, v_cache, bt, tiles_t, sinks if sinks is not None else tiles_t, out,
        scale * 1.4426950408889634, window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *bt.stride(), *out.stride(),
        BLOCK_SIZE=block_size, G=h // hkv, D=d, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, WINDOW=window is not None,
        HAS_SINKS=sinks is not None, DOT_F32=dot_f32, num_stages=NUM_STAGES, **launch(q))
    return out.to(q.dtype)
