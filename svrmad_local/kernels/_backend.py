"""Backend selection shared by the kernels: optional triton import and the ``kernel_impl`` switch.

Triton is optional: every public function has a torch reference path, so the package imports
and works (on CPU or GPU) when triton is missing. ``kernel_impl="auto"`` picks triton only where it pays
off (CUDA tensors); tests force ``kernel_impl="triton"`` on CPU tensors under ``TRITON_INTERPRET=1``.
The compiled C++ CPU kernels (cpu_decode, cpu_linear, cpu_ops) register here too: ``choose`` says for
every kernel which implementation runs and, where the reference does, why. ``SVRMAD_KERNELS=torch`` is
the Triton kernels' switch; each CPU kernel keeps its own (``SVRMAD_CPU_DECODE=0``...).
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

try:  # guarded: the engine must run without triton installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install (e.g. missing driver libraries)
    triton = None
    tl = None
    HAS_TRITON = False

IMPLS = ("auto", "torch", "triton")
# Force the torch reference everywhere without touching call sites (debugging, A/B checks).
FORCE_ENV = "SVRMAD_KERNELS"
_disabled: dict[str, str] = {}  # kernel name -> why "auto" stopped using its triton path
_CPU: dict[str, Callable[[], str | None]] = {}  # compiled C++ CPU kernel name -> why it cannot run (None: it can)


def interpreter_ready() -> bool:
    """True when triton itself was imported in interpreter mode (TRITON_INTERPRET=1 before the
    first ``import triton``; its own jit helpers are then interpreted): the only state in which
    kernel_impl="triton" runs on CPU tensors. Setting the variable later does not switch an imported
    triton over (note: importing torch._dynamo imports triton)."""
    return HAS_TRITON and type(tl.standard.zeros_like).__name__ == "InterpretedFunction"


def interpreting() -> bool:
    """True when kernels run in triton's numpy interpreter (CPU tensors, tests): small tiles and
    the interpreter workarounds apply."""
    return interpreter_ready()


@dataclass(frozen=True)
class KernelPick:
    """The implementation a kernel call takes: "triton", "cpp" (a compiled C++ CPU kernel) or "torch" (the
    reference), and, where the reference runs, why. (The engine's `execution.Choice` is one aspect of its
    record, which the choices read from here make up.)"""
    impl: str
    why: str | None = None


_TRITON, _CPP = KernelPick("triton"), KernelPick("cpp")


def register_cpu(name: str, why_not: Callable[[], str | None]) -> None:
    """Called by each compiled CPU kernel (_cpu_build.Kernel): `why_not()` is None where it runs (building
    it on first call), else the reason."""
    _CPU[name] = why_not


def choose(kernel_impl: str, device, name: str) -> KernelPick:
    """The one place that says whether kernel `name`'s fast implementation runs for a call on `device`
    or its torch reference, and why: the Triton kernels (CUDA, or CPU tensors under the interpreter when
    asked for explicitly) and the compiled C++ CPU kernels alike. Explicit requests that cannot be met
    raise; "auto" degrades to the reference with its reason. The engine's choices are made from it once,
    at build (engine/choices.py); a kernel's own call resolves it again only to react to a run-time
    failure: a Triton path that failed under "auto" (`fall_back`, `disable_auto`) is a reaction, not a
    choice, and the engine reports it beside its record (`Engine.info["fallbacks"]`)."""
    if kernel_impl not in IMPLS:
        raise ValueError(f"kernel_impl must be one of {IMPLS}, got {kernel_impl!r}")
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if name in _CPU:
        if kernel_impl == "triton":
            raise ValueError(f"{name} is a C++ CPU kernel: kernel_impl must be 'auto' or 'torch'")
        if kernel_impl == "torch":
            return KernelPick("torch", "kernel_impl='torch'")
        if device.type != "cpu":
            return KernelPick("torch", f"a CPU kernel, tensors on {device.type}")
        why = _CPU[name]()
        return KernelPick("torch", why) if why else _CPP
    if kernel_impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("kernel_impl='triton' requested but triton is not importable")
        if device.type == "cpu" and not interpreter_ready():
            raise RuntimeError("kernel_impl='triton' on CPU tensors needs triton's interpreter: set "
                               "TRITON_INTERPRET=1 before triton is first imported")
        return _TRITON
    if kernel_impl == "torch":
        return KernelPick("torch", "kernel_impl='torch'")
    if os.environ.get(FORCE_ENV, "").lower() == "torch":
        return KernelPick("torch", f"{FORCE_ENV}=torch")
    if name in _disabled:
        return KernelPick("torch", f"its Triton path failed: {_disabled[name]}")
    if not HAS_TRITON:
        return KernelPick("torch", "triton is not importable")
    return _TRITON if device.type == "cuda" else KernelPick("torch", f"tensors on {device.type}")


def resolve_impl(kernel_impl: str, device, name: str) -> str:
    """Map ``kernel_impl`` to "torch", "triton" or "cpp" for a call whose tensors live on ``device``."""
    return choose(kernel_impl, device, name).impl


def select_impl(kernel_impl: str, tensor_or_device, name: str = "token_stats") -> str:
    """Which path ("torch", "triton" or "cpp") a call of kernel ``name`` with ``kernel_impl`` would take for
    tensors on that device; for callers that log or report the path they use."""
    dev = tensor_or_device.device if hasattr(tensor_or_device, "device") else torch.device(tensor_or_device)
    return resolve_impl(kernel_impl, dev, name)


def capturing() -> bool:
    """True while the current CUDA stream records a graph (False where CUDA is absent)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def fall_back(name: str, err: BaseException, kernel_impl: str) -> None:
    """What a dispatcher does when its Triton path of ``name`` raised: re-raise where asked for Triton
    explicitly, and while a CUDA graph is being captured (a fallback there would record the slow
    reference into the graph, and the error usually belongs to the capture, not the kernel: the caller
    that captures decides, and the kernel stays on for eager steps); else ``disable_auto``."""
    if kernel_impl != "auto" or capturing():
        raise err
    disable_auto(name, err)


def disable_auto(name: str, err: BaseException) -> None:
    """Called when the triton path of ``name`` failed under kernel_impl="auto" (e.g. a compile error on
    an untested GPU): warn once and serve later auto calls from the torch reference, so a kernel
    problem degrades speed instead of stopping a run. Explicit kernel_impl="triton" still raises."""
    _disabled[name] = repr(err)
    warnings.warn(f"kernels.{name}: triton path failed ({err!r}); using the torch reference",
                  RuntimeWarning, stacklevel=3)


def disabled() -> dict[str, str]:
    """The kernels whose triton path failed under "auto" in this process, and why (a copy)."""
    return dict(_disabled)


def staged(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of host values (a list, a numpy array or a CPU tensor) on ``device``, for the per-step
    numbers the engine hands a GPU: built on the host, pinned and copied without blocking where the
    device is CUDA. A copy from pageable memory (``torch.tensor(values, device="cuda")``) makes the host
    wait until every kernel queued before it has run, so the host cannot prepare the next step meanwhile.
    The pinned buffer outlives the copy (torch's caching host allocator records its use by the stream)."""
    host = values.to(dtype) if torch.is_tensor(values) else torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# Shared memory one program may use: the H100's (and H200's) opt-in maximum per block, 227 KB; the device's
# own figure where torch reports it. A config past it fails to compile, which "auto" used to turn into a
# silent fallback to the reference.
H100_SMEM = 227 * 1024
NUM_STAGES = 2  # the attention kernels' software pipeline depth, passed to every launch


@functools.lru_cache(maxsize=None)
def _smem_limit(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or H100_SMEM)
    return H100_SMEM


def smem_limit(device) -> int:
    """The device's shared memory per program, read once per device (it is asked per layer and step)."""
    return _smem_limit(torch.device(device))


def attn_smem(block_m: int, block_n: int, block_d: int, block_dv: int, elem_bytes: int,
              stages: int = NUM_STAGES) -> int:
    """Upper estimate of the shared memory of an attention tile program: its Q tile [M, D] once, and per
    pipeline stage a K tile [N, D] and a V tile [N, Dv], in the dot's element size (4 where it runs in
    fp32), plus the [M, N] probabilities handed to the second dot."""
    return elem_bytes * (block_m * block_d + stages * block_n * (block_d + block_dv) + block_m * block_n)


@functools.lru_cache(maxsize=None)  # a pure function of its ints, asked per layer and step
def fit_attn_tiles(block_m: int, block_n: int, block_d: int, block_dv: int, elem_bytes: int, limit: int,
                   stages: int = NUM_STAGES, smallest: int = 16) -> tuple[int, int]:
    """(block_m, block_n) no larger than asked whose `attn_smem` fits `limit`: halves the key tile first
    (it counts once per stage), then the query tile, down to `smallest` (the dot's minimum); raises if
    even that does not fit, naming the need."""
    while attn_smem(block_m, block_n, block_d, block_dv, elem_bytes, stages) > limit:
        if block_n > smallest and block_n >= block_m:
            block_n //= 2
        elif block_m > smallest:
            block_m //= 2
        elif block_n > smallest:
            block_n //= 2
        else:
            need = attn_smem(block_m, block_n, block_d, block_dv, elem_bytes, stages)
            raise ValueError(f"attention tiles of head dims {block_d}/{block_dv} need {need} bytes of shared "
                             f"memory at the smallest tile, over the {limit} this device has")
    return block_m, block_n


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
