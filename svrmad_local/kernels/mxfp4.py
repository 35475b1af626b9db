"""MXFP4 (OCP microscaling FP4) as GPT-OSS publishes its MoE experts: a torch reference.

Layout: ``blocks`` uint8 [..., rows, cols/32, 16] holds two e2m1 codes a byte, the low nibble first;
``scales`` uint8 [..., rows, cols/32] holds one e8m0 exponent per 32 values, the scale 2^(s-127).
Rows are the output dimension. Every e2m1 value times a power of two is exact in fp32 and bf16
(one mantissa bit), so dequantizing is exact in any of our dtypes short of over/underflow.

:func:`mxfp4_matmul` computes ``x @ W.T (+ bias)`` straight from the packed bytes: on the torch path
it dequantizes one slice of block-rows at a time (one expert's matrix is one slice at GPT-OSS sizes);
on a GPU it calls the Triton kernel of quant_triton.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._quant_common import row_chunks, run_triton, triton_fn

# e2m1 codes 0..15: sign bit 3, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per e8m0 scale
BYTES = GROUP // 2


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> None:
    """ValueError naming `name` unless blocks/scales are the uint8 pair the layout above describes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                         f"(expected blocks [..., rows, cols/32, 16] and scales [..., rows, cols/32])")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[..., rows, cols/32, 16] codes + [..., rows, cols/32] exponents -> [..., rows, cols] in `dtype`."""
    check_mxfp4(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # low nibble first
    values = torch.ldexp(lut[codes.long()], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel_impl: str = "auto") -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) with W [N, K] given packed as blocks [N, K/32, 16], scales [N, K/32]."""
    check_mxfp4(blocks, scales)
    if blocks.dim() != 3 or x.shape[-1] != blocks.shape[1] * GROUP:
        raise ValueError(f"mxfp4_matmul: x {list(x.shape)} against packed W {list(blocks.shape)} "
                         f"(K = {blocks.shape[1] * GROUP})")
    fn = triton_fn("mxfp4_matmul", kernel_impl, x.device)
    if fn is not None:
        out = run_triton("mxfp4_matmul", kernel_impl, fn, x, blocks, scales, bias)
        if out is not None:
            return out
    rows, cols = blocks.shape[0], blocks.shape[1] * GROUP
    parts = [F.linear(x, dequantize_mxfp4(blocks[r0:r1], scales[r0:r1], x.dtype))
             for r0, r1 in row_chunks(rows, cols, 1)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias.to(x.dtype)  # added after the product, as GptOssExperts does
