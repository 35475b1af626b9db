"""Compiling the engine's small C++ CPU kernels, once, the same way for each, in a way that cannot hang.

Their sources are real files in csrc/ (one .cpp a kernel, each ending in its PYBIND11_MODULE, and the
SIMD helpers they share in simd.h), shipped as package data. torch.utils.cpp_extension builds a
kernel on first use and caches it under ~/.cache/torch_extensions (nothing is downloaded). The build's
name carries a digest of everything that changes its output: every csrc file, the flags, and the
toolchain (the compiler and its version, the ninja on PATH and its version, torch, Python). So an edit
(a header's too) is a new build, never a stale one loaded, and two environments on one machine (a
venv's ninja against the system's) keep a build each instead of rebuilding each other's. A failed
build is said with the first compiler error's real file and line. A kernel is built per ISA level,
never with -march=native: the cache may outlive the machine it was built on, and a build for another
CPU's features would die on an illegal instruction.

-fopenmp: at::parallel_for is an inline OpenMP region in torch's headers; built without it the pragma
is ignored and the kernel runs on one thread (measured: 2 threads = 1). It links libgomp.so.1, which
the loader resolves to the copy torch already loaded (same soname): one OpenMP runtime, the engine
worker's one team (docs/engine.md).

A build cannot hang and can be stopped (docs/kernels.md, "Building the CPU kernels"):
- It runs in a child process of its own session (ninja and the compilers under it), which the caller
  kills when it is interrupted (Ctrl-C, or `cancel(thread)` when an engine closes), and which kills
  itself when the caller dies. A finished build leaves a mark beside its library; a marked library is
  imported directly, without ninja or any lock.
- torch's own build lock is a file whose existence is the lock, left behind by a build that was
  killed (SIGTERM, kill -9, the OOM killer), after which every later build waits for it forever. A
  build here first takes an advisory lock (`flock`, which the kernel drops when its holder dies, even by
  kill -9) on a file beside it; under that lock, torch's file is a dead build's and is removed, in
  one line. A lock held by a live process is waited on, in one line, for at most `WAIT_S` seconds,
  after which the kernel is left unbuilt (torch's own ops run instead).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
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
    """A kernel did not build: the engine runs torch's own ops instead (same tokens, slower); or what a
    build found and did about it (a dead build's lock removed, another process's build waited for)."""


class BuildInterrupted(KeyboardInterrupt):
    """The build was stopped (Ctrl-C, or the engine that asked for it closed): nothing is recorded as
    failed, and the next process builds it."""


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


@functools.lru_cache(maxsize=None)
def _version(path: str, mtime_ns: int) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        return next((line.strip() for line in (out.stdout or out.stderr).splitlines() if line.strip()), "")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unreadable ({type(exc).__name__})"


def _tool(path: str | None) -> str:
    """A build tool as it would run: where it really is, and what its --version says."""
    if path is None:
        return "none"
    real = os.path.realpath(path)
    return f"{real} {_version(real, os.stat(real).st_mtime_ns)}"


def toolchain() -> str:
    """What besides the sources and flags changes a build's output: the compiler torch's builder calls and
    the ninja it runs (each where it really is and its --version), torch and Python."""
    return (f"c++: {_tool(compiler())}; ninja: {_tool(shutil.which('ninja'))}; torch {torch.__version__}; "
            f"python {sys.version.split()[0]}")


def digest(source: Path, flags: list[str]) -> str:
    """A short hash of the kernel's file, every header of csrc/, the flags and the toolchain: the build's
    cache key."""
    h = hashlib.sha256()
    for path in [source, *sorted(CSRC.glob("*.h"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join(flags).encode() + b"\0" + toolchain().encode())
    return h.hexdigest()[:12]


ERROR_LINE = re.compile(r"^(?P<where>[^\s:][^:\n]*:\d+(?::\d+)?): (?:fatal )?error: (?P<what>.*)$", re.M)


def first_error(output: str) -> str | None:
    """'file:line:col: error: what' of the first error in a compiler's output, or None."""
    m = ERROR_LINE.search(output)
    return f"{m['where']}: error: {m['what'].strip()}" if m else None


WAIT_S = 600.0  # how long a build waits for another live process's build of the same kernel
LOCK = "svrmad.lock"  # the advisory lock beside torch's; holds the holder's pid
DONE = "svrmad.done"  # written beside a finished library: its size, so a torn one is never imported
_builds: dict[threading.Thread, subprocess.Popen] = {}  # the child building for each thread, now
_cancelled: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def module_name(name: str, source: Path, extra_cflags: tuple[str, ...] = ()) -> str:
    return f"svrmad_{name}_{isa()}_{digest(source, cflags(extra_cflags))}"


def build_dir(module: str) -> Path:
    """Where torch's builder puts `module` ($TORCH_EXTENSIONS_DIR, else its cache root, per Python and
    accelerator)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(module, verbose=False))


def _built(where: Path, module: str) -> Path | None:
    so = where / f"{module}.so"
    try:
        return so if (where / DONE).read_text().strip() == str(so.stat().st_size) else None
    except (OSError, ValueError):
        return None


def _import(so: Path, module: str):
    spec = importlib.util.spec_from_file_location(module, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(name: str, source: Path, extra_cflags: tuple[str, ...] = (), what: str | None = None):
    """The compiled module `svrmad_{name}_{isa}_{digest}` of one csrc file: imported where a finished build
    is there, else built first in a child process; raises whatever the toolchain raises (no compiler,
    no ninja, a compile error...), TimeoutError after WAIT_S seconds of another process's build, and
    BuildInterrupted when stopped."""
    module = module_name(name, source, extra_cflags)
    where = build_dir(module)
    so = _built(where, module)
    if so is None:
        with _build_lock(where, what or name) as lock:
            if _built(where, module) is None:  # another process may have built it while this one waited
                _build_in_child(where, module, source, cflags(extra_cflags), lock)
        so = _built(where, module)
        if so is None:
            raise RuntimeError(f"the build of {module} in {where} finished without its library")
    return _import(so, module)


def cancel(thread: threading.Thread) -> None:
    """Stop the build `thread` runs or will run (from any thread): its child is killed at once and the
    thread's build raises BuildInterrupted."""
    _cancelled.add(thread)
    proc = _builds.get(thread)
    if proc is not None:
        _kill(proc)


def _check_cancelled() -> None:
    if threading.current_thread() in _cancelled:
        raise BuildInterrupted("the kernel build was stopped")


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: ninja and the compilers too
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def _build_lock(where: Path, what: str):
    """Hold the advisory lock of a build folder: taken at once, or waited for (one line) at most WAIT_S
    seconds; then clear a dead build's leftover torch lock (one line)."""
    where.mkdir(parents=True, exist_ok=True)
    fd = os.open(where / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            warnings.warn(f"another process (pid {holder}) is building the {what} in {where}: waiting for it (at most "
                          f"{WAIT_S:.0f} s)", KernelBuildWarning, stacklevel=4)
            deadline = time.monotonic() + WAIT_S
            while not _try_lock(fd):
                _check_cancelled()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"process {holder} held the build lock {where / LOCK} for {WAIT_S:.0f} s")
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        if (where / "lock").exists():  # torch's: every builder here holds ours first, so its owner is dead
            (where / "lock").unlink(missing_ok=True)
            warnings.warn(f"removed the build lock a killed build of the {what} left in {where}", KernelBuildWarning,
                          stacklevel=4)
        yield fd
    finally:
        os.close(fd)  # and with it the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _build_in_child(where: Path, module: str, source: Path, flags: list[str], lock: int) -> None:
    """Run torch's builder in a child process of its own session, which holds this folder's lock with us (an
    inherited descriptor: the lock lasts while either lives) and dies with us; killed if this thread is
    cancelled or interrupted, its torch lock then removed."""
    _check_cancelled()
    omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    job = {"module": module, "source": str(source), "flags": flags, "ldflags": omp, "include": [str(CSRC)],
           "where": str(where), "parent": os.getpid()}
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "svrmad_local.kernels._cpu_build", json.dumps(job)], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                pass_fds=(lock,))
        me = threading.current_thread()
        _builds[me] = proc
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    _check_cancelled()
            _check_cancelled()  # cancel() killed it
        except BaseException:
            _kill(proc)
            proc.wait()
            (where / "lock").unlink(missing_ok=True)  # the child's torch lock: it is dead, and we hold ours
            raise
        finally:
            _builds.pop(me, None)
        if rc != 0:
            out.seek(0)
            raise RuntimeError(out.read()[-20000:] or f"the build of {module} exited {rc}")


def _child(job: dict) -> None:
    """In the child: build with torch's builder, mark the library finished; die with the parent."""
    from torch.utils.cpp_extension import load

    def watch_parent():
        while os.getppid() == job["parent"]:
            time.sleep(0.2)
        os.killpg(0, signal.SIGKILL)  # the parent died (kill -9, OOM): take ninja and the compilers along

    threading.Thread(target=watch_parent, daemon=True).start()
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its compiler banners: our one line says what matters
    quiet.setLevel(logging.ERROR)
    where = Path(job["where"])
    load(name=job["module"], sources=[job["source"]], extra_cflags=job["flags"], extra_ldflags=job["ldflags"],
         extra_include_paths=job["include"], build_directory=str(where), verbose=False)
    (where / DONE).write_text(str((where / f"{job['module']}.so").stat().st_size))


def check_syntax(source: Path, extra_cflags: tuple[str, ...] = ()) -> str | None:
    """Compiles `source` with -fsyntax-only and the flags, includes and defines a build uses (nothing is
    written): None where it compiles, else the first error's 'file:line: error: ...' (the whole output
    where no line names one). For the suite's compile-only check."""
    out = _compile(source, extra_cflags, "-fsyntax-only")
    if out.returncode == 0:
        return None
    return first_error(out.stderr) or out.stderr.strip() or f"{out.args[0]} exited {out.returncode}"


def assembly(source: Path, extra_cflags: tuple[str, ...] = ()) -> str:
    """The assembly the build's flags make of `source` (-S to stdout): what the optimiser kept, for the
    tests that check an instruction survived it (a prefetch, say). Raises with the first error."""
    out = _compile(source, extra_cflags, "-S", "-o", "-")
    if out.returncode != 0:
        raise RuntimeError(first_error(out.stderr) or out.stderr.strip() or f"{out.args[0]} exited {out.returncode}")
    return out.stdout


def _compile(source: Path, extra_cflags: tuple[str, ...], *mode: str) -> subprocess.CompletedProcess:
    """The compiler on `source` with the flags, includes and defines a build uses, and `mode` (what to make)."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    cmd = [compiler() or "c++", *mode, "-DTORCH_EXTENSION_NAME=svrmad_syntax_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{CSRC}", *(f"-isystem{p}" for p in includes), "-fPIC", CXX_STD,
           *cflags(extra_cflags), str(source)]
    return subprocess.run(cmd, capture_output=True, text=True)


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
        """The build's cache key (its file, csrc/'s headers, the flags, the toolchain): changes when its code
        does."""
        return digest(self.source, cflags(self.extra_cflags))

    def load(self):
        with self._lock:
            if self._module is None and self.error is None:
                if self.needs_avx2 and isa() not in ("avx2", "avx512"):
                    self.error = f"this CPU has no AVX2/FMA (torch sees {isa()})"
                    log.info("%s unavailable (%s)", self.what, self.error)
                else:
                    try:  # a finished build loads without the toolchain's lock or a compiler's run
                        self._module = build(self.name, self.source, self.extra_cflags, self.what)
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


if __name__ == "__main__":  # the child process of _build_in_child
    try:
        _child(json.loads(sys.argv[1]))
    except Exception as exc:  # torch's message carries the compiler's output; the parent reads it
        print(exc, file=sys.stderr)
        sys.exit(1)
