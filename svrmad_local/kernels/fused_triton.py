"""Triton kernels of the decoder's small ops (kernels/fused.py's interface, same signatures as its torch
references): one launch each where transformers' modules launch from 2 (act, then * up) to ~28 (q/k norms,
RoPE and the cache write) element-wise kernels.

- `rms_norm` / `add_rms_norm`: one program per row, the whole row in registers: x (and the residual) read
  once, the normed row (and the new residual) written once.
- `rope_store`: one launch for q, k and v. Program (token, block of heads) loads its heads' rows, applies the
  per-head q/k RMSNorm where the family has one, rotates the first r dimensions (`rotate_half`'s pairing,
  each dimension's partner loaded beside it), and writes q to a new tensor, k and v straight into their
  cache slots.
- `act_mul`: act(gate) * up over a [rows, columns] grid of tiles, gate and up read through their strides
  (the two halves of one gate/up GEMM output, never copied).

Rounding: arithmetic in fp32, rounded where the reference rounds, so the only differences from it are
where the order of operations cannot be the same: the sum of squares of an RMSNorm (within a few fp32
ulps, which can move a bf16 output by one ulp) and exp in the activations. Everything else (the residual
add, RoPE's products and sum, the casts to the cache) is the reference's operation on the same operands,
so it is bitwise the reference in fp32 and in bf16. Two things keep it so:
- each intermediate the reference rounds to bf16/fp16 (the normed q/k, RoPE's two products, the
  activation before the multiply) is rounded here too; under Triton's interpreter, which truncates fp32
  -> bf16 where a GPU rounds to nearest even, `_round` rounds on the bits;
- launches pass `enable_fp_fusion=False`: a fused multiply-add (a*b + c in one rounding) is not what torch
  computes for RoPE's sum in fp32.
Graph capture: the host code reads shapes, strides and dtypes only (no sync, no data-dependent Python) and
allocates only the outputs.
"""

from __future__ import annotations

import torch

from ._backend import HAS_TRITON, cdiv, interpreting, next_pow2, tl, triton
from .norms import ACTS, PLAIN, NormStyle
from .pdl import enter, launch
from .shares import Shares

if not HAS_TRITON:  # kernels/fused.py's choice catches this and runs the reference
    raise ImportError("triton is not importable")

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _round(x, DT: tl.constexpr, RNE: tl.constexpr):
    """x (fp32) as DT, rounded to nearest even as torch's .to(DT) is; RNE: do it on the bits (the
    interpreter truncates fp32 -> bf16)."""
    x = x.to(tl.float32)
    if RNE:
        if DT == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def _scale(h, w, offset, X_DT: tl.constexpr, ROUND_FIRST: tl.constexpr, HAS_OFFSET: tl.constexpr,
           RNE: tl.constexpr):
    """The normalised h (fp32) times the weight, in the NormStyle's order, before the output's rounding:
    PLAIN rounds h to the input's dtype first; the others multiply in fp32, GEMMA by offset + weight."""
    if ROUND_FIRST:
        y = w.to(tl.float32) * _round(h, X_DT, RNE).to(tl.float32)
    elif HAS_OFFSET:
        y = h * (offset + w.to(tl.float32))
    else:
        y = w.to(tl.float32) * h
    return y


@triton.jit
def rows_or_shares(ptrs, mask, n_shares, s_xs, SHARES: tl.constexpr, XIN_DT: tl.constexpr, RNE: tl.constexpr):
    """The values at `ptrs` in fp32; SHARES: a split-K linear's n_shares fp32 partials there (`s_xs` apart,
    kernels/shares.py) summed in share order from zero and rounded to XIN_DT, as skinny's sum kernel does."""
    if SHARES:
        x = tl.zeros(mask.shape, tl.float32)
        for part in range(0, n_shares):
            x += tl.load(ptrs + part * s_xs, mask=mask, other=0.0)
        x = _round(x, XIN_DT, RNE).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(X, R, W, Y, S, n_cols, eps, offset, n_shares, s_xs, s_xr, s_xc, s_rr, s_rc, s_w, s_yr, s_sr,
                     HAS_RES: tl.constexpr, X_DT: tl.constexpr, ROUND_FIRST: tl.constexpr,
                     HAS_OFFSET: tl.constexpr, RNE: tl.constexpr, BLOCK: tl.constexpr,
                     SHARES: tl.constexpr = False, XIN_DT: tl.constexpr = tl.float32, PDL: tl.constexpr = False):
    """Program `row`: y = norm(x) (HAS_RES: s = residual + x written first, and y = norm(s)). SHARES: x is a
    split-K linear's n_shares fp32 partials (kernels/shares.py), summed here in share order and rounded
    to XIN_DT, as skinny's sum kernel does."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = rows_or_shares(X + row * s_xr + cols * s_xc, mask, n_shares, s_xs, SHARES, XIN_DT, RNE)
    if HAS_RES:
        r = tl.load(R + row * s_rr + cols * s_rc, mask=mask, other=0.0).to(tl.float32)
        s = _round(r + x, S.dtype.element_ty, RNE)
        tl.store(S + row * s_sr + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    h = x * (1.0 / tl.sqrt_rn(var + eps))
    w = tl.load(W + cols * s_w, mask=mask, other=0.0)
    y = _scale(h, w, offset, X_DT, ROUND_FIRST, HAS_OFFSET, RNE)
    tl.store(Y + row * s_yr + cols, _round(y, Y.dtype.element_ty, RNE), mask=mask)


@triton.jit
def _norm_rope(X, heads, s_h, s_d, hmask, d, c, s, W, s_w, eps, offset, D: tl.constexpr, ROT: tl.constexpr,
               HAS_NORM: tl.constexpr, ROUND_FIRST: tl.constexpr, HAS_OFFSET: tl.constexpr, X_DT: tl.constexpr,
               NORM_DT: tl.constexpr, ROT_DT: tl.constexpr, RNE: tl.constexpr):
    """Rows `heads` of one token's q or k ([BLOCK_H, BLOCK_D], fp32): per-head RMSNorm (HAS_NORM), then
    RoPE on the first ROT dimensions: x*cos + rotate_half(x)*sin, the partner of dimension i (i + ROT/2
    below ROT/2, i - ROT/2 above) loaded beside it and normed alike."""
    HALF = ROT // 2
    dmask = d < D
    rot = d < ROT
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    row = X + heads[:, None] * s_h
    x = tl.load(row + d[None, :] * s_d, mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :] * s_d, mask=hmask[:, None] & rot[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(W + d * s_w, mask=dmask, other=0.0)
        wp = tl.load(W + partner * s_w, mask=rot, other=0.0)
        x = _round(_scale(x * inv[:, None], w[None, :], offset, X_DT, ROUND_FIRST, HAS_OFFSET, RNE), NORM_DT,
                   RNE).to(tl.float32)
        xp = _round(_scale(xp * inv[:, None], wp[None, :], offset, X_DT, ROUND_FIRST, HAS_OFFSET, RNE), NORM_DT,
                    RNE).to(tl.float32)
    xp = tl.where((d < HALF)[None, :], -xp, xp)
    a = _round(x * c[None, :], ROT_DT, RNE).to(tl.float32)
    b = _round(xp * s[None, :], ROT_DT, RNE).to(tl.float32)
    y = _round(a + b, ROT_DT, RNE).to(tl.float32)
    return tl.where(rot[None, :], y, x)


@triton.jit
def _rope_store_kernel(Q, K, V, COS, SIN, KC, VC, SLOTS, QO, QW, KW,
                       n_q, n_kv, q_eps, k_eps, q_offset, k_offset,
                       s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_vt, s_vh, s_vd, s_ct, s_cd, s_st, s_sd,
                       s_kcs, s_kch, s_kcd, s_vcs, s_vch, s_vcd, s_slot, s_ot, s_oh, s_qw, s_kw,
                       D: tl.constexpr, DV: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_NORM: tl.constexpr,
                       Q_ROUND_FIRST: tl.constexpr, Q_OFFSET: tl.constexpr, K_ROUND_FIRST: tl.constexpr,
                       K_OFFSET: tl.constexpr, Q_NORM_DT: tl.constexpr, Q_ROT_DT: tl.constexpr,
                       K_NORM_DT: tl.constexpr, K_ROT_DT: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, j): the first cdiv(n_q, BLOCK_H) values of j take blocks of q heads (normed, rotated,
    written to QO); the rest take blocks of KV heads (k normed and rotated, k and v written to the cache
    row SLOTS[t])."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    n_qb = tl.cdiv(n_q, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rot = d < ROT
    c = tl.load(COS + t * s_ct + d * s_cd, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * s_st + d * s_sd, mask=rot, other=0.0).to(tl.float32)
    dmask = d < D
    if j < n_qb:
        heads = j * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < n_q
        y = _norm_rope(Q + t * s_qt, heads, s_qh, s_qd, hmask, d, c, s, QW, s_qw, q_eps, q_offset, D, ROT,
                       HAS_NORM, Q_ROUND_FIRST, Q_OFFSET, Q.dtype.element_ty, Q_NORM_DT, Q_ROT_DT, RNE)
        tl.store(QO + t * s_ot + heads[:, None] * s_oh + d[None, :], _round(y, QO.dtype.element_ty, RNE),
                 mask=hmask[:, None] & dmask[None, :])
    else:
        heads = (j - n_qb) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < n_kv
        y = _norm_rope(K + t * s_kt, heads, s_kh, s_kd, hmask, d, c, s, KW, s_kw, k_eps, k_offset, D, ROT,
                       HAS_NORM, K_ROUND_FIRST, K_OFFSET, K.dtype.element_ty, K_NORM_DT, K_ROT_DT, RNE)
        slot = tl.load(SLOTS + t * s_slot).to(tl.int64)
        tl.store(KC + slot * s_kcs + heads[:, None] * s_kch + d[None, :] * s_kcd, _round(y, KC.dtype.element_ty, RNE),
                 mask=hmask[:, None] & dmask[None, :])
        dv = tl.arange(0, BLOCK_DV)
        vmask = hmask[:, None] & (dv < DV)[None, :]
        v = tl.load(V + t * s_vt + heads[:, None] * s_vh + dv[None, :] * s_vd, mask=vmask, other=0.0)
        tl.store(VC + slot * s_vcs + heads[:, None] * s_vch + dv[None, :] * s_vcd,
                 _round(v.to(tl.float32), VC.dtype.element_ty, RNE), mask=vmask)


@triton.jit
def act_times(g, u, G_DT: tl.constexpr, Y_DT: tl.constexpr, GELU: tl.constexpr, RNE: tl.constexpr):
    """act(g) * u for g, u in fp32: act rounded to gate's dtype G_DT first (F.silu's and F.gelu's output),
    the product to Y_DT. GELU (tanh): 0.5 x (1 + tanh(z)) = x / (1 + exp(-2z)). Also the skinny linear's
    prologue (kernels/skinny.py), which so reads the same bits act_mul would have written."""
    if GELU:
        z = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = _round(a, G_DT, RNE).to(tl.float32)
    return _round(a * u, Y_DT, RNE)


@triton.jit
def _act_mul_kernel(G, U, Y, n_cols, s_gr, s_gc, s_ur, s_uc, s_yr, GELU: tl.constexpr, RNE: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, column tile): y = act(gate) * up (`act_times`)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * s_gr + cols * s_gc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * s_ur + cols * s_uc, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * s_yr + cols, act_times(g, u, G.dtype.element_ty, Y.dtype.element_ty, GELU, RNE), mask=mask)


# ------------------------------------------------------------------------------ the host side


def _launch_opts(elements: int) -> dict:
    """Warps for a program of `elements` values (about 8 a thread), and no fused multiply-adds (the
    reference's products are rounded before its sums). The interpreter takes neither."""
    if interpreting():
        return {}
    return {"num_warps": min(16, max(1, next_pow2(elements) // 256)), "enable_fp_fusion": False}


def _dtype(t: torch.Tensor) -> torch.dtype:
    if t.dtype not in _TL:
        raise ValueError(f"the Triton fused ops take fp32, bf16 and fp16 tensors, got {t.dtype}")
    return t.dtype


def _norm_out(x_dtype: torch.dtype, weight: torch.Tensor, style: NormStyle) -> torch.dtype:
    """The reference's output dtype: PLAIN's `weight * h.to(dtype)` promotes; the others cast to x's."""
    return torch.promote_types(x_dtype, _dtype(weight)) if style == PLAIN else x_dtype


def _style(style: NormStyle) -> dict:
    return {"ROUND_FIRST": not (style.cast_last or style.offset), "HAS_OFFSET": bool(style.offset)}


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as [rows, hidden] without a copy where its strides allow (a view of a wider GEMM output keeps
    its row stride)."""
    if x.dim() == 2:
        return x
    if x.dim() == 0:
        raise ValueError(f"{name}: x must have a last dimension, got a scalar")
    return x.reshape(-1, x.shape[-1])


def _norm(x, residual, weight, eps, style: NormStyle, name: str):
    """x a tensor, or a linear's unsummed Shares [rows, hidden] (summed as they are loaded)."""
    shares = x.parts if isinstance(x, Shares) else None
    _dtype(x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight {list(weight.shape)} does not fit x {list(x.shape)} (need [hidden])")
    x2 = _rows(x, name) if shares is None else shares[0]
    n_rows, n_cols = x2.shape
    y = torch.empty(x.shape, dtype=_norm_out(x.dtype, weight, style), device=x.device)
    s = r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"{name}: residual {list(residual.shape)} and x {list(x.shape)} differ")
        s = torch.empty(x.shape, dtype=torch.promote_types(_dtype(residual), x.dtype), device=x.device)
        r2 = _rows(residual, name)
    if n_rows == 0 or n_cols == 0:
        return y, s
    block = next_pow2(n_cols)
    y2, s2 = y.view(n_rows, n_cols), (s.view(n_rows, n_cols) if s is not None else y.view(n_rows, n_cols))
    r2 = r2 if r2 is not None else x2
    src = x2 if shares is None else shares
    _rms_norm_kernel[(n_rows,)](
        src, r2, weight, y2, s2, n_cols, float(eps), float(style.offset), 1 if shares is None else shares.shape[0],
        0 if shares is None else shares.stride(0), *x2.stride(), *r2.stride(),
        weight.stride(0), y2.stride(0), s2.stride(0), HAS_RES=residual is not None,
        X_DT=_TL[s.dtype if s is not None else x.dtype], RNE=interpreting(), BLOCK=block, **_style(style),
        SHARES=shares is not None, XIN_DT=_TL[x.dtype], **_launch_opts(block), **launch(x2))
    return y, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: NormStyle = PLAIN) -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape; a 2-D x is read through its strides; a
    linear's Shares summed as they are read)."""
    return _norm(x, None, weight, eps, style, "rms_norm")[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 style: NormStyle = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one pass: x and residual read once, both outputs written
    once (x may be a linear's Shares: summed as they are read)."""
    return _norm(x, residual, weight, eps, style, "add_rms_norm")


def _rope_dtypes(x: torch.Tensor, norm, cos: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The reference's dtypes for x: after its norm (`reference_rms_norm`'s output) and after RoPE
    (`part * cos` promotes)."""
    normed = x.dtype if norm is None else _norm_out(x.dtype, norm[0], norm[2])
    return normed, torch.promote_types(normed, _dtype(cos))


def _check_rope(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"rope_store needs q [T,H,D], k [T,KVH,D], v [T,KVH,Dv]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    T, _, D = q.shape
    if k.shape[0] != T or v.shape[0] != T or k.shape[2] != D or v.shape[1] != k.shape[1]:
        raise ValueError(f"rope_store: q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} do not fit "
                         f"(same tokens, same head dim for q and k, as many v heads as k heads)")
    if k_cache.dim() != 3 or v_cache.dim() != 3 or list(k_cache.shape[1:]) != list(k.shape[1:]) \
            or list(v_cache.shape[1:]) != list(v.shape[1:]):
        raise ValueError(f"rope_store: caches {list(k_cache.shape)}, {list(v_cache.shape)} do not fit k "
                         f"{list(k.shape)}, v {list(v.shape)} (need [slots, KVH, D] and [slots, KVH, Dv])")
    r = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != T or not 0 < r <= D or r % 2:
        raise ValueError(f"rope_store: cos {list(cos.shape)} and sin {list(sin.shape)} must be [T={T}, r] "
                         f"with r even and 0 < r <= D={D}")
    if slots.shape != (T,) or slots.is_floating_point():
        raise ValueError(f"rope_store: slots must be an int tensor [T={T}], got {slots.dtype} {list(slots.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_store: q_norm and k_norm go together (both or neither)")
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is not None and (norm[0].dim() != 1 or norm[0].shape[0] != D):
            raise ValueError(f"rope_store: {name}'s weight {list(norm[0].shape)} must be [D={D}]")
    for t in (q, k, v, k_cache, v_cache):
        _dtype(t)


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm=None, k_norm=None) -> torch.Tensor:
    """q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] (views of one q/k/v GEMM output are read through their
    strides); cos/sin [T, r], r <= D even; caches [slots, KVH, D|Dv]; slots [T] int, each a row of the
    caches; q_norm/k_norm: None or (weight [D], eps, NormStyle). One launch: returns the normed and
    rotated q (a new tensor), writes the normed and rotated k and v to the cache rows `slots`."""
    _check_rope(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm, k_norm)
    T, H, D = q.shape
    KVH, DV = k.shape[1], v.shape[2]
    q_norm_dt, q_rot_dt = _rope_dtypes(q, q_norm, cos)
    k_norm_dt, k_rot_dt = _rope_dtypes(k, k_norm, cos)
    out = torch.empty(T, H, D, dtype=q_rot_dt, device=q.device)
    if T == 0:
        return out
    has_norm = q_norm is not None
    qw, q_eps, q_style = q_norm if has_norm else (cos, 0.0, PLAIN)  # cos: a pointer never read
    kw, k_eps, k_style = k_norm if has_norm else (cos, 0.0, PLAIN)
    qs, ks = _style(q_style), _style(k_style)
    block_d, block_dv = next_pow2(D), next_pow2(DV)
    # ~512 values a program (4 heads of 128 dims): at batch 1, Qwen3-1.7B's 24 heads in 6 programs
    block_h = max(1, min(next_pow2(max(H, KVH)), 512 // block_d))
    grid = (T, cdiv(H, block_h) + cdiv(KVH, block_h))
    _rope_store_kernel[grid](
        q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw,
        H, KVH, float(q_eps), float(k_eps), float(q_style.offset), float(k_style.offset),
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *k_cache.stride(), *v_cache.stride(),
        slots.stride(0), out.stride(0), out.stride(1), qw.stride(0), kw.stride(0),
        D=D, DV=DV, ROT=cos.shape[-1], BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv, HAS_NORM=has_norm,
        Q_ROUND_FIRST=qs["ROUND_FIRST"], Q_OFFSET=qs["HAS_OFFSET"], K_ROUND_FIRST=ks["ROUND_FIRST"],
        K_OFFSET=ks["HAS_OFFSET"], Q_NORM_DT=_TL[q_norm_dt], Q_ROT_DT=_TL[q_rot_dt], K_NORM_DT=_TL[k_norm_dt],
        K_ROT_DT=_TL[k_rot_dt], RNE=interpreting(), **_launch_opts(block_h * max(block_d, block_dv)), **launch(q))
    return out


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate/up [rows, I] (any leading shape; 2-D views, e.g. the halves of one gate/up
    GEMM output, are read through their strides); act one of ACTS."""
    if act not in ACTS:
        raise ValueError(f"act_mul: act must be one of {', '.join(ACTS)}, got {act!r}")
    if gate.shape != up.shape:
        raise ValueError(f"act_mul: gate {list(gate.shape)} and up {list(up.shape)} differ")
    y = torch.empty(gate.shape, dtype=torch.promote_types(_dtype(gate), _dtype(up)), device=gate.device)
    g2, u2 = _rows(gate, "act_mul"), _rows(up, "act_mul")
    n_rows, n_cols = g2.shape
    if n_rows == 0 or n_cols == 0:
        return y
    y2 = y.view(n_rows, n_cols)
    # tiles of 1,024 columns: Qwen3-1.7B's 6,144 in 6 programs a row
    block = min(next_pow2(n_cols), 1024)
    _act_mul_kernel[(n_rows, cdiv(n_cols, block))](
        g2, u2, y2, n_cols, *g2.stride(), *u2.stride(), y2.stride(0), GELU=act == "gelu_tanh",
        RNE=interpreting(), BLOCK=block, **_launch_opts(block), **launch(g2))
    return y
