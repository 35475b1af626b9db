"""Triton kernels of the decoder's fused ops (kernels/fused.py): the same four calls, the same arguments.

- `rms_norm` / `add_rms_norm`: one program a row; the residual sum rounded to the activations' dtype as
  torch's add is, the squares summed in fp32, each style's weight and cast in its order.
- `rope_store`: one program per (token, head) of q and k: the optional q/k norm, RoPE (rotate_half's
  pairing, the first r dims of a head where the rotary is partial), the rotated k and the v written to the
  token's cache slot; q returned.
- `act_mul`: act(gate) * up over [T, I] tiles, act SiLU or GELU (tanh).

Every product and sum is rounded to the activations' dtype where transformers' bf16 ops round (to nearest
even, by hand: Triton's interpreter truncates a cast to bf16, a GPU rounds; by hand both compute the same
bits), and the kernels are compiled without FMA contraction (`enable_fp_fusion=False`): RoPE, the residual
add and the cache writes are then bitwise the torch reference; the norms (a tree sum) and the activations
(exp) are within rounding. tests/test_fused.py holds each to its reference under Triton's interpreter.
"""

from __future__ import annotations

import torch

from ._backend import next_pow2, tl, triton
from .fused import PLAIN, NormStyle

_NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _round(x, ty: tl.constexpr):
    """fp32 values rounded to dtype `ty` (to nearest, ties to even), returned as fp32."""
    if ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif ty == tl.float32:
        return x
    else:
        return x.to(ty).to(tl.float32)


@triton.jit
def _style(h, w, out_ty: tl.constexpr, OFFSET: tl.constexpr, CAST_LAST: tl.constexpr):
    """A normalised fp32 row h times its weight w (fp32), rounded as the style rounds; returns fp32 values
    of the output dtype."""
    if OFFSET:
        y = h * (1.0 + w)
    elif CAST_LAST:
        y = w * h
    else:
        y = w * _round(h, out_ty)
    return _round(y, out_ty)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, H, sx, sr, sy, ss, eps,
                     ADD: tl.constexpr, OFFSET: tl.constexpr, CAST_LAST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:  # residual + x, rounded to the activations' dtype as torch's add is
        r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0).to(tl.float32)
        x = _round(r + x, s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * ss + cols, x.to(s_ptr.dtype.element_ty), mask=m)
    var = tl.sum(x * x, axis=0) / H
    h = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = _style(h, w, y_ptr.dtype.element_ty, OFFSET, CAST_LAST)
    tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, style: NormStyle) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype) if style == PLAIN else x.dtype


def _norm(x, residual, weight, eps, style):
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=_out_dtype(x, weight, style), device=x.device)
    s, r = x2, x2
    if residual is not None:
        r = residual.reshape(-1, h)
        r = r if r.stride(-1) == 1 else r.contiguous()
        s = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r, weight, y, s, h, x2.stride(0), r.stride(0), y.stride(0), s.stride(0),
                                         float(eps), ADD=residual is not None, OFFSET=bool(style.offset),
                                         CAST_LAST=style.cast_last, BLOCK=next_pow2(h), **_NO_FMA)
    return y.view(*x.shape[:-1], h), s.view(*x.shape[:-1], h)


def rms_norm(x, weight, eps, style: NormStyle = PLAIN):
    return _norm(x, None, weight, eps, style)[0]


def add_rms_norm(x, residual, weight, eps, style: NormStyle = PLAIN):
    return _norm(x, residual, weight, eps, style)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, o_ptr, qw_ptr, kw_ptr,
                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sc_t, skc_s, skc_h, svc_s, svc_h, so_t, so_h,
                 H, D, R, DV, eps_q, eps_k,
                 NORM: tl.constexpr, OFFSET: tl.constexpr, CAST_LAST: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    md = d < D
    half = R // 2
    partner = tl.where(d < half, d + half, tl.where(d < R, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    ty = q_ptr.dtype.element_ty
    if h < H:
        src, w_ptr, eps = q_ptr + t * sq_t + h * sq_h, qw_ptr, eps_q
    else:
        src, w_ptr, eps = k_ptr + t * sk_t + (h - H) * sk_h, kw_ptr, eps_k
    x = tl.load(src + d, mask=md, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=md, other=0.0).to(tl.float32)
    if NORM:  # the head's q/k norm first, each value rounded as the norm module rounds it
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = _style(x * inv, tl.load(w_ptr + d, mask=md, other=0.0).to(tl.float32), ty, OFFSET, CAST_LAST)
        xp = _style(xp * inv, tl.load(w_ptr + partner, mask=md, other=0.0).to(tl.float32), ty, OFFSET, CAST_LAST)
    mr = d < R
    c = tl.load(cos_ptr + t * sc_t + d, mask=mr, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * sc_t + d, mask=mr, other=0.0).to(tl.float32)
    a = _round(x * c, ty)
    b = _round((sign * xp) * s, ty)
    out = tl.where(mr, _round(a + b, ty), x)
    if h < H:
        tl.store(o_ptr + t * so_t + h * so_h + d, out.to(o_ptr.dtype.element_ty), mask=md)
    else:
        slot = tl.load(slot_ptr + t)
        tl.store(kc_ptr + slot * skc_s + (h - H) * skc_h + d, out.to(kc_ptr.dtype.element_ty), mask=md)
        dv = tl.arange(0, BLOCK_V)
        vals = tl.load(v_ptr + t * sv_t + (h - H) * sv_h + dv, mask=dv < DV, other=0.0)
        tl.store(vc_ptr + slot * svc_s + (h - H) * svc_h + dv, vals.to(vc_ptr.dtype.element_ty), mask=dv < DV)


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm=None, k_norm=None):
    T, H, D = q.shape
    KVH, DV, R = k.shape[1], v.shape[2], cos.shape[-1]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if min(q.stride(2), k.stride(2), v.stride(2)) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        q, k, v, cos, sin = (t.contiguous() for t in (q, k, v, cos, sin))
    qw, eq, style = q_norm if q_norm is not None else (cos, 0.0, PLAIN)
    kw, ek, _ = k_norm if k_norm is not None else (cos, 0.0, PLAIN)
    _rope_kernel[(T, H + KVH)](
        q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        H, D, R, DV, float(eq), float(ek), NORM=q_norm is not None, OFFSET=bool(style.offset),
        CAST_LAST=style.cast_last, BLOCK_D=next_pow2(D), BLOCK_V=next_pow2(DV), **_NO_FMA)
    return out


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, y_ptr, N, sg, su, sy, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < N
    ty = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:
        a = g / (1.0 + tl.exp(-g))
    y = _round(_round(a, ty) * u, ty)
    tl.store(y_ptr + row * sy + cols, y.to(ty), mask=m)


def act_mul(gate, up, act: str = "silu"):
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    y = torch.empty(g.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    block = min(1024, next_pow2(n))
    if g.shape[0]:
        _act_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, y, n, g.stride(0), u.stride(0), y.stride(0),
                                                            GELU=act == "gelu_tanh", BLOCK=block)
    return y.view(*gate.shape[:-1], n)


__all__ = ["rms_norm", "add_rms_norm", "rope_store", "act_mul"]
