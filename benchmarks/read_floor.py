"""What no decode linear can beat on a GPU: the time one launch takes to read a weight's bytes and do nothing
else, and a decode step made of such reads (benchmarks/bench_skinny.py --floor).

Why: a skinny linear's GB/s says how far it is from the card's copy rate, but a short linear (8 MB) never
reaches that rate in one launch whatever it computes: its programs start, their first loads wait a memory
latency, the last ones drain. The bare read measures that ceiling per size, so a config's time over it says
what is left to gain in the kernel, and the step of bare reads says what is left to gain with one kernel a
linear at all (the rest needs fewer launches: fusion). The bare read waits for the kernel before it (PDL's
wait) before its first load, as a linear waits for its input; a skinny config that prefetches its weight
before that wait (kernels/skinny.py, with PDL) can come in under it by what the prefetch overlaps.

Imported after bench_skinny decides whether Triton interprets (its --dry-run): a kernel is jitted or
interpreted as it is defined.
"""
from __future__ import annotations

import functools
import time

import torch

from svrmad_local.kernels import pdl, skinny
from svrmad_local.kernels._backend import HAS_TRITON, cdiv, tl, triton

if HAS_TRITON:
    from svrmad_local.kernels.pdl import enter
    from svrmad_local.kernels.skinny import _prefetch_rows

    @triton.jit
    def _read_kernel(W, O, n, CHUNK, BLOCK: tl.constexpr, PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False):
        """Program p sums W's elements [p * CHUNK, (p + 1) * CHUNK) into O[p], BLOCK at a time: every element
        read once (evicted first, as the skinny kernel reads a weight), in one contiguous stretch a program.
        PREFETCH (bytes, launched with PDL): first the stretch's first PREFETCH bytes into L2, before the wait
        for the kernel before, as the skinny kernel's first programs fetch their rows' first bytes."""
        p = tl.program_id(0)
        lo = p * CHUNK
        if PREFETCH > 0:  # a weight is no kernel's output: fetched before the wait
            if lo + PREFETCH // (W.dtype.element_ty.primitive_bitwidth // 8) <= n:
                _prefetch_rows(W + lo + tl.arange(0, 1), PREFETCH)
        enter(PDL)
        hi = tl.minimum(lo + CHUNK, n)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(W + offs, mask=offs < hi, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(O + p, tl.sum(acc, axis=0))


# (programs an SM, elements a load, warps) of the bare read: the bytes a program keeps in flight are one load's
# (Triton pipelines only the loads that feed tl.dot), so these span 2 to 16 programs an SM at 4-16 KB a load
FLOOR_LAUNCHES = ((2, 4096, 4), (4, 4096, 4), (8, 4096, 4), (16, 2048, 4), (4, 8192, 8), (8, 8192, 8))


# bytes of its stretch a program of the step's `on_prefetch` arm fetches before its wait: what a first-wave skinny
# program of 32 columns fetches (a row's first PREFETCH_BYTES for each of its 32 rows)
STEP_PREFETCH = 32 * skinny.PREFETCH_BYTES


def read_weight(w: torch.Tensor, launch: tuple, out: torch.Tensor | None = None, prefetch: int = 0) -> torch.Tensor:
    """The bare read of `w` (contiguous) as `launch` = (programs an SM, BLOCK, warps) shapes it: one fp32 sum a
    program, [programs]; no more programs than BLOCK-sized pieces. Launched with PDL where the engine would, and
    then with `prefetch` bytes of each stretch fetched before the wait (a multiple of 16)."""
    per_sm, block, warps = launch
    n = w.numel()
    if not 0 < n < 2**31:
        raise ValueError(f"read_weight: {n} elements; the kernel reads 1 to 2**31 - 1 (32-bit offsets)")
    programs = max(1, min(skinny._sms(w.device) * per_sm, cdiv(n, block)))
    chunk = cdiv(cdiv(n, programs), block) * block
    programs = cdiv(n, chunk)
    out = torch.empty(programs, device=w.device, dtype=torch.float32) if out is None else out[:programs]
    on = pdl.launch(w)
    _read_kernel[(programs,)](w, out, n, chunk, BLOCK=block, PREFETCH=prefetch if on else 0, num_warps=warps, **on)
    return out


def seconds(run, device, inner: int = 10) -> float:
    """Seconds a call of `run` takes: on a GPU as the configs are timed (`skinny.time_call`: `inner` calls in a
    graph, the median of 5 replays); on the CPU one interpreted call (checks the script, not the speed)."""
    if torch.device(device).type == "cuda":
        return skinny.time_call(run, reps=5, inner=inner)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def launch_name(launch: tuple) -> str:
    return "p{}b{}w{}".format(*launch)


def read_floor(w: torch.Tensor, launches=FLOOR_LAUNCHES) -> dict:
    """Microseconds and GB/s of the bare read of `w`'s bytes, the fastest of `launches`, each timed as the
    configs are (cold copies of w, `skinny.time_call`; on the CPU one interpreted call)."""
    size = w.numel() * w.element_size()
    copies = skinny.cold_copies(w) if w.device.type == "cuda" else [w]
    times = {}
    for launch in launches:
        turn = iter(range(1 << 62))

        def run(launch=launch, turn=turn):
            return read_weight(copies[next(turn) % len(copies)], launch)

        times[launch_name(launch)] = seconds(run, w.device)
    best = min(times, key=times.get)
    return {"us": round(times[best] * 1e6, 2), "gbps": round(size / times[best] / 1e9, 1), "launch": best,
            "launches_us": {k: round(t * 1e6, 2) for k, t in times.items()}}


STEP = ("qkv", "q/o_proj", "gate_up", "down")  # a decode layer's linears as the engine runs them on a GPU


def read_step(device, dtype, shapes: dict, floors: dict, layers: int, read_gbps: float) -> dict:
    """The decode step's linears read bare, one kernel each (`shapes`' STEP for each of `layers` layers of their
    own weights, then its lm_head; each launch its shape's fastest in `floors`), back to back in one graph, PDL
    off, on, and on with STEP_PREFETCH bytes of each stretch fetched before the wait (`on_prefetch`: the
    engine's design): milliseconds, GB/s, and the fraction of the weight-streaming limit (those bytes at
    `read_gbps`, the card's sum-read rate) that such a step reaches. On the CPU, PDL off, once, interpreted."""
    by_name = {launch_name(x): x for x in FLOOR_LAUNCHES}
    plan = [name for _ in range(layers) for name in STEP] + ["lm_head"]
    ws = [(torch.randn(*shapes[name], device=device, dtype=dtype), by_name[floors[name]["launch"]]) for name in plan]
    out = torch.empty(max(skinny._sms(device) * x[0] for x in FLOOR_LAUNCHES), device=device, dtype=torch.float32)

    def step(prefetch: int):
        for w, launch in ws:
            read_weight(w, launch, out, prefetch)

    gb = sum(w.numel() * w.element_size() for w, _ in ws) / 1e9
    why = pdl.why_not(device)
    result = {"layers": layers, "launches": len(ws), "gb": round(gb, 3), "read_gbps": read_gbps,
              "limit_ms": round(gb / read_gbps * 1e3, 3) if read_gbps else None, "pdl": why or "on", "arms": {}}
    kept = pdl.use(False)
    try:
        for arm in ("off",) + (("on", "on_prefetch") if why is None else ()):
            pdl.use(arm != "off")
            t = seconds(functools.partial(step, STEP_PREFETCH if arm == "on_prefetch" else 0), device, inner=1)
            a = result["arms"][arm] = {"ms": round(t * 1e3, 3), "gbps": round(gb / t, 1)}
            if read_gbps:
                a["of_limit"] = round(gb / read_gbps / t, 3)
    finally:
        pdl.use(kept)
    return result
