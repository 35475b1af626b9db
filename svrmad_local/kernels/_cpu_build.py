"""Compiling the engine's small C++ CPU kernels, once, the same way for each.

Their sources are real files in csrc/ (one .cpp a kernel, each ending in its PYBIND11_MODULE, and the
SIMD helpers they share in simd.h), shipped as package data. torch.utils.cpp_extension.load builds a
kernel on first use and caches it under ~/.cache/torch_extensions (nothing is downloaded). The build's
name carries a digest of every csrc file and of the flags, so an edit (a header's too) is a new build,
never a stale one loaded; a failed build is said with the first compiler error's real file and line.
A kernel is built per ISA level, never with -march=native: the cache may outlive the machine it was
built on, and a build for another CPU's features would die on an illegal instruction.
-fopenmp: at::parallel_for is an inline OpenMP region in torch's headers; built without it the pragma
is ignored and the kernel runs on one thread (measured: 2 threads = 1). It links libgomp.so.1, which
the loader resolves to the copy torch already loaded (same soname): one OpenMP runtime, the engine
worker's one team (docs/engine.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sysconfig
import threading
import warnings
from pathlib import Path

import torch

from . import _backend

log = logging.getLogger("svrmad_local")

ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                                    "-mavx512dq"]}


CSRC = Path(__file__).resolve().parent / "csrc"
CXX_STD = "-std=c++20"  # what torch's extension builder passes (torch 2.13); the compile-only check uses it too


def isa() -> str:
    """torch's view of this CPU: "avx2", "avx512", "default" (no AVX2), ..."""
    return torch.backends.cpu.get_cpu_capability().lower()


class KernelBuildWarning(UserWarning):
    """A kernel did not build: the engine runs torch's own ops instead (same tokens, slower)."""


_KERNELS: list["Kernel"] = []  # every kernel defined, for the one line that names them all
_SAID: set[str] = set()  # the build failures already said (one line per cause, not per kernel)
INSTEAD = "torch's own CPU ops run instead (same tokens, slower)"


def compiler() -> str | None:
    """The C++ compiler torch's extension builder would call ($CXX, else c++), if it is on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(message, KernelBuildWarning, stacklevel=3)


def cflags(extra: tuple[str, ...] = ()) -> list[str]:
    """The flags every kernel is compiled with on this machine, after torch's own (the build and the
    compile-only check share them)."""
    omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return ["-O3", "-fopenmp-simd", *omp, *ISA_FLAGS.get(isa(), []), *extra]


def digest(source: Path, flags: list[str]) -> str:
    """A short hash of the kernel's file, every header of csrc/ and the flags: the build's cache key."""
    h = hashlib.sha256()
    for path in [source, *sorted(CSRC.glob("*.h"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:12]


ERROR_LINE = re.compile(r"^(?P<where>[^\s:][^:\n]*:\d+(?::\d+)?): (?:fatal )?error: (?P<what>.*)$", re.M)


def first_error(output: str) -> str | None:
    """'file:line:col: error: what' of the first error in a compiler's output, or None."""
    m = ERROR_LINE.search(output)
    return f"{m['where']}: error: {m['what'].strip()}" if m else None


def build(name: str, source: Path, extra_cflags: tuple[str, ...] = ()):
    """The compiled module `svrmad_{name}_{isa}_{digest}` of one csrc file; raises whatever the toolchain raises
    (no compiler, no ninja, a compile error...)."""
    from torch.utils.cpp_extension import load

    flags = cflags(extra_cflags)
    omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its compiler banners: our one line says what matters
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return load(name=f"svrmad_{name}_{isa()}_{digest(source, flags)}", sources=[str(source)], extra_cflags=flags,
                    extra_ldflags=omp, extra_include_paths=[str(CSRC)], verbose=False)
    finally:
        quiet.setLevel(level)


def check_syntax(source: Path, extra_cflags: tuple[str, ...] = ()) -> str | None:
    """Compiles `source` with -fsyntax-only and the flags, includes and defines a build uses (nothing is
    written): None where it compiles, else the first error's 'file:line: error: ...' (the whole output
    where no line names one). For the suite's compile-only check."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    cmd = [compiler() or "c++", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=svrmad_syntax_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{CSRC}", *(f"-isystem{p}" for p in includes), "-fPIC", CXX_STD,
           *cflags(extra_cflags), str(source)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode == 0:
        return None
    return first_error(out.stderr) or out.stderr.strip() or f"{cmd[0]} exited {out.returncode}"


class Kernel:
    """One compiled kernel module, from one csrc file (a name there, or a path), built on first use by
    any thread, once; a failed build is remembered with its reason and the caller keeps its fallback
    path. A build that could not run or failed is said in one svrmad warning line (which kernels, why,
    what runs instead, how to get them; one line for all kernels when the cause is the same, e.g. no
    compiler); a CPU without AVX2 is said at info level (nothing to fix). `env_off`: an environment
    variable that, set to 0, turns the kernel off. It registers as `name` with _backend.choose, the
    selector every kernel goes through."""

    def __init__(self, name: str, source: str | Path, env_off: str, what: str, needs_avx2: bool = False,
                 extra_cflags: tuple[str, ...] = ()):
        self.name, self.source, self.extra_cflags = name, CSRC / source, tuple(extra_cflags)
        self.env_off, self.what, self.needs_avx2 = env_off, what, needs_avx2
        self._lock = threading.Lock()
        self._module = None
        self.error: str | None = None
        _KERNELS.append(self)
        _backend.register_cpu(name, self.why_not)

    def digest(self) -> str:
        """The build's cache key (its file, csrc/'s headers, the flags): changes when its code does."""
        return digest(self.source, cflags(self.extra_cflags))

    def load(self):
        with self._lock:
            if self._module is None and self.error is None:
                if self.needs_avx2 and isa() not in ("avx2", "avx512"):
                    self.error = f"this CPU has no AVX2/FMA (torch sees {isa()})"
                    log.info("%s unavailable (%s)", self.what, self.error)
                else:
                    try:  # without a compiler too: a build cached by an earlier run may still load
                        self._module = build(self.name, self.source, self.extra_cflags)
                    except Exception as exc:  # no compiler, no ninja, a read-only cache, a compile error...
                        self._failed(exc)
        return self._module

    def _failed(self, exc: Exception) -> None:
        if compiler() is None:
            self.error = f"no C++ compiler ({os.environ.get('CXX', 'c++')} is not on PATH)"
            names = ", ".join(k.what for k in _KERNELS if not k.off())
            _say_once("compiler", f"{self.error}: the CPU kernels ({names}) are not built and {INSTEAD}; install "
                                  "one (e.g. apt install g++, or set CXX) to build them on the next run")
        else:
            where = first_error(str(exc))  # torch's message carries the compiler's output
            self.error = where or f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            _say_once(self.name, f"the {self.what} did not build ({self.error}); {INSTEAD}")

    def off(self) -> bool:
        return os.environ.get(self.env_off, "1") == "0"

    def why_not(self) -> str | None:
        """None where the compiled module is there (built on first call: seconds, cached across
        processes), else why not; what _backend.choose asks."""
        if self.off():
            return f"{self.env_off}=0"
        return None if self.load() is not None else self.error

    def module(self):
        """The compiled module, or a RuntimeError saying why there is none (no lock once built: every
        linear of every step comes through here)."""
        mod = self._module or self.load()
        if mod is None:
            raise RuntimeError(f"the {self.what} could not be built: {self.error}")
        return mod
