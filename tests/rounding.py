"""The half-precision kernels' tolerance against their fp32-accumulating reference."""

from __future__ import annotations

import torch


def assert_one_rounding(got: torch.Tensor, ref: torch.Tensor, what) -> None:
    """`got` and `ref` both sum in fp32 and round once to `got`'s dtype, in different orders. Two orders
    differ by a few fp32 ulps of the products' scale, not of the result: where a sum cancels to near zero
    (|ref| ~ 1e-5 among outputs of ~1) that moves the rounding by more than the result's own ulp. So the
    bound is one ulp of the result plus the fp32 tests' allowance for the order, 1e-5 of the largest
    output; a wrong tile or a lost share is off by orders more."""
    ulp = ref.float().abs() * torch.finfo(got.dtype).eps
    order = 1e-5 * ref.float().abs().max()
    assert ((got.float() - ref.float()).abs() <= ulp + order).all(), what
