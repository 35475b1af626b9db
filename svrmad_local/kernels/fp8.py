"""FP8 e4m3 weights with block scales, as DeepSeek-V3 publishes them: a torch reference.

``weight`` float8_e4m3fn [..., out, in]; ``scale_inv`` [..., ceil(out/b0), ceil(in/b1)] (fp32, or
e8m0), one scale per block of ``block = (b0, b1)``; the real weight is ``weight * scale_inv`` of its
block. Edges that are not whole blocks are partial blocks with a scale of their own (DeepSeek's
``kv_a_proj_with_mqa`` has 576 rows, 4.5 blocks of 128). Dequantizing multiplies in fp32 (exact up to
one fp32 rounding, as DeepSeek's own reference does) and then casts to the dtype asked for.

:func:`fp8_matmul` computes ``x @ W.T (+ bias)``: on the torch path it dequantizes one slice of
block-rows at a time; on a GPU it calls the Triton kernel of quant_triton.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import cdiv
from ._quant_common import row_chunks, run_triton, triton_fn

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)


def scale_grid(shape, block) -> tuple[int, int]:
    """The scale grid of a [.., out, in] weight: ceil(out/b0) x ceil(in/b1)."""
    return cdiv(shape[-2], block[0]), cdiv(shape[-1], block[1])


def check_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block, name: str = "weight") -> None:
    """ValueError naming `name` unless weight/scale_inv pair up for `block`."""
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"{name}: FP8 weight must be a matrix, got shape {list(weight.shape)}")
    want = (*weight.shape[:-2], *scale_grid(weight.shape, block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}: weight_scale_inv has shape {list(scale_inv.shape)}, but a weight "
                         f"{list(weight.shape)} in blocks of {list(block)} needs {list(want)}")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., out, in] e4m3 + [..., ceil(out/b0), ceil(in/b1)] scales -> [..., out, in] in `dtype`."""
    check_fp8(weight, scale_inv, block)
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
               bias: torch.Tensor | None = None, kernel_impl: str = "auto") -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) with W [N, K] in e4m3 and its block scales."""
    check_fp8(weight, scale_inv, block)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_matmul: x {list(x.shape)} against W {list(weight.shape)}")
    block = tuple(int(b) for b in block)
    fn = triton_fn("fp8_matmul", kernel_impl, x.device)
    if fn is not None:
        out = run_triton("fp8_matmul", kernel_impl, fn, x, weight, scale_inv, block, bias)
        if out is not None:
            return out
    rows, cols = weight.shape
    parts = []
    for r0, r1 in row_chunks(rows, cols, block[0]):  # r0 is on a block boundary
        w = dequantize_fp8(weight[r0:r1], scale_inv[r0 // block[0]:cdiv(r1, block[0])], block, x.dtype)
        parts.append(F.linear(x, w, None if bias is None else bias[r0:r1].to(x.dtype)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
