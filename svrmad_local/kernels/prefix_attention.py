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

Sliding windows (Mistral, Gemma 3, GPT-OSS) mask keys per query row: a key at absolute position
``kv_start + t`` is visible to a query at ``q_pos`` iff ``kv_start + t > q_pos - window``. Attention
sinks (GPT-OSS) add one logit per head to the softmax denominator without a value; they are applied
once, after the merge, by :func:`apply_sinks`.
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple, Sequence

import torch

from ._attn_tiles import softmax_update
from ._backend import HAS_TRITON, cdiv, fall_back, interpreting, next_pow2, resolve_impl, tl, triton
from .pdl import launch


class Level(NamedTuple):
    """A KV run (``block_table`` ids, first ``kv_len`` tokens) visible to the queries
    ``query_idx`` (indices into the cascade's q), unmasked except by a sliding window. Each query
    may appear at most once per level. ``kv_start`` is the absolute position of the run's first
    token (a run covering blocks [a, b) of a sequence has ``kv_start = a * block_size``); only a
    window reads it."""

    query_idx: torch.Tensor
    block_table: torch.Tensor
    kv_len: int
    kv_start: int = 0


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def attend_partial(q, k_cache, v_cache, block_table, kv_len: int, scale: float, *, kv_start: int = 0,
                   q_pos=None, window: int | None = None, kernel_impl: str = "auto", num_splits: int | None = None):
    """All ``q`` [Nq, Hq, D] attend to the first ``kv_len`` tokens of one paged run.

    Without ``window`` there is no mask. With ``window`` W and ``q_pos`` [Nq] (each query's
    absolute position), token t of the run (absolute position ``kv_start + t``) is visible to
    query i iff ``kv_start + t > q_pos[i] - W`` (transformers' sliding-window overlay). There is no
    causal mask: decode queries never see keys after their own position, because the runs a query
    is given end at or before it.

    Returns ``(out [Nq, Hq, D] fp32, lse [Nq, Hq] fp32)``; a query that sees no key (kv_len 0, or
    the run wholly outside its window) gets out 0 and lse -inf, so it merges as "nothing".
    ``num_splits`` (triton) splits the visible part of the run along its length for parallelism
    (flash-decoding); None chooses from the GPU size.
    """
    kv_len, kv_start = int(kv_len), int(kv_start)
    _check(q, k_cache, v_cache, block_table, kv_len, kv_start)
    lo_abs = _window_lo(q, q_pos, window)
    if resolve_impl(kernel_impl, q.device, "attend_partial") == "triton":
        try:
            idx = torch.arange(q.shape[0], device=q.device)
            plan = cascade_plan(q, k_cache, [Level(idx, block_table, kv_len, kv_start)], q_pos=q_pos, window=window,
                                num_splits=num_splits)
            return _cascade_triton(q, k_cache, v_cache, plan, scale)
        except Exception as err:
            fall_back("attend_partial", err, kernel_impl)
    lo = None if lo_abs is None else lo_abs - kv_start
    return _attend_partial_torch(q, k_cache, v_cache, block_table, kv_len, scale, lo)


def merge_states(out_a, lse_a, out_b, lse_b, *, kernel_impl: str = "auto"):
    """Exact merge of two partial attention results over disjoint key sets.

    out_* [N, H, D], lse_* [N, H] (natural log). Either side may be empty (lse -inf); both empty
    gives out 0, lse -inf. Returns fp32 ``(out, lse)``.
    """
    if resolve_impl(kernel_impl, out_a.device, "merge_states") == "triton":
        try:
            return _merge_triton(out_a, lse_a, out_b, lse_b)
        except Exception as err:
            fall_back("merge_states", err, kernel_impl)
    return _merge_torch(out_a, lse_a, out_b, lse_b)


def cascade_attention(q, k_cache, v_cache, levels: Sequence[Level], scale: float, *, q_pos=None,
                      window: int | None = None, sinks=None, kernel_impl: str = "auto", num_splits: int | None = None,
                      return_lse: bool = False, plan: CascadePlan | None = None):
    """Attention of q [Nq, Hq, D] over the union of the levels that list each query.

    Typical debate use: level 0 = question prefix (all queries), level 1 = a receiver's history
    (a subgroup), then one level per query holding its own suffix (a decode query's suffix
    includes its current token, so no causal mask is needed: a query never sees a key after its
    own position). ``window``/``q_pos`` mask each level per query row as in
    :func:`attend_partial` (a level wholly outside a query's window contributes nothing);
    ``sinks`` [Hq] are per-head sink logits applied after the merge (:func:`apply_sinks`).

    Returns out [Nq, Hq, D] in q's dtype (plus, with ``return_lse``, the fp32 lse [Nq, Hq] of the
    visible scores, including the sink when ``sinks`` is given); a query that sees no key (listed
    by no level, or everything outside its window) gets 0. The triton path runs every level in one
    launch and merges all partials with one scatter log-sum-exp; the torch path is the plain loop
    "attend_partial per level, merge_states into the running result". ``plan``: the Triton path's
    bookkeeping from :func:`cascade_plan` for the same levels, window and q_pos, reused across calls
    (the engine builds one per step and window); None builds it here.
    """
    for lv in levels:
        _check(q, k_cache, v_cache, lv.block_table, int(lv.kv_len), int(lv.kv_start))
    lo_abs = _window_lo(q, q_pos, window)
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape [Hq]=[{q.shape[1]}], got {list(sinks.shape)}")
    out = lse = None
    if resolve_impl(kernel_impl, q.device, "cascade_attention") == "triton":
        try:
            plan = plan or cascade_plan(q, k_cache, levels, q_pos=q_pos, window=window, num_splits=num_splits)
            out, lse = _cascade_triton(q, k_cache, v_cache, plan, scale)
        except Exception as err:
            fall_back("cascade_attention", err, kernel_impl)
    if out is None:
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        for lv in levels:
            idx = lv.query_idx.to(q.device).long()
            if idx.numel() == 0:
                continue
            lo = None if lo_abs is None else lo_abs[idx] - int(lv.kv_start)
            o, l = _attend_partial_torch(q[idx], k_cache, v_cache, lv.block_table, int(lv.kv_len), scale, lo)
            out[idx], lse[idx] = _merge_torch(out[idx], lse[idx], o, l)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def apply_sinks(out, lse, sinks):
    """Add per-head attention sinks (GPT-OSS) to a finished attention result.

    A sink is a logit ``s_h`` that joins the softmax denominator and has no value, so the output
    over the keys shrinks by the share of the probability mass the sink takes:
    ``out * sigmoid(lse - s_h)``, and the log partition function becomes ``logaddexp(lse, s_h)``.
    ``out`` [..., H, D] (any float dtype; returned in it), ``lse`` [..., H] (natural log, heads last:
    transpose a flash-attn [B, H, S] lse first), ``sinks`` [H]. A row that saw no key (lse -inf)
    stays 0 whatever the sink; a sink of -inf changes nothing. Returns ``(out, lse fp32)``.
    """
    if lse.shape != out.shape[:-1] or sinks.shape != lse.shape[-1:]:
        raise ValueError(f"apply_sinks needs out [..., H, D], lse [..., H], sinks [H]; got "
                         f"{list(out.shape)}, {list(lse.shape)}, {list(sinks.shape)}")
    lse = lse.float()
    sinks = sinks.to(device=lse.device, dtype=torch.float32)
    keep = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.sigmoid(lse - sinks))
    return (out.float() * keep[..., None]).to(out.dtype), torch.logaddexp(lse, sinks)


def reference_attention(q_i, k_full, v_full, scale: float | None = None, *, window: int | None = None,
                        q_pos=None, k_pos=None, sinks=None):
    """Naive attention for tests: q_i [..., Hq, D] against a plain (prefix copied) k/v
    [L, Hkv, D]; GQA by repeating KV heads. Returns fp32 [..., Hq, D].

    ``window`` with ``q_pos`` (shape ``q_i.shape[:-2]``) and ``k_pos`` [L] (absolute key positions,
    default 0..L-1) masks keys with ``k_pos <= q_pos - window``. ``sinks`` [Hq] joins the softmax
    as one extra column per head that is dropped afterwards (GPT-OSS's eager attention). A query
    that sees no key gets 0."""
    hq, hkv = q_i.shape[-2], k_full.shape[1]
    scale = 1.0 / math.sqrt(q_i.shape[-1]) if scale is None else scale
    k = k_full.float().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
    v = v_full.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("...hd,lhd->...hl", q_i.float(), k) * scale
    if window is not None:
        k_pos = torch.arange(k_full.shape[0]) if k_pos is None else k_pos
        visible = k_pos.to(scores.device) > (torch.as_tensor(q_pos, device=scores.device)[..., None] - window)
        scores = scores.masked_fill(~visible[..., None, :], float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().to(scores.device)[:, None].expand(scores.shape[:-1] + (1,))
        scores = torch.cat([scores, sink_col], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf (no key, no sink): 0
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("...hl,lhd->...hd", probs, v)


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------

def _check(q, k_cache, v_cache, block_table, kv_len, kv_start=0):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("need q [Nq,Hq,D] and k/v caches [blocks, block_size, Hkv, D]")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head dim mismatch or Hq={q.shape[1]} not a multiple of Hkv={k_cache.shape[2]}")
    if not 0 <= kv_len <= block_table.numel() * k_cache.shape[1]:
        raise ValueError(f"kv_len={kv_len} exceeds the {block_table.numel()} blocks of the table")
    if kv_start < 0:
        raise ValueError(f"kv_start must be >= 0, got {kv_start}")


_POS_MAX = 2**31 - 1  # positions travel to the kernel as int32


def _window_lo(q, q_pos, window):
    """Per query, the first visible absolute position ``q_pos - window + 1`` (int64 [Nq], clamped
    to [0, 2^31 - 1]); None without a window."""
    if window is None:
        return None
    try:
        window = operator.index(window)
    except TypeError:
        window = None
    if window is None or window < 1:
        raise ValueError("window must be a positive int or None")
    if q_pos is None:
        raise ValueError("window needs q_pos (each query's absolute position)")
    q_pos = torch.as_tensor(q_pos, device=q.device)
    if q_pos.shape != q.shape[:1] or q_pos.is_floating_point() or q_pos.is_complex():
        raise ValueError(f"q_pos must be an int tensor of shape [Nq]=[{q.shape[0]}], "
                         f"got {q_pos.dtype} {list(q_pos.shape)}")
    return (q_pos.long() - (window - 1)).clamp(0, _POS_MAX)


def _gather_run(cache, block_table, kv_len, start=0):
    """Tokens [start, kv_len) of one run as [kv_len - start, Hkv, D] (a copy: the torch path reads
    the run once, and only the part some query can see)."""
    bs = cache.shape[1]
    first = start // bs
    blocks = cache[block_table[first:cdiv(kv_len, bs)].to(cache.device).long()]
    return blocks.reshape(-1, *cache.shape[2:])[start - first * bs:kv_len - first * bs]


def _attend_partial_torch(q, k_cache, v_cache, block_table, kv_len, scale, lo=None):
    """``lo`` [Nq] (optional): each query's first visible token index within the run (window)."""
    nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    start = 0 if lo is None or nq == 0 else max(0, int(lo.min()))  # skip what no query sees
    if kv_len <= start or nq == 0:
        return (q.new_zeros((nq, hq, d), dtype=torch.float32),
                q.new_full((nq, hq), float("-inf"), dtype=torch.float32))
    k = _gather_run(k_cache, block_table, kv_len, start).float()  # [L, Hkv, D]
    v = _gather_run(v_cache, block_table, kv_len, start).float()
    # Stack every query and every GQA head of a KV head as rows: one [Nq*G, D] x [D, L] product.
    qg = q.float().reshape(nq, hkv, hq // hkv, d)
    scores = torch.einsum("nkgd,lkd->kngl", qg, k) * scale  # [Hkv, Nq, G, L]
    if lo is not None:
        hidden = torch.arange(start, kv_len, device=q.device) < lo.to(q.device)[:, None]  # [Nq, L]
        scores = scores.masked_fill(hidden[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a query that sees nothing here
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # avoid -inf - -inf
    out = torch.einsum("kngl,lkd->nkgd", torch.exp(scores - shift[..., None]), v)
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
    from .pdl import enter

    @triton.jit
    def _cascade_kernel(
        Q, K, V, BT, LENS, STARTS, N_ENT, ENT0, ENT_Q, ITEMS, LO_ABS, O, LSE,
        qk_scale, chunk, n_split, n_entries, hq,
        s_qn, s_qh, s_qd, s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd, s_bt,
        BLOCK_SIZE: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
        WINDOW: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One program: a block of (query, GQA head) rows of one level x one KV head x one chunk of
        the part of that level's run its rows can see. Flash-attention online softmax over the
        chunk, writing the chunk's normalised output and lse (exp2 domain inside, natural log out).

        With WINDOW, row r sees run tokens t >= lo_r (its first visible position, level-local). The
        program's chunks start at its rows' smallest lo_r, so a window never reads the part of the
        run no row sees; the last chunk runs to the end of the run, so any q_pos stays covered.
        A tile (or chunk, or level) may hold no visible key for some rows: their running max stays
        -inf and is replaced by 0 where it is subtracted, so they accumulate exactly nothing."""
        enter(PDL)
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
        base = 0
        if WINDOW:
            row_lo = tl.load(LO_ABS + qn, mask=rmask, other=0) - tl.load(STARTS + level)
            base = tl.maximum(tl.min(tl.where(rmask, row_lo, kv_len), axis=0), 0)
        lo = base + split * chunk
        hi = tl.where(split == n_split - 1, kv_len, tl.minimum(lo + chunk, kv_len))
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
            visible = pmask[None, :]
            if WINDOW:
                visible = visible & (pos[None, :] >= row_lo[:, None])
            m_i, l_i, acc = softmax_update(s, visible, v, m_i, l_i, acc, DOT_F32)
        has = l_i > 0.0  # false for a row that saw no key in this chunk
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        o_row = (split * n_entries + entry) * hq + head
        tl.store(O + o_row[:, None] * D + d[None, :], out, mask=rmask[:, None] & dmask[None, :])
        tl.store(LSE + o_row, lse, mask=rmask)

    @triton.jit
    def _merge_kernel(OA, LA, OB, LB, O, L, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr = False):
        enter(PDL)
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
                                              BLOCK_R=block_r, BLOCK_D=max(16, next_pow2(d)), **launch(oa))
    return out, lse


class CascadePlan(NamedTuple):
    """The Triton path's host-side bookkeeping for one set of levels: block tables padded into one
    int32 table, the (level, query) entries, the row-block work items and the split of the runs. It
    depends on the levels, the window and the shapes, not on q/k/v's values, so it is the same for
    every layer of an engine step: build it once (:func:`cascade_plan`) and pass it to each call.
    Rebuilding it per call costs dozens of small host-to-device copies, which on a GPU cost more
    than the attention itself."""

    nq: int
    hq: int
    hkv: int
    block_size: int
    meta: dict  # device tensors: bt, lens, starts, n_ent, ent0, ent_q, items, lo, ent_q_split (int64)
    n_items: int
    chunk: int
    n_split: int
    block_m: int
    block_n: int
    window: bool


def cascade_plan(q, k_cache, levels: Sequence[Level], *, q_pos=None, window: int | None = None,
                 num_splits: int | None = None) -> CascadePlan:
    """The Triton path's bookkeeping for :func:`cascade_attention` with these levels, window and
    shapes (q [Nq, Hq, D] and k_cache [blocks, block_size, Hkv, D] are read for their shapes and
    device only). Block tables and query indices may live on the host: they travel to the device in
    one copy."""
    nq, hq, _ = q.shape
    _, block_size, hkv, _ = k_cache.shape
    g, dev = hq // hkv, q.device
    lo_abs = _window_lo(q, q_pos, window)
    levels = [lv for lv in levels if lv.query_idx.numel()]
    block_m, block_n = (16, 16) if interpreting() else (64, 64)
    lens = [int(lv.kv_len) for lv in levels]
    n_ent, ent0, items, start = [], [], [], 0
    for i, lv in enumerate(levels):
        n = lv.query_idx.numel()
        n_ent.append(n)
        ent0.append(start)
        items += [(i, r) for r in range(0, n * g, block_m)]
        start += n
    # The part of a run a program reads: all of it, or with a window about `window` tokens (exactly
    # that for decode queries, whose levels end at or before them); splits divide that part.
    span = max(max(lens, default=1), 1) if window is None else min(max(lens, default=1), window)
    if num_splits is None:  # enough programs to fill the GPU (flash-decoding for long prefixes)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        num_splits = min(cdiv(2 * sms, max(1, len(items)) * hkv), cdiv(span, 512))
    chunk = cdiv(cdiv(max(span, 1), max(1, num_splits)), block_n) * block_n
    n_split = max(1, cdiv(span, chunk))
    nl = len(levels)
    tables = [lv.block_table[:max(1, cdiv(n, block_size))].to("cpu", torch.int32) for lv, n in zip(levels, lens)]
    width = max((t.numel() for t in tables), default=1)
    ent_q = torch.cat([lv.query_idx.to("cpu", torch.int32) for lv in levels]) if levels else torch.zeros(0, dtype=torch.int32)
    host = torch.cat([torch.tensor(lens + [int(lv.kv_start) for lv in levels] + n_ent + ent0, dtype=torch.int32),
                      ent_q, torch.tensor(items, dtype=torch.int32).flatten(),
                      torch.stack([torch.nn.functional.pad(t, (0, width - t.numel())) for t in tables]).flatten()
                      if tables else torch.zeros(0, dtype=torch.int32)])
    flat = host.to(dev)
    n_e = ent_q.numel()
    parts = flat.split([nl, nl, nl, nl, n_e, 2 * len(items), nl * width])
    meta = dict(lens=parts[0], starts=parts[1], n_ent=parts[2], ent0=parts[3], ent_q=parts[4],
                items=parts[5], bt=parts[6].view(nl, width))
    meta["lo"] = meta["ent_q"] if lo_abs is None else lo_abs.to(torch.int32)  # unread without a window
    meta["ent_q_split"] = meta["ent_q"].long().repeat(n_split)
    return CascadePlan(nq, hq, hkv, block_size, meta, len(items), chunk, n_split, block_m, block_n,
                       lo_abs is not None)


def _cascade_triton(q, k_cache, v_cache, plan: CascadePlan, scale):
    nq, hq, d = q.shape
    dev = q.device
    if (nq, hq, k_cache.shape[2], k_cache.shape[1]) != (plan.nq, plan.hq, plan.hkv, plan.block_size):
        raise ValueError(f"the cascade plan was built for Nq, Hq, Hkv, block_size = {plan[:4]}, got "
                         f"{(nq, hq, k_cache.shape[2], k_cache.shape[1])}")
    if plan.n_items == 0 or nq == 0:
        return torch.zeros(nq, hq, d, device=dev), torch.full((nq, hq), float("-inf"), device=dev)
    m = plan.meta
    n_e = m["ent_q"].numel()
    o_part = torch.empty(plan.n_split, n_e, hq, d, device=dev)
    l_part = torch.empty(plan.n_split, n_e, hq, device=dev)
    # fp32 inputs (exact ieee dot), mixed dtypes, or bf16 under the interpreter (its bf16 dot is wrong)
    dot_f32 = q.dtype == torch.float32 or q.dtype != k_cache.dtype or (interpreting() and q.dtype == torch.bfloat16)
    _cascade_kernel[(plan.n_items, plan.hkv, plan.n_split)](
        q, k_cache, v_cache, m["bt"], m["lens"], m["starts"], m["n_ent"], m["ent0"], m["ent_q"], m["items"], m["lo"],
        o_part, l_part, scale * 1.4426950408889634, plan.chunk, plan.n_split, n_e, hq,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), m["bt"].stride(0),
        BLOCK_SIZE=plan.block_size, G=hq // plan.hkv, D=d, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        BLOCK_D=max(16, next_pow2(d)), DOT_F32=dot_f32, WINDOW=plan.window, **launch(q),
    )
    return _merge_indexed(o_part.reshape(-1, hq, d), l_part.reshape(-1, hq), m["ent_q_split"], nq)
