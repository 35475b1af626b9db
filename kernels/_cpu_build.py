"""Compiling the engine's small C++ CPU kernels, once, the same way for each.

torch.utils.cpp_extension builds on first use and caches under ~/.cache/torch_extensions (nothing is
downloaded). A kernel is built per ISA level, never with -march=native: the cache may outlive the
machine it was built on, and a build for another CPU's features would die on an illegal instruction.
-fopenmp: at::parallel_for is an inline OpenMP region in torch's headers; built without it the pragma
is ignored and the kernel runs on one thread (measured: 2 threads = 1). It links libgomp.so.1, which
the loader resolves to the copy torch already loaded (same soname): one OpenMP runtime, the engine
worker's one team (docs/engine.md).
"""

from __future__ import annotations

import torch

ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                                    "-mavx512dq"]}


def isa() -> str:
    """torch's view of this CPU: "avx2", "avx512", "default" (no AVX2), ..."""
    return torch.backends.cpu.get_cpu_capability().lower()


def build(name: str, source: str, functions: list[str]):
    """The compiled module `{name}_{isa}`; raises whatever the toolchain raises (no compiler, no ninja...)."""
    from torch.utils.cpp_extension import load_inline

    omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return load_inline(name=f"{name}_{isa()}", cpp_sources=[source], functions=functions,
                       extra_cflags=["-O3", "-fopenmp-simd", *omp, *ISA_FLAGS.get(isa(), [])], extra_ldflags=omp,
                       verbose=False)
