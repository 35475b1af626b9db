"""A decode step's sampling and token statistics from its fp32 logits in two Triton kernels (CUDA).

The torch path (engine/sampler.py `draw`, engine/stats.py `stats_from_logits`, `pack`) is some forty
small kernels a step: two top-k passes over the vocabulary, log_softmax, exp, products and sums for the
entropy, the softmax, cumsums and searchsorted of the draw, and the casts of the packing. A batch-1 step of
a 1.7B model on an H100 is ~2.7 ms, and each of those kernels costs a few microseconds of it and a node
of the graph's launch. Here:

* ``_vocab_kernel``, program (row, split): one read of its slice of the row's logits, keeping the online
  maximum, ``sum exp(l - m)`` and ``sum exp(l - m) * l`` (the entropy is ``lse - sum p l``) and each lane's
  best packed (logit, id) int64 key; then its best ``KP`` keys: the lanes' best (kernels/token_stats.py's
  running top-k), and from a second read of the slice the few others above them.
* ``_finish_kernel``, program (row): merges the splits (the log-sum-exp, the entropy, the best keys of all
  splits, sorted), draws the row's token from its ``K`` best exactly as `draw` does (temperature, the row's
  top-k as masked ranks, top-p, the inverse CDF at its uniform draw; greedy rows the argmax) and writes
  the row as `stats.pack` lays it out: token, log-prob, entropy, top log-probs, top ids, float64.

The keys put the id's complement in the low word, so equal logits order by the lower id first: the
argmax is the first maximal index, as torch.argmax's (greedy tokens are the reference's). Float sums run
in another order than torch's: log-probs and entropies agree within float rounding, and a sampled token
differs only where its uniform draw falls within rounding of a boundary of the CDF. Rows whose logits hold
NaN or infinity get a NaN entropy, as from the torch path, so the step fails their request.

Widths: ``max(K, topk) <= MAX_WIDTH`` (the static decode step's 40 and 20; wider asks take the torch path,
`fits`).
"""
from __future__ import annotations

import torch

from ._backend import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton
from .pdl import launch

MAX_WIDTH = 64  # the most top-k ranks (sampling's K, the statistics' topk) the kernels keep a row
SPLIT = 8192  # vocabulary entries a program of the first kernel reads (a multiple of its tile)


def fits(K: int, topk: int, vocab: int) -> bool:
    """Whether `sample_pack` takes these widths: both within MAX_WIDTH and the vocabulary."""
    return 1 <= K <= vocab and 0 <= topk <= vocab and max(K, topk) <= MAX_WIDTH


def sample_pack(logits: torch.Tensor, table: torch.Tensor, K: int, topk: int) -> torch.Tensor:
    """`logits` [R, V] fp32 and the rows' sampling table [5, R] float64 on the same device (sampler.Draws'
    rows: temperature, top-k, top-p, uniform draw, greedy; any strides: the static step passes a view of its
    wider buffer, read in place) -> [R, 3 + 2 topk] float64, stats.pack's layout.
    `K`: the top-k width sampled from; `topk`: the statistics' width (`fits` must hold)."""
    R, V = logits.shape
    if logits.dtype != torch.float32 or tuple(table.shape) != (5, R) or table.dtype != torch.float64:
        raise ValueError(f"sample_pack needs fp32 logits [R, V] and a float64 table [5, R]; got {logits.dtype} "
                         f"{list(logits.shape)} and {table.dtype} {list(table.shape)}")
    if not fits(K, topk, V):
        raise ValueError(f"sample_pack: K={K} and topk={topk} must be within 1..{min(MAX_WIDTH, V)} and 0..{V}")
    dev = logits.device
    out = torch.empty(R, 3 + 2 * topk, dtype=torch.float64, device=dev)
    if R == 0:
        return out
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    bv = 256 if interpreting() else 1024
    split = cdiv(SPLIT, bv) * bv
    n_split = cdiv(V, split)
    kp = next_pow2(max(K, topk))
    m, s, a = (torch.empty(R, n_split, device=dev) for _ in range(3))
    keys = torch.empty(R, n_split, kp, dtype=torch.int64, device=dev)
    warps = {} if interpreting() else {"num_warps": 8}  # the finish's sort: 80 registers a thread, not 128 at 4
    _vocab_kernel[(R, n_split)](x, m, s, a, keys, V, split, x.stride(0), n_split, KK=max(K, topk), KP=kp, BV=bv, **warps,
                                **launch(x))
    _finish_kernel[(R,)](x, table, m, s, a, keys, out, *table.stride(), x.stride(0), n_split, K, topk, out.stride(0),
                         KP=kp, BS=max(2, next_pow2(n_split)), TOPK_P=max(2, next_pow2(topk)), **warps, **launch(x))
    return out


if HAS_TRITON:
    from .pdl import enter
    from .token_stats import _pack_key, _unpack_key, _update_topk

    MIN_KEY = tl.constexpr(-(2**63))  # below every packed key: unused slots and the lanes past a split's end

    @triton.jit
    def _vocab_kernel(L, M, S, A, KEYS, V, split, s_lr, n_split,
                      KK: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, split): the online max m, sum exp(l - m) and sum exp(l - m) * l of logits
        [split * pid, +split) of the row, and its KK best keys (in KP slots, unsorted). The best keys in two
        passes: the first keeps each lane's best key over the tiles (elementwise) and takes the KK best of
        those; the second reads the slice again (from L2) and inserts only the keys above their floor that
        are not a lane's best, usually one to three. Why: inserting tile by tile costs one block-wide
        maximum a key that enters, ~KK (1 + ln tiles) of them a slice (144 at 8 tiles, 0.18 ms of a batch-1
        step on an H200); this costs ~KK + 3. The same KK keys either way (they are unique: the id is in the
        low word), so the same output bits."""
        enter(PDL)
        row = tl.program_id(0)
        sp = tl.program_id(1)
        lo = sp * split
        hi = tl.minimum(lo + split, V)
        at = L + row.to(tl.int64) * s_lr
        m = tl.full([1], float("-inf"), tl.float32)
        s = tl.zeros([1], tl.float32)
        a = tl.zeros([1], tl.float32)
        lane_best = tl.full([1, BV], MIN_KEY, tl.int64)
        for v0 in range(lo, hi, BV):
            cols = v0 + tl.arange(0, BV)
            cmask = cols < hi
            lg = tl.load(at + cols, mask=cmask, other=float("-inf"))[None, :]
            m_new = tl.maximum(m, tl.max(lg, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf tile so far: no NaN from -inf - -inf
            alpha = tl.exp(m - shift)
            e = tl.exp(lg - shift[:, None])
            s = s * alpha + tl.sum(tl.where(cmask[None, :], e, 0.0), axis=1)
            a = a * alpha + tl.sum(e * tl.where(cmask[None, :], lg, 0.0), axis=1)  # a logit of -inf: 0 * -inf, NaN as torch's
            m = m_new
            lane_best = tl.maximum(lane_best, _slice_keys(lg, cols, cmask))
        top = tl.arange(0, KP)[None, :].to(tl.int64) + tl.full([1, KP], MIN_KEY, tl.int64)
        top = _update_topk(top, lane_best, KK, KP)
        # a lane's best is in `top` or below every key there: the others of its lane above the floor enter
        for v0 in range(lo, hi, BV):
            cols = v0 + tl.arange(0, BV)
            cmask = cols < hi
            keys = _slice_keys(tl.load(at + cols, mask=cmask, other=float("-inf"))[None, :], cols, cmask)
            top = _update_topk(top, tl.where(keys == lane_best, MIN_KEY, keys), KK, KP)
        out = row * n_split + sp
        tl.store(M + out + tl.arange(0, 1), m)
        tl.store(S + out + tl.arange(0, 1), s)
        tl.store(A + out + tl.arange(0, 1), a)
        tl.store(KEYS + out * KP + tl.arange(0, KP)[None, :], top)

    @triton.jit
    def _slice_keys(lg, cols, cmask):
        """token_stats' key with the id's complement in the low word (equal logits order lower id first);
        MIN_KEY past the slice's end."""
        return tl.where(cmask[None, :], _pack_key(lg, 0xFFFFFFFF - cols[None, :].to(tl.int64)), MIN_KEY)

    @triton.jit
    def _finish_kernel(L, TAB, M, S, A, KEYS, OUT, s_tr, s_tc, s_lr, n_split, K, topk, s_or,
                       KP: tl.constexpr, BS: tl.constexpr, TOPK_P: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row): the splits merged, the token drawn from the K best, the row packed."""
        enter(PDL)
        row = tl.program_id(0)
        sp = tl.arange(0, BS)
        smask = sp < n_split
        m = tl.load(M + row * n_split + sp, mask=smask, other=float("-inf"))
        mx = tl.max(m, axis=0)
        base = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.where(smask, tl.exp(m - base), 0.0)
        s = tl.sum(tl.load(S + row * n_split + sp, mask=smask, other=0.0) * w, axis=0)
        a = tl.sum(tl.load(A + row * n_split + sp, mask=smask, other=0.0) * w, axis=0)
        log_s = tl.log(s)
        lse = mx + log_s
        entropy = lse - a / s
        # the best KP keys of all splits, sorted: every split's KP candidates sorted descending, the first KP
        cand = tl.arange(0, BS * KP)
        keys = tl.load(KEYS + row * n_split * KP + cand, mask=cand < n_split * KP, other=MIN_KEY)
        keys = tl.sort(keys, descending=True)
        rank2 = tl.reshape(tl.arange(0, BS * KP), [BS, KP]) // KP
        best = tl.sum(tl.where(rank2 == 0, tl.reshape(keys, [BS, KP]), 0), axis=0)  # [KP], row 0 of the sorted
        vals, low = _unpack_key(best)
        ids = 0xFFFFFFFF - low
        r = tl.arange(0, KP)
        # the draw (engine/sampler.py `draw`): the K best of logits / temperature, ranks past the row's k masked
        at = TAB + row * s_tc  # the table's column of this row (a view of the static step's wider buffer: strided)
        temp = tl.load(at).to(tl.float32)
        k = tl.load(at + s_tr)
        top_p = tl.load(at + 2 * s_tr).to(tl.float32)
        u = tl.load(at + 3 * s_tr)
        greedy = tl.load(at + 4 * s_tr) != 0
        inside = r < K
        v = tl.where(inside & (r.to(tl.float64) < k), vals / temp, float("-inf"))
        e = tl.exp(v - tl.max(v, axis=0))
        probs = e / tl.sum(e, axis=0)
        cum = tl.cumsum(probs, axis=0)
        probs = tl.where((cum - probs) >= top_p, 0.0, probs)  # the smallest head whose mass reaches top-p
        cum = tl.cumsum(probs, axis=0)
        total = tl.sum(tl.where(r == K - 1, cum, 0.0), axis=0)
        target = (u * total.to(tl.float64)).to(tl.float32)
        pos = tl.sum((inside & (cum <= target)).to(tl.int32), axis=0)  # searchsorted(right=True)
        pos = tl.minimum(pos, K - 1)
        pos = tl.maximum(tl.minimum(pos, tl.sum((inside & (probs > 0.0)).to(tl.int32), axis=0) - 1), 0)
        picked = tl.sum(tl.where(r == pos, ids, 0), axis=0)
        first = tl.sum(tl.where(r == 0, ids, 0), axis=0)  # the argmax: the first maximal id
        tok = tl.where(greedy, first, picked)
        # the statistics at temperature 1: log p = (l - max) - log(sum exp(l - max)), as log_softmax
        lp = (tl.load(L + row.to(tl.int64) * s_lr + tok) - mx) - log_s
        o = OUT + row * s_or
        tl.store(o + tl.arange(0, 1), tl.full([1], 0, tl.int64).to(tl.float64) + tok.to(tl.float64))
        tl.store(o + 1 + tl.arange(0, 1), tl.zeros([1], tl.float64) + lp.to(tl.float64))
        tl.store(o + 2 + tl.arange(0, 1), tl.zeros([1], tl.float64) + entropy.to(tl.float64))
        j = tl.arange(0, TOPK_P)
        jm = j < topk
        tv = tl.sum(tl.where(r[None, :] == j[:, None], ((vals - mx) - log_s)[None, :], 0.0), axis=1)
        ti = tl.sum(tl.where(r[None, :] == j[:, None], ids[None, :], 0), axis=1)
        tl.store(o + 3 + j, tv.to(tl.float64), mask=jm)
        tl.store(o + 3 + topk + j, ti.to(tl.float64), mask=jm)
