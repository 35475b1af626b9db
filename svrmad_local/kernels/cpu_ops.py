"""The small fused ops of a Llama-shaped decoder layer on the CPU, fp32: RMSNorm (with the residual
add before it) and RoPE with the new K/V written to their cache slots.

Why: at decode these are ~20 tiny torch ops a layer, each ~5-20 us of dispatch on a 2-core EPYC for
a few hundred floats of work: transformers' RMSNorm alone took 86 us a call (8 ops) against ~3 us
here, 61 calls a step of the default.

Numerics:
- RoPE and the K/V copies are elementwise IEEE operations (x*cos, -x*sin, their sum; built with
  -ffp-contract=off, so no FMA fuses them): bitwise what transformers' `apply_rotary_pos_emb`
  computes. The residual add is one IEEE add: bitwise too.
- RMSNorm sums the squares in an order of its own (8 lanes, then the lanes in order, then the tail),
  so it differs from transformers' `pow(2).mean()` at fp32 rounding. That is why the engine swaps the
  model's norm modules for `engine.families.FastRMSNorm`, which calls this: the engine and any reference
  that runs the same model then compute the same bits. A row's result never depends on the other
  rows (batch-invariant).
"""

from __future__ import annotations

import torch

from ._backend import choose
from ._cpu_build import Kernel

NAME = "cpu_ops"  # its name for _backend.choose
DTYPES = (torch.float32,)  # the activation dtypes the compiled ops take; callers run a torch reference for others
_KERNEL = Kernel(NAME, "cpu_ops.cpp", "SVRMAD_CPU_OPS", "fused CPU decoder ops", needs_avx2=True,
                 extra_cflags=("-ffp-contract=off",))


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_OPS=0 turns it off."""
    return choose("auto", "cpu", NAME).impl == "cpp"


def unavailable_reason() -> str | None:
    """Why the torch path runs instead (None where the kernel does)."""
    return choose("auto", "cpu", NAME).why


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of an fp32 tensor of any leading shape."""
    h = x.shape[-1]
    return _KERNEL.module().rms_norm(x.reshape(-1, h).contiguous(), weight, eps).view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(residual + x), residual + x) for contiguous [rows, hidden] fp32 tensors."""
    return _KERNEL.module().add_rms_norm(x, residual, weight, eps)


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slots) -> torch.Tensor:
    """The rotated q [T, H, D]; the rotated k and v written to rows `slots` of the caches. See csrc/cpu_ops.cpp."""
    return _KERNEL.module().rope_store(q, k, v, cos, sin, k_cache, v_cache, slots)
