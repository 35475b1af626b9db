"""Decode attention that reads K/V in place from the engine's paged cache (flash-decoding).

A decode step has one query token per sequence, attending to that sequence's whole context. The
engine's other paths gather each context into a contiguous copy per layer; this one reads the cache
slots through the block table instead, so a step moves only the bytes attention needs.

Cache layout (engine/kv_cache.py): per layer ``k_cache`` [num_blocks * block_size, Hkv, D] and
``v_cache`` [num_blocks * block_size, Hkv, Dv], flat slots; token p of sequence b lives in slot
``block_table[b, p // block_size] * block_size + p % block_size``. ``context_lens[b]`` counts the
tokens of sequence b *including* the current one, whose K/V the caller has already written, so the
query sits at position L-1 and sees keys 0..L-1 (a sliding window W keeps keys p > L-1-W).

Triton path: program (b, kv head, split) takes the G = H/Hkv query heads that share the KV head as
the rows of one tile (GQA without copying heads), walks its split of the visible context in tiles of
BLOCK_N tokens with an online softmax, and writes a partial (out, lse); a second small kernel
merges the splits per (b, head), folding in the GPT-OSS sink logit. Splits are sized from the block
table's width (a host shape), never from context_lens' values: no host sync, so the call can be
captured in a CUDA graph. Where the table is short enough for one split and no sink is folded in, the
split kernel's output is already the answer (the merge of one partial multiplies it by 1 and divides
by 1): it stores it straight into the output and the merge is not launched, one kernel a layer fewer in
a short-context decode step. The output can be the caller's (``out=``, e.g. the decode rows of the
layer's attention output), so no copy follows either.
"""
from __future__ import annotations

import operator

import torch

from ._attn_tiles import paged_scores, softmax_update
from ._backend import (HAS_TRITON, NUM_STAGES, cdiv, fall_back, fit_attn_tiles, interpreting, next_pow2, resolve_impl,
                       smem_limit, tl, triton)
from .pdl import launch
from .prefix_attention import apply_sinks


def paged_decode(q, k_cache, v_cache, block_table, context_lens, block_size: int, scale: float, window=None,
                 sinks=None, kernel_impl: str = "auto", num_splits: int | None = None, out=None):
    """One decode query per sequence against its paged context.

    q [B, H, D]; k_cache [slots, Hkv, D], v_cache [slots, Hkv, Dv] (H a multiple of Hkv);
    block_table [B, max_blocks] int (entries past a sequence's blocks are never read);
    context_lens [B] int (0 gives an output of 0); ``window`` W or None; ``sinks`` [H] per-head sink
    logits or None. Returns [B, H, Dv] in q's dtype: ``out`` where given (written in place; any strides),
    else a new tensor. ``num_splits`` (triton) cuts the context into that many parts; None chooses from
    the GPU size.
    """
    window = _check(q, k_cache, v_cache, block_table, context_lens, block_size, window, sinks)
    if out is not None and (tuple(out.shape) != (*q.shape[:2], v_cache.shape[2]) or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"paged_decode: out must be {q.dtype} [B, H, Dv]={[*q.shape[:2], v_cache.shape[2]]} on "
                         f"{q.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    if resolve_impl(kernel_impl, q.device, "paged_decode") == "triton":
        try:
            return _paged_decode_triton(q, k_cache, v_cache, block_table, context_lens, block_size, scale,
                                        window, sinks, num_splits, out)
        except Exception as err:
            fall_back("paged_decode", err, kernel_impl)
    ref = reference_paged_decode(q, k_cache, v_cache, block_table, context_lens, block_size, scale, window, sinks)
    return ref if out is None else out.copy_(ref)


def reference_paged_decode(q, k_cache, v_cache, block_table, context_lens, block_size, scale, window=None,
                           sinks=None):
    """The torch path (CPU, and the fallback): gathers every sequence's ``max_blocks * block_size``
    slots, masks what lies past its length or before its window, one fp32 softmax. No host sync."""
    b, h, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    width = block_table.shape[1]
    pos = torch.arange(width * block_size, device=q.device)  # [P]
    bt = block_table.to(q.device).long()
    slots = bt[:, pos // block_size] * block_size + pos % block_size  # [B, P]
    lens = context_lens.to(q.device).long()[:, None]
    visible = pos[None, :] < lens
    if window is not None:
        visible &= pos[None, :] >= lens - window
    k = k_cache[slots.clamp(0, k_cache.shape[0] - 1)].float()  # [B, P, Hkv, D]
    v = v_cache[slots.clamp(0, v_cache.shape[0] - 1)].float()  # rows no token wrote may hold NaN: zero them,
    v = v.masked_fill(~visible[:, :, None, None], 0.0)  # as a zero weight times NaN is still NaN
    qg = q.float().reshape(b, hkv, h // hkv, d)
    scores = torch.einsum("bkgd,bpkd->bkgp", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G], -inf for an empty context
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("bkgp,bpkd->bkgd", torch.exp(scores - shift[..., None]), v).reshape(b, h, dv)
    if sinks is not None:
        out, _ = apply_sinks(out, lse.reshape(b, h), sinks)
    return out.to(q.dtype)


def _check(q, k_cache, v_cache, block_table, context_lens, block_size, window, sinks):
    b = q.shape[0] if q.dim() else 0  # (a q of the wrong rank is refused first, by name)
    window = check_paged_call("paged_decode", "B", ("B", b), q, k_cache, v_cache, block_table, block_size, window, sinks)
    if tuple(context_lens.shape) != (b,) or context_lens.is_floating_point():
        raise ValueError(f"paged_decode: context_lens must be an int tensor [B={b}], got "
                         f"{context_lens.dtype} {list(context_lens.shape)}")
    return window


def check_paged_call(name: str, q_rows: str, table_rows: tuple[str, int], q, k_cache, v_cache, block_table,
                     block_size, window, sinks):
    """What every kernel reading the flat-slot cache through a block table checks: q [N, H, D] (`q_rows`
    names N in messages) against k_cache [slots, Hkv, D] and v_cache [slots, Hkv, Dv], an int table of
    `table_rows` = (label, count) rows, whole blocks, sinks [H]. Returns the window as an int (or None);
    each ValueError names `name` and the argument."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"{name} needs q [{q_rows},H,D], k_cache [slots,Hkv,D], v_cache [slots,Hkv,Dv]; got "
                         f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}")
    h, d = q.shape[1:]
    if k_cache.shape[2] != d or h % k_cache.shape[1]:
        raise ValueError(f"{name}: q {list(q.shape)} does not fit k_cache {list(k_cache.shape)} "
                         f"(head dim must match, H a multiple of the KV heads)")
    label, n = table_rows
    if block_table.dim() != 2 or block_table.shape[0] != n or block_table.is_floating_point():
        raise ValueError(f"{name}: block_table must be an int tensor [{label}={n}, max_blocks], "
                         f"got {block_table.dtype} {list(block_table.shape)}")
    if block_size < 1 or k_cache.shape[0] % block_size:
        raise ValueError(f"{name}: the cache's {k_cache.shape[0]} slots are not whole blocks of {block_size}")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"{name}: sinks must be [H]=[{h}], got {list(sinks.shape)}")
    if window is None:
        return None
    try:
        window = operator.index(window)
    except TypeError:
        window = 0
    if window < 1:
        raise ValueError(f"{name}: window must be a positive int or None, got {window!r}")
    return window


# ----------------------------------------------------------------------------------------------
# Triton path
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:
    from .pdl import enter

    @triton.jit
    def _decode_split_kernel(
        Q, K, V, BT, LENS, O_PART, L_PART, O, qk_scale, window, chunk, n_split,
        s_qb, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_btb, s_btp, s_ob, s_oh, s_od,
        BLOCK_SIZE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        WINDOW: tl.constexpr, DOT_F32: tl.constexpr, FINAL: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Program (b, kv head, split): the G query heads of that KV head against context tokens
        [lo, hi) of sequence b; writes the normalised partial output and its natural-log lse (-inf
        when the split is empty), or, FINAL (one split, no sinks), the output itself into O.
        Online softmax in the exp2 domain."""
        enter(PDL)
        bi = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n_ctx = tl.load(LENS + bi).to(tl.int32)
        start = 0
        if WINDOW:
            start = tl.maximum(n_ctx - window, 0)
        lo = start + split * chunk
        hi = tl.where(split == n_split - 1, n_ctx, tl.minimum(lo + chunk, n_ctx))
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        head = kvh * G + g
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        dv = tl.arange(0, BLOCK_DV)
        dvmask = dv < DV
        q = tl.load(Q + bi * s_qb + head[:, None] * s_qh + d[None, :] * s_qd,
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            pos = t0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            s, v = paged_scores(q, K, V, BT, bi * s_btb, pos, pmask, kvh, d, dmask, dv, dvmask, s_btp, s_kt, s_kh, s_kd,
                                s_vt, s_vh, s_vd, BLOCK_SIZE, DOT_F32)
            m_i, l_i, acc = softmax_update(s * qk_scale, pmask[None, :], v, m_i, l_i, acc, DOT_F32)
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if FINAL:
            tl.store(O + bi * s_ob + head[:, None] * s_oh + dv[None, :] * s_od, out.to(O.dtype.element_ty),
                     mask=gmask[:, None] & dvmask[None, :])
        else:
            lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            row = (bi * (G * tl.num_programs(1)) + head) * n_split + split  # [B, H, S] layout
            tl.store(O_PART + row[:, None] * DV + dv[None, :], out, mask=gmask[:, None] & dvmask[None, :])
            tl.store(L_PART + row, lse, mask=gmask)

    @triton.jit
    def _decode_merge_kernel(O_PART, L_PART, SINKS, O, n_split, s_ob, s_oh, s_od, H,
                             DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                             HAS_SINKS: tl.constexpr, PDL: tl.constexpr = False):
        """Program (b, head): log-sum-exp merge of the splits' partials, plus the sink logit as one
        more term of the denominator that carries no value. No key and no sink: out 0."""
        enter(PDL)
        bi = tl.program_id(0)
        hi = tl.program_id(1)
        row = bi * H + hi
        sp = tl.arange(0, BLOCK_S)
        smask = sp < n_split
        dv = tl.arange(0, BLOCK_DV)
        dvmask = dv < DV
        lse = tl.load(L_PART + row * n_split + sp, mask=smask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        if HAS_SINKS:
            sink = tl.load(SINKS + hi).to(tl.float32)
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        den = tl.sum(w, axis=0)
        if HAS_SINKS:
            den += tl.exp(sink - m)
        part = tl.load(O_PART + (row * n_split + sp)[:, None] * DV + dv[None, :],
                       mask=smask[:, None] & dvmask[None, :], other=0.0)
        out = tl.sum(w[:, None] * part, axis=0) / tl.maximum(den, 1e-30)
        tl.store(O + bi * s_ob + hi * s_oh + dv * s_od, out, mask=dvmask)


def _paged_decode_triton(q, k_cache, v_cache, block_table, context_lens, block_size, scale, window, sinks,
                         num_splits, out=None):
    b, h, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    g = h // hkv
    dev = q.device
    if out is None:
        out = torch.empty(b, h, dv, device=dev, dtype=q.dtype)
    if b == 0:
        return out
    # fp32 inputs (exact ieee dot), mixed dtypes, or bf16 under the interpreter (its bf16 dot is wrong)
    dot_f32 = (q.dtype == torch.float32 or q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype
               or (interpreting() and q.dtype == torch.bfloat16))
    block_g, block_d, block_dv = max(16, next_pow2(g)), max(16, next_pow2(d)), max(16, next_pow2(dv))
    block_n = 16 if interpreting() else fit_attn_tiles(
        block_g, 64, block_d, block_dv, 4 if dot_f32 else q.element_size(), smem_limit(dev), smallest=block_g)[1]
    span = max(1, block_table.shape[1] * block_size)  # the longest context the table can hold
    if window is not None:
        span = min(span, window)
    if num_splits is None:  # about two programs per SM, splits of at least 256 tokens
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        num_splits = min(cdiv(2 * sms, b * hkv), cdiv(span, 256))
    chunk = cdiv(cdiv(span, max(1, num_splits)), block_n) * block_n
    n_split = max(1, cdiv(span, chunk))
    final = n_split == 1 and sinks is None  # the one partial is the output: no merge
    # the interpreter truncates fp32 -> bf16 on store (a GPU rounds to nearest): round in torch there
    dst = torch.empty(out.shape, device=dev, dtype=torch.float32) if interpreting() and q.dtype == torch.bfloat16 \
        else out
    o_part = dst if final else torch.empty(b, h, n_split, dv, device=dev, dtype=torch.float32)
    l_part = dst if final else torch.empty(b, h, n_split, device=dev, dtype=torch.float32)
    bt = block_table if block_table.device == dev else block_table.to(dev)
    lens = context_lens if context_lens.device == dev else context_lens.to(dev)
    _decode_split_kernel[(b, hkv, n_split)](
        q, k_cache, v_cache, bt, lens, o_part, l_part, dst, scale * 1.4426950408889634, window or 0, chunk, n_split,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *bt.stride(), *dst.stride(),
        BLOCK_SIZE=block_size, G=g, D=d, DV=dv, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, WINDOW=window is not None,
        DOT_F32=dot_f32, FINAL=final, num_stages=NUM_STAGES, **launch(q))
    if not final:
        sk = sinks if sinks is not None else l_part
        _decode_merge_kernel[(b, h)](o_part, l_part, sk, dst, n_split, *dst.stride(), h, DV=dv,
                                     BLOCK_S=max(2, next_pow2(n_split)), BLOCK_DV=max(16, next_pow2(dv)),
                                     HAS_SINKS=sinks is not None, **launch(o_part))
    return out.copy_(dst) if dst is not out else out
