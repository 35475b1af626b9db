"""A split-K linear's output left unsummed, for the add + RMSNorm that reads it next to sum.

Why: a skinny linear whose K is split over several programs a strip (kernels/skinny.py) writes fp32
partials and then launches a second small kernel that sums them in share order and casts. A decode
layer's o_proj and down projection feed nothing but the next add + RMSNorm, which reads the row anyway,
so that norm sums the partials as it loads them: one launch a linear fewer, and the summed row is never
written and read back.

Exactness: the consumer sums the shares in share order in fp32 from zero and rounds to the linear's
dtype, then goes on as with the summed tensor: the same operations on the same operands as the sum
kernel followed by the norm, so the same bits.
"""
from __future__ import annotations

import torch


class Shares:
    """fp32 partials [S, M, N] of a linear's [M, N] output in `dtype` (no bias: a bias is added after the
    sum, in the sum kernel)."""

    __slots__ = ("parts", "dtype")

    def __init__(self, parts: torch.Tensor, dtype: torch.dtype):
        if parts.dim() != 3 or parts.dtype != torch.float32:
            raise ValueError(f"Shares: the partials must be fp32 [shares, rows, columns], got "
                             f"{parts.dtype} {list(parts.shape)}")
        self.parts, self.dtype = parts, dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.parts.device

    def total(self) -> torch.Tensor:
        """The [M, N] output: the shares summed in order from zero in fp32, rounded to `dtype` (what the
        sum kernel writes)."""
        acc = torch.zeros_like(self.parts[0])
        for part in self.parts:
            acc += part
        return acc.to(self.dtype)


def summed(x):
    """x itself, or the output a Shares stands for (an implementation that does not sum them itself)."""
    return x.total() if isinstance(x, Shares) else x
