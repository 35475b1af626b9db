"""The decoder's small ops on a GPU (kernels/fused.py): each Triton kernel (kernels/fused_triton.py) against
its torch reference, side by side in one run, at Qwen3-1.7B's decode shapes in bf16 (a script).

    python benchmarks/bench_fused.py [--batches 1,8,32] [--calls 20] [--repeat 50] [--json]
    python benchmarks/bench_fused.py --dry-run   # CPU: tiny shapes through Triton's interpreter

Qwen3-1.7B: hidden 2,048, 16 query heads and 8 KV heads of 128 dims with q/k norms, MLP 6,144, 28 layers.
The ops as the decoder calls them: rms_norm and add_rms_norm over [B, 2048]; rope_store with q/k/v as
views of one q/k/v GEMM output, the caches [16384 slots, 8, 128], B scattered slots; act_mul (SiLU) over
the two halves of one gate/up output [B, 12288]. Per op and batch B, for each implementation:
- graph_us: microseconds per call inside a CUDA graph of --calls calls, replayed --repeat times (the
  device's time with the launch gaps between kernels: what a captured decode step pays);
- eager_us: microseconds per call called eagerly --calls times (host dispatch included);
- launches: the kernels one call launches (torch.profiler);
- bytes: what the op must move at least (its inputs read once, its outputs written once), and GB/s:
  bytes / graph time.
Each op's output is checked against the reference's first (max_diff: the largest difference relative to
the reference's largest value). The last lines add up one decode
step's worth (28 layers: two norms, one rope_store and one act_mul each). With --json the last line is one
JSON object with every figure. On a machine without CUDA it says so and exits 0 (--dry-run checks the
script itself on the CPU: tiny shapes, eager times of the interpreter, no graphs, no launch counts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

QWEN3_1_7B = dict(hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144, layers=28, slots=16384)
TINY = dict(hidden=96, heads=4, kv_heads=2, head_dim=32, intermediate=80, layers=2, slots=64)
EPS = 1e-6


def cases(shape: dict, batch: int, dtype: torch.dtype, device: torch.device, ft, fused) -> dict:
    """op -> (triton call, reference call, bytes moved at least), on one set of inputs per op."""
    g = torch.Generator(device="cpu").manual_seed(batch)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

    H, I, nq, nkv, D = shape["hidden"], shape["intermediate"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    e = torch.finfo(dtype).bits // 8
    x, res, w = rand(batch, H, scale=3.0), rand(batch, H), rand(H, scale=0.3) + 1
    qkv = rand(batch, (nq + 2 * nkv) * D, scale=2.0)
    q, k, v = (t.view(batch, -1, D) for t in qkv.split([nq * D, nkv * D, nkv * D], dim=-1))
    ang = torch.rand(batch, D // 2, generator=g) * 1000
    cos, sin = (torch.cat([f(ang)] * 2, dim=-1).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
    kc, vc = rand(shape["slots"], nkv, D), rand(shape["slots"], nkv, D)
    slots = torch.randperm(shape["slots"], generator=g)[:batch].to(device)
    norms = (rand(D, scale=0.3) + 1, EPS, fused.PLAIN), (rand(D, scale=0.3) + 1, EPS, fused.PLAIN)
    gate, up = rand(batch, 2 * I, scale=4.0).split([I, I], dim=-1)
    rope_bytes = (batch * (nq + 2 * nkv) * D + 2 * batch * D + 2 * D + batch * nq * D + 2 * batch * nkv * D) * e + 8 * batch
    return {
        "rms_norm": (lambda: ft.rms_norm(x, w, EPS), lambda: fused.reference_rms_norm(x, w, EPS),
                     (2 * batch * H + H) * e),
        "add_rms_norm": (lambda: ft.add_rms_norm(x, res, w, EPS), lambda: fused.reference_add_rms_norm(x, res, w, EPS),
                         (4 * batch * H + H) * e),
        "rope_store": (lambda: ft.rope_store(q, k, v, cos, sin, kc, vc, slots, *norms),
                       lambda: fused.reference_rope_store(q, k, v, cos, sin, kc, vc, slots, *norms), rope_bytes),
        "act_mul": (lambda: ft.act_mul(gate, up, "silu"), lambda: fused.reference_act_mul(gate, up, "silu"),
                    3 * batch * I * e),
    }


def max_diff(a, b) -> float:
    """max |a - b| over the outputs, relative to the largest |b| (one bf16 rounding is at most 2**-8)."""
    a, b = (t if isinstance(t, tuple) else (t,) for t in (a, b))
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_us(fn, calls: int, repeat: int, device: torch.device) -> float:
    """Best of `repeat` runs of `calls` eager calls, per call."""
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


def graph_us(fn, calls: int, repeat: int) -> float | None:
    """Per call, inside one CUDA graph of `calls` calls replayed `repeat` times (None if it cannot be
    captured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture wants
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as err:
        print(f"  (not captured: {str(err).splitlines()[0]})", file=sys.stderr)
        return None
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * repeat)


def launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run(shape: dict, batches: list[int], dtype: torch.dtype, device: torch.device, calls: int, repeat: int) -> list:
    from svrmad_local.kernels import fused, fused_triton as ft

    rows = []
    for batch in batches:
        for op, (ours, ref, nbytes) in cases(shape, batch, dtype, device, ft, fused).items():
            row = {"op": op, "batch": batch, "bytes": nbytes, "max_diff": max_diff(ours(), ref())}
            for impl, fn in (("triton", ours), ("torch", ref)):
                fn()  # compile, warm the caches
                row[f"{impl}_eager_us"] = eager_us(fn, calls, repeat, device)
                if device.type == "cuda":
                    row[f"{impl}_graph_us"] = graph_us(fn, calls, repeat)
                    row[f"{impl}_launches"] = launches(fn)
                    t = row[f"{impl}_graph_us"]
                    row[f"{impl}_gbps"] = nbytes / t / 1e3 if t else None
            rows.append(row)
    return rows


def step_sums(rows: list, layers: int) -> list:
    """Per batch, one decode step's worth of these ops: per layer two norms (add_rms_norm), one rope_store
    and one act_mul."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        by = {r["op"]: r for r in rows if r["batch"] == batch}
        per = {}
        for key in ("triton_graph_us", "torch_graph_us", "triton_eager_us", "torch_eager_us",
                    "triton_launches", "torch_launches"):
            parts = [by["add_rms_norm"].get(key), by["add_rms_norm"].get(key), by["rope_store"].get(key),
                     by["act_mul"].get(key)]
            per[key] = None if any(p is None for p in parts) else layers * sum(parts)
        out.append({"batch": batch, "layers": layers, **per})
    return out


def _fmt(v, spec: str) -> str:
    """format(v, spec), or a dash as wide where the figure does not exist (no CUDA graph, no profiler)."""
    return "-".rjust(int(spec.split(".")[0].rstrip("df") or 0)) if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (default 1,8,32)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed run (one graph holds them all)")
    ap.add_argument("--repeat", type=int, default=50, help="timed runs (graph replays), the best eager run kept")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU through Triton's interpreter, tiny shapes: checks the script, times nothing real")
    ap.add_argument("--json", action="store_true", help="print every figure as one JSON object last")
    args = ap.parse_args(argv)
    from svrmad_local.kernels._backend import HAS_TRITON, interpreter_ready

    if args.dry_run:
        if not interpreter_ready():
            print("bench_fused: --dry-run needs Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")
            return 1
        device, shape, batches, calls, repeat = torch.device("cpu"), TINY, [1, 3], 1, 1
    else:
        if not torch.cuda.is_available() or not HAS_TRITON or interpreter_ready():
            print("bench_fused: needs a CUDA device with Triton (not its interpreter): nothing to time here; "
                  "--dry-run checks the script on the CPU")
            return 0
        device, shape = torch.device("cuda"), QWEN3_1_7B
        batches, calls, repeat = [int(b) for b in args.batches.split(",")], args.calls, args.repeat
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    print(f"bench_fused: {name}, torch {torch.__version__}, {args.dtype}, shape {shape}")
    rows = run(shape, batches, dtype, device, calls, repeat)
    print(f"{'op':<13} {'B':>3} {'bytes':>9} | {'triton us':>9} {'torch us':>9} {'x':>6} | {'GB/s':>7} {'GB/s':>7} | "
          f"{'launch':>6} {'launch':>6} | {'eager us':>9} {'eager us':>9} | max diff")
    for r in rows:
        tg, rg = r.get("triton_graph_us"), r.get("torch_graph_us")
        print(f"{r['op']:<13} {r['batch']:>3} {r['bytes']:>9} | {_fmt(tg, '9.2f')} {_fmt(rg, '9.2f')} "
              f"{_fmt(rg / tg if tg and rg else None, '6.2f')} | {_fmt(r.get('triton_gbps'), '7.1f')} "
              f"{_fmt(r.get('torch_gbps'), '7.1f')} | {_fmt(r.get('triton_launches'), '6d')} "
              f"{_fmt(r.get('torch_launches'), '6d')} | {r['triton_eager_us']:9.1f} {r['torch_eager_us']:9.1f} | "
              f"{r['max_diff']:.2e}")
    steps = step_sums(rows, shape["layers"])
    for s in steps:
        print(f"one decode step's ops, batch {s['batch']} ({s['layers']} layers): graph "
              f"{_fmt(s['triton_graph_us'], '.1f')} us (Triton) vs {_fmt(s['torch_graph_us'], '.1f')} us (torch); "
              f"eager {s['triton_eager_us']:.1f} vs {s['torch_eager_us']:.1f} us; launches "
              f"{_fmt(s['triton_launches'], 'd')} vs {_fmt(s['torch_launches'], 'd')}")
    if args.json:
        print(json.dumps({"device": name, "dtype": args.dtype, "shape": shape, "rows": rows, "steps": steps}))
    return 0


if __name__ == "__main__":
    if "--dry-run" in sys.argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before svrmad_local.kernels imports triton
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # timings never come from the interpreter
    sys.exit(main())
