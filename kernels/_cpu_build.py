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

import logging
import os
import threading

import torch

log = logging.getLogger("svrmad_local")

ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                                    "-mavx512dq"]}


def isa() -> str:
    """torch's view of this CPU: "avx2", "avx512", "default" (no AVX2), ..."""
    return torch.backends.cpu.get_cpu_capability().lower()


def build(name: str, source: str, functions: list[str], extra_cflags: tuple[str, ...] = ()):
    """The compiled module `{name}_{isa}`; raises whatever the toolchain raises (no compiler, no ninja...)."""
    from torch.utils.cpp_extension import load_inline

    omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return load_inline(name=f"{name}_{isa()}", cpp_sources=[source], functions=functions,
                       extra_cflags=["-O3", "-fopenmp-simd", *omp, *ISA_FLAGS.get(isa(), []), *extra_cflags], extra_ldflags=omp,
                       verbose=False)


class Kernel:
    """One compiled kernel module, built on first use by any thread, once; a failed build is
    remembered with its reason (said once at info level) and the caller keeps its fallback path.
    `env_off`: an environment variable that, set to 0, turns the kernel off."""

    def __init__(self, name: str, source: str, functions: list[str], env_off: str, what: str,
                 needs_avx2: bool = False, extra_cflags: tuple[str, ...] = ()):
        self.name, self.source, self.functions, self.extra_cflags = name, source, functions, tuple(extra_cflags)
        self.env_off, self.what, self.needs_avx2 = env_off, what, needs_avx2
        self._lock = threading.Lock()
        self._module = None
        self.error: str | None = None

    def load(self):
        with self._lock:
            if self._module is None and self.error is None:
                if self.needs_avx2 and isa() not in ("avx2", "avx512"):
                    self.error = f"this CPU has no AVX2/FMA (torch sees {isa()})"
                else:
                    try:
                        self._module = build(self.name, self.source, self.functions, self.extra_cflags)
                    except Exception as exc:  # no compiler, no ninja, a read-only cache...
                        self.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                if self.error:
                    log.info("%s unavailable (%s)", self.what, self.error)
        return self._module

    def off(self) -> bool:
        return os.environ.get(self.env_off, "1") == "0"

    def available(self) -> bool:
        """Compiles on first call (seconds; cached across processes)."""
        return not self.off() and self.load() is not None

    def unavailable_reason(self) -> str | None:
        return f"{self.env_off}=0" if self.off() else self.error

    def module(self):
        """The compiled module, or a RuntimeError saying why there is none (no lock once built: every
        linear of every step comes through here)."""
        mod = self._module or self.load()
        if mod is None:
            raise RuntimeError(f"the {self.what} could not be built: {self.error}")
        return mod
