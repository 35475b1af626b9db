"""What the Triton attention kernels share (paged decode and prefill, cascade, absorbed MLA): the online
softmax update of one tile of keys, and the load of a tile of K/V rows through a flat-slot block table.

Scores are in the exp2 domain (already times scale * log2(e)); a row that has seen no visible key yet
keeps a running max of -inf and contributes nothing, so rows may start their keys at different tiles.
"""
from __future__ import annotations

from ._backend import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def softmax_update(s, visible, v, m_i, l_i, acc, DOT_F32: tl.constexpr):
        """Folds scores `s` [M, N] (masked to `visible`) and values `v` [N, DV] into the running max
        `m_i`, sum `l_i` and unnormalised output `acc`; returns the three updated."""
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # never -inf - -inf
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return m_new, l_i, acc

    @triton.jit
    def paged_scores(q, K, V, BT, bt_row, pos, pmask, kvh, d, dmask, dv, dvmask, s_btp, s_kt, s_kh, s_kd, s_vt, s_vh,
                     s_vd, BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
        """Raw scores q @ K^T [M, N] and the values V [N, DV] (fp32 when DOT_F32) of positions `pos` of one
        KV head, read through the block table row at `BT + bt_row` (token p in slot
        table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE); masked rows load as 0."""
        blk = tl.load(BT + bt_row + (pos // BLOCK_SIZE) * s_btp, mask=pmask, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        k = tl.load(K + slot[:, None] * s_kt + kvh * s_kh + d[None, :] * s_kd, mask=pmask[:, None] & dmask[None, :],
                    other=0.0)
        v = tl.load(V + slot[:, None] * s_vt + kvh * s_vh + dv[None, :] * s_vd, mask=pmask[:, None] & dvmask[None, :],
                    other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        return s, v
else:  # without triton the kernels that call these are never defined
    softmax_update = paged_scores = None
