"""A decode step's dense layers in one compiled call on the CPU (csrc/cpu_stack.cpp): engine/decoder.py's
layer loop for Llama-shaped layers, over the same kernels (the panel linears, the fused ops, the paged
decode attention), called in the same order on the same tensors, so a step computes the loop's bits.

Why: at batch 1 a layer is ~9 kernel calls, and each call from Python costs microseconds of argument
parsing, views and closures that the kernel itself does not. On a 2-core Xeon with AMX a bf16 decode
step of the default spent about a third of its time around its kernels (docs/engine.md, "Decode
layers in one call").

The compiled module reaches the other kernels through their addresses (each module's `addresses`), so
each kernel exists once, with the settings the engine gave it. It is built where those three are built;
SVRMAD_CPU_STACK=0 turns it off (the loop runs each layer from Python, the same bits).
"""

from __future__ import annotations

import torch

from . import cpu_decode, cpu_linear, cpu_ops
from ._backend import choose
from ._cpu_build import Kernel

NAME = "cpu_stack"  # its name for _backend.choose
_KERNEL = Kernel(NAME, "cpu_stack.cpp", "SVRMAD_CPU_STACK", "decode layers in one call")


def available() -> bool:
    """Compiles on first call (seconds; cached across processes), and the kernels it calls too."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the layers run one by one from Python (None where this runs): it is off or not built, or a
    kernel it calls is (named)."""
    why = choose("auto", "cpu", NAME).why
    if why is not None:
        return why
    for name in (cpu_linear.NAME, cpu_ops.NAME, cpu_decode.NAME):
        why = choose("auto", "cpu", name).why
        if why is not None:
            return f"{name}: {why}"
    return None


def new_stack(dtype: torch.dtype, final_norm: tuple[torch.Tensor, float]):
    """An empty Stack (layers come by `add_layer`) over the kernels of this process, ending in the final
    norm (weight, eps)."""
    addresses = [*cpu_linear._KERNEL.module().addresses(), *cpu_ops._KERNEL.module().addresses(),
                 *cpu_decode._KERNEL.module().addresses()]
    return _KERNEL.module().Stack(addresses, cpu_linear.KBLOCK, cpu_linear.ROW_WIDTH, cpu_ops._VEC[dtype], *final_norm)
