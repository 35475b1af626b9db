"""Shared-prefix (cascade) attention over a paged KV cache (Hydragen / FlashInfer cascade).

In a debate many queries (agents, receivers) attend to the same long prefix (the question, a
receiver's history). A normal paged-attention kernel reads that prefix once *per query*: memory
bound matrix-vector work. Here a KV run shared by several queries is attended once for all of them
as one matrix-matrix product (all queries x all GQA heads of a KV head stacked as rows), producing
a partial result ``(out, lse)`` per query; partials over the different runs a query sees are then
combined exactly by a log-sum-exp merge:

    softmax attention over the union of disjoint key sets A and B =
        out = (e^{lse_a} out_a + e^{lse_b} out_b) / (e^{lse_a} + e^{lse_b}),
        lse = log(e^{lse_a} + e^{lse_b})

(``lse`` = natural-log log-sum-exp of the scaled scores, ``out`` = that run's normalised output).

Cache layout (the engine's): ``k_cache``/``v_cache`` [num_blocks, block_size, num_kv_heads,
head_dim]; a run is a block table (block ids, any order) plus a token count.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ._backend import HAS_TRITON, cdiv, disable_auto, interpreting, next_pow2, resolve_impl, tl, triton


class Level(NamedTuple):
    """A KV run (``block_table`` ids, first ``kv_len`` tokens) visible, unmasked, to the queries
    ``query_idx`` (indices into the cascade's q). Each query may appear at most once per level."""

    query_idx: torch.Tensor
    block_table: torch.Tensor
    kv_len: int


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def attend_partial(q, k_cache, v_cache, block_table, kv_len: int, scale: float, *, impl: str = "auto",
                   num_splits: int | None = None):
    """All ``q`` [Nq, Hq, D] attend (no mask) to the first ``kv_len`` tokens of one paged run.

    Returns ``(out [Nq, Hq, D] fp32, lse [Nq, Hq] fp32)``; kv_len 0 gives out 0 and lse -inf, so
    the result merges as "nothing". ``num_splits`` (triton) splits the run along its length for
    parallelism (flash-decoding); None chooses from the GPU size.
    """
    kv_len = int(kv_len)
    _check(q, k_cache, v_cache, block_table, kv_len)
    if resolve_impl(impl, q.device, "attend_partial") == "triton":
        try:
            idx = torch.arange(q.shape[0], device=q.device)
            return _cascade_triton(q, k_cache, v_cache, [Level(idx, block_table, kv_len)], scale, num_splits)
        except Exception as err:
            if impl != "auto":
                raise
            disable_auto("attend_partial", err)
    return _attend_partial_torch(q, k_cache, v_cache, block_table, kv_len, scale)


def merge_states(out_a, lse_a, out_b, lse_b, *, impl: str = "auto"):
    """Exact merge of two partial attention results over disjoint key sets.

    out_* [N, H, D], lse_* [N, H] (natural log). Either side may be empty (lse -inf); both empty
    gives out 0, lse -inf. Returns fp32 ``(out, lse)``.
    """
    if resolve_impl(impl, out_a.device, "merge_states") == "triton":
        try:
            return _merge_triton(out_a, lse_a, out_b, lse_b)
        except Exception as err:
            if impl != "auto":
                raise
            disable_auto("merge_states", err)
    return _merge_torch(out_a, lse_a, out_b, lse_b)


def cascade_attention(q, k_cache, v_cache, levels: Sequence[Level], scale: float, *, impl: str = "auto",
                      num_splits: int | None = None, return_lse: bool = False):
    """Attention of q [Nq, Hq, D] over the union of the levels that list each query.

    Typical debate use: level 0 = question prefix (all queries), level 1 = a receiver's history
    (a subgroup), then one level per query holding its own suffix (a decode query's suffix
    includes its current token). Returns out [Nq, Hq, D] in q's dtype (plus fp32 lse [Nq, Hq] with
    ``return_lse``); a query listed by no level gets 0. The triton path runs every level in one
    launch and merges all partials with one scatter log-sum-exp; the torch path is the plain
    loop "attend_partial per level, merge_states into the running result".
    """
    for lv in levels:
        _check(q, k_cache, v_cache, lv.block_table, int(lv.kv_len))
    out = lse = None
    if resolve_impl(impl, q.device, "cascade_attention") == "triton":
        try:
            out, lse = _cascade_triton(q, k_cache, v_cache, levels, scale, num_splits)
        except Exception as err:
            if impl != "auto":
                raise
            disable_auto("cascade_attention", err)
    if out is None:
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        for lv in levels:
            idx = lv.query_idx.to(q.device).long()
            if idx.numel() == 0:
                continue
            o, l = _attend_partial_torch(q[idx], k_cache, v_cache, lv.block_table, int(lv.kv_len), scale)
            out[idx], lse[idx] = _merge_torch(out[idx], lse[idx], o, l)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def reference_attention(q_i, k_full, v_full, scale: float | None = None):
    """Naive attention for tests: q_i [..., Hq, D] against a plain (prefix copied) k/v
    [L, Hkv, D]; GQA by repeating KV heads. Returns fp32 [..., Hq, D]."""
    hq, hkv = q_i.shape[-2], k_full.shape[1]
    scale = 1.0 / math.sqrt(q_i.shape[-1]) if scale is None else scale
    k = k_full.float().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
    v = v_full.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("...hd,lhd->...hl", q_i.float(), k) * scale
    return torch.einsum("...hl,lhd->...hd", torch.softmax(scores, dim=-1), v)


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------

def _check(q, k_cache, v_cache, block_table, kv_len):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("need q [Nq,Hq,D] and k/v caches [blocks, block_size, Hkv, D]")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head dim mismatch or Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}")
    if not 0 <= kv_len <= block_table.numel() * k_cache.shape[1]:
        raise ValueError(f"kv_len={kv_len} exceeds the {block_table.numel()} blocks of the table")


def _gather_run(cache, block_table, kv_len):
    """[kv_len, Hkv, D] tokens of one run (a copy: the torch path reads the run once)."""
    nb = cdiv(kv_len, cache.shape[1])
    blocks = cache[block_table[:nb].to(cache.device).long()]
    return blocks.reshape(-1, *cache.shape[2:])[:kv_len]


def _attend_partial_torch(q, k_cache, v_cache, block_table, kv_len, scale):
    nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    if kv_len == 0 or nq == 0:
        return (q.new_zeros((nq, hq, d), dtype=torch.float32),
                q.new_full((nq, hq), float("-inf"), dtype=torch.float32))
    k = _gather_run(k_cache, block_table, kv_len).float()  # [L, Hkv, D]
    v = _gather_run(v_cache, block_table, kv_len).float()
    # Stack every query and every GQA head of a KV head as rows: one [Nq*G, D] x [D, L] product.
    qg = q.float().reshape(nq, hkv, hq // hkv, d)
    scores = torch.einsum("nkgd,lkd->kngl", qg, k) * scale  # [Hkv, Nq, G, L]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("kngl,lkd->nkgd", torch.exp(scores - lse[..., None]), v)
    return out.reshape(nq, hq, d), lse.permute(1, 0, 2).reshape(nq, hq)


def _merge_torch(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b).float()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both -inf: avoid (-inf) - (-inf)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)  # exp(-inf) = 0 for an empty side
    den = wa + wb
    out = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / den.clamp_min(1e-30)[..., None]
    return out, m + torch.log(den)  # log(0) = -inf when both sides are empty


def _merge_indexed(out_e, lse_e, query_of_e, nq):
    """Merge many partials at once: entry e [E, H, D]/[E, H] belongs to query ``query_of_e[e]``."""
    h = lse_e.shape[1]
    idx = query_of_e[:, None].expand(-1, h)
    m = lse_e.new_full((nq, h), float("-inf")).scatter_reduce(0, idx, lse_e, "amax")
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_e - m[query_of_e])
    den = lse_e.new_zeros((nq, h)).index_add_(0, query_of_e, w)
    num = out_e.new_zeros((nq, h, out_e.shape[2])).index_add_(0, query_of_e, w[..., None] * out_e)
    return num / den.clamp_min(1e-30)[..., None], m + torch.log(den)


# ----------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _cascade_kernel(
        Q, K, V, BT, LENS, N_ENT, ENT0, ENT_Q, ITEMS, O, LSE,
        qk_scale, chunk, n_entries, hq,
        s_qn, s_qh, s_qd, s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd, s_bt,
        BLOCK_SIZE: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """One program: a block of (query, GQA head) rows of one level x one KV head x one chunk of
        that level's run. Flash-attention online softmax over the chunk, writing the chunk's
        normalised output and lse (exp2 domain inside, natural log out)."""
        item = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        level = tl.load(ITEMS + 2 * item)
        row0 = tl.load(ITEMS + 2 * item + 1)
        kv_len = tl.load(LENS + level)
        n_rows = tl.load(N_ENT + level) * G
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < n_rows
        entry = tl.load(ENT0 + level) + rows // G
        head = kvh * G + rows % G
        qn = tl.load(ENT_Q + entry, mask=rmask, other=0)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(Q + qn[:, None] * s_qn + head[:, None] * s_qh + d[None, :] * s_qd,
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            pos = t0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            blk = tl.load(BT + level * s_bt + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
            off = pos % BLOCK_SIZE
            kv_mask = pmask[:, None] & dmask[None, :]
            k = tl.load(K + blk[:, None] * s_kb + off[:, None] * s_kt + kvh * s_kh + d[None, :] * s_kd,
                        mask=kv_mask, other=0.0)
            v = tl.load(V + blk[:, None] * s_vb + off[:, None] * s_vt + kvh * s_vh + d[None, :] * s_vd,
                        mask=kv_mask, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale  # log2 domain
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        has = l_i > 0.0  # false for an empty chunk (run shorter than this split)
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        o_row = (split * n_entries + entry) * hq + head
        tl.store(O + o_row[:, None] * D + d[None, :], out, mask=rmask[:, None] & dmask[None, :])
        tl.store(LSE + o_row, lse, mask=rmask)

    @triton.jit
    def _merge_kernel(OA, LA, OB, LB, O, L, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        d = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d < D)[None, :]
        la = tl.load(LA + rows, mask=rmask, other=float("-inf"))
        lb = tl.load(LB + rows, mask=rmask, other=float("-inf"))
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        den = wa + wb
        oa = tl.load(OA + rows[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        ob = tl.load(OB + rows[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        out = (wa[:, None] * oa + wb[:, None] * ob) / tl.maximum(den, 1e-30)[:, None]
        tl.store(O + rows[:, None] * D + d[None, :], out, mask=mask)
        lse = tl.where(den > 0.0, m + tl.log(tl.maximum(den, 1e-30)), float("-inf"))
        tl.store(L + rows, lse, mask=rmask)


def _merge_triton(out_a, lse_a, out_b, lse_b):
    n, h, d = out_a.shape
    oa, ob = out_a.contiguous(), out_b.contiguous()
    la, lb = lse_a.float().contiguous(), lse_b.float().contiguous()
    out = torch.empty(n, h, d, device=out_a.device)
    lse = torch.empty(n, h, device=out_a.device)
    block_r = 16
    if n * h:
        _merge_kernel[(cdiv(n * h, block_r),)](oa, la, ob, lb, out, lse, n * h, d,
                                              BLOCK_R=block_r, BLOCK_D=max(16, next_pow2(d)))
    return out, lse


def _cascade_triton(q, k_cache, v_cache, levels, scale, num_splits):
    nq, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    g = hq // hkv
    dev = q.device
    levels = [lv for lv in levels if lv.query_idx.numel()]
    out = torch.zeros(nq, hq, d, device=dev)
    lse = torch.full((nq, hq), float("-inf"), device=dev)
    if not levels or nq == 0:
        return out, lse
    interp = interpreting()
    block_m, block_n = (16, 16) if interp else (64, 64)
    # Host-side bookkeeping: padded block tables, entries (level, query) and row-block work items.
    lens = [int(lv.kv_len) for lv in levels]
    tables = [lv.block_table[:max(1, cdiv(n, block_size))].long() for lv, n in zip(levels, lens)]
    bt = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device=dev, dtype=torch.int32)
    n_ent, ent0, items, start = [], [], [], 0
    for i, lv in enumerate(levels):
        n = lv.query_idx.numel()
        n_ent.append(n)
        ent0.append(start)
        items += [(i, r) for r in range(0, n * g, block_m)]
        start += n
    ent_q = torch.cat([lv.query_idx.to(dev).long() for lv in levels])
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    max_len = max(lens)
    if num_splits is None:  # enough programs to fill the GPU (flash-decoding for long prefixes)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        num_splits = min(cdiv(2 * sms, len(items) * hkv), cdiv(max_len, 512))
    chunk = cdiv(cdiv(max(max_len, 1), max(1, num_splits)), block_n) * block_n
    n_split = max(1, cdiv(max_len, chunk))
    n_e = ent_q.numel()
    o_part = torch.empty(n_split, n_e, hq, d, device=dev)
    l_part = torch.empty(n_split, n_e, hq, device=dev)
    # fp32 inputs (exact ieee dot), mixed dtypes, or bf16 under the interpreter (its bf16 dot is wrong)
    dot_f32 = q.dtype == torch.float32 or q.dtype != k_cache.dtype or (interp and q.dtype == torch.bfloat16)
    _cascade_kernel[(len(items), hkv, n_split)](
        q, k_cache, v_cache, bt, as_t(lens), as_t(n_ent), as_t(ent0), ent_q, as_t(items), o_part, l_part,
        scale * 1.4426950408889634, chunk, n_e, hq,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), bt.stride(0),
        BLOCK_SIZE=block_size, G=g, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(d)), DOT_F32=dot_f32,
    )
    return _merge_indexed(o_part.reshape(-1, hq, d), l_part.reshape(-1, hq), ent_q.repeat(n_split), nq)
