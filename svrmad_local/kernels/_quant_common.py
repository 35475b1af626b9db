"""What the MXFP4 and FP8 matmuls share: the guarded hand-off to the Triton kernels in quant_triton.py.

quant_triton.py is optional (written separately, and triton itself is optional): under
``kernel_impl="auto"`` a missing or failing Triton path serves the call from the torch reference
(once warned, via ``disable_auto``); an explicit ``kernel_impl="triton"`` raises instead.
"""
from __future__ import annotations

from ._backend import disable_auto, fall_back, resolve_impl

# Largest weight slice (elements) the torch path dequantizes at once: one expert or one matrix is
# usually smaller; larger ones go block-row by block-row, so no call ever holds a dense model.
MAX_DENSE_ELEMENTS = 1 << 25


def triton_fn(name: str, kernel_impl: str, device):
    """The Triton function `name` from quant_triton when the call should take it, else None."""
    if resolve_impl(kernel_impl, device, name) != "triton":
        return None
    try:
        from . import quant_triton
        return getattr(quant_triton, name + "_triton")
    except (ImportError, AttributeError) as exc:
        if kernel_impl == "triton":
            raise RuntimeError(f"kernel_impl='triton' asked for {name}, but kernels/quant_triton.py cannot "
                               f"provide it: {exc}") from exc
        disable_auto(name, exc)
        return None


def run_triton(name: str, kernel_impl: str, fn, *args):
    """Call the Triton path; under "auto" a failure falls back (returns None) instead of stopping a run,
    except while a CUDA graph is captured (``fall_back``)."""
    try:
        return fn(*args)
    except Exception as exc:  # a compile error on an untested GPU, say (re-raised while capturing a graph)
        fall_back(name, exc, kernel_impl)
        return None


def row_chunks(rows: int, cols: int, step: int):
    """(start, stop) row ranges, multiples of `step` rows, each at most MAX_DENSE_ELEMENTS large."""
    per = max(step, (MAX_DENSE_ELEMENTS // max(cols, 1)) // step * step)
    for r0 in range(0, rows, per):
        yield r0, min(rows, r0 + per)
