"""Programmatic dependent launch (PDL): on an sm_90+ GPU, each Triton kernel may start while the one before runs.

Why: a decode step is a few hundred small kernels back to back. At every boundary the GPU drains the
kernel that ends, then launches the next, whose programs are placed and whose first loads come back
only then: a microsecond or more a boundary in which memory reads little. With PDL the next kernel is
launched once every program of the one before has started: its programs are placed while that one
still runs, and wait only where it matters, before they read what it wrote.

The rule that keeps this exact: a kernel launched with `launch_pdl` waits (`gdc_wait`: every kernel
before it complete, its writes visible) before its first read. Every kernel of the package begins with
`enter(PDL)`, which waits and then lets the next kernel launch, and every launch takes `**launch(t)`,
which sets the kernel's PDL flag and the launch option together: both or neither. Before its wait a
kernel may read only what no kernel writes (kernels/skinny.py prefetches the first bytes of its
weight rows into L2 there). A kernel launched without the option (torch's own, NCCL's) starts after the
one before ends, as always; one launched with it after such a kernel waits for it all the same.

Decided once a device (`why_not`): compute capability 9.0 or later, a Triton whose launcher has the
option, and a probe: two dependent launches inside a captured CUDA graph, replayed, give the right sum.
`EngineConfig.pdl` turns it off (`use`).
"""
from __future__ import annotations

import os

import torch

from ._backend import HAS_TRITON, capturing, interpreting, tl, triton

_state = {"on": True}  # EngineConfig.pdl="off" turns it off for the process (`use`)
_ON = {"PDL": True, "launch_pdl": True}
ENV = "SVRMAD_PDL"  # "0": off in this process, whatever asks (the GPU tests too), as SVRMAD_KERNELS=torch is for Triton
PROBE_FAILED = "the probe failed"  # on a GPU that should run it: a fallback, said in the engine's start line

if HAS_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        HAS_GDC = True
    except ImportError:  # a Triton before 3.4
        HAS_GDC = False

    if HAS_GDC:
        @triton.jit
        def enter(PDL: tl.constexpr):
            """A kernel's first call: with PDL, wait for the kernels before it (complete, writes visible),
            then let the next kernel launch (its programs wait in their own `enter`)."""
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
    else:
        @triton.jit
        def enter(PDL: tl.constexpr):
            """Without Triton's grid-dependency ops PDL is never on (`why_not`): nothing to wait for."""
            pass

    @triton.jit
    def _probe(X, Y, PDL: tl.constexpr):
        enter(PDL)
        i = tl.arange(0, 128)
        tl.store(Y + i, tl.load(X + i) + 1.0)
else:
    HAS_GDC = False


def use(on: bool) -> bool:
    """The run's setting (EngineConfig.pdl, decided in engine/choices.py): False launches every kernel plainly;
    True with PDL on every device `why_not` finds able. Returns the setting it replaced (to restore it)."""
    before, _state["on"] = _state["on"], bool(on)
    return before


_decided: dict[int, str | None] = {}  # device index -> why_not's answer, once a probe ran


def why_not(device) -> str | None:
    """Why PDL cannot run on `device` (None: it can): decided once a device, outside a graph's capture."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"tensors on {device.type}"
    if os.environ.get(ENV) == "0":
        return f"{ENV}=0"
    if not HAS_TRITON or interpreting():
        return "Triton is not compiling for this GPU"
    if not HAS_GDC:
        return f"Triton {triton.__version__} has no grid-dependency ops (3.4 or later has)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if capturing():  # the probe would be recorded into the graph: decided before any capture (engine build)
        return _decided.get(index, "not decided before a graph's capture")
    if index not in _decided:
        _decided[index] = _probe_device(index)
    return _decided[index]


def _probe_device(index: int) -> str | None:
    if torch.version.hip:
        return "a ROCm GPU (programmatic dependent launch is NVIDIA's)"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"compute capability {major}.{minor} (PDL needs 9.0 or later)"
    try:
        with torch.cuda.device(index):  # Triton launches on the current device
            return _probe_launches(torch.device("cuda", index))
    except Exception as err:  # an old driver, a launcher without the option
        first = str(err).splitlines()[0][:160] if str(err) else ""
        return f"{PROBE_FAILED}: {type(err).__name__}: {first}"


def _probe_launches(device: torch.device) -> str | None:
    """Two dependent PDL launches, run once (compiling), then captured in a CUDA graph and replayed: x + 2."""
    x = torch.arange(128, device=device, dtype=torch.float32)
    y, z = torch.empty_like(x), torch.empty_like(x)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        _probe[(1,)](x, y, **_ON)
        _probe[(1,)](y, z, **_ON)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        _probe[(1,)](x, y, **_ON)
        _probe[(1,)](y, z, **_ON)
    torch.cuda.current_stream(device).wait_stream(stream)
    z.zero_()
    graph.replay()
    torch.cuda.synchronize(device)
    return None if torch.equal(z, x + 2) else f"{PROBE_FAILED}: its two dependent launches gave a wrong sum"


def launch(t: torch.Tensor) -> dict:
    """The launch keywords for a kernel whose tensors are on `t`'s device: {"PDL": True, "launch_pdl": True}
    where PDL runs, else none (the kernel's PDL flag defaults to False). Asked at every launch: a dict
    lookup once the device is decided."""
    if not _state["on"] or t.device.type != "cuda":
        return {}
    index = t.device.index
    why = _decided[index] if index in _decided else why_not(t.device)
    return {} if why is not None else _ON
