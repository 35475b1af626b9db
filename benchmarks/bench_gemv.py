"""The panel kernel at batch 1 (one row: a decode step's GEMV) against this machine's plain-read bandwidth.

    python benchmarks/bench_gemv.py [--model PATH] [--dtype fp32|bf16] [--widths 1,2,4] [--isa avx2,amx] [--repeat 7]

The read bandwidth: a sum and a dot over 512 MiB tensors (torch's own reductions, best of several; the
figure bench_decode's weight-streaming limit divides by). Then one "step" of linears at the model's
shapes as the engine packs them (per layer the fused q/k/v, o_proj, the fused gate/up, down_proj; then
the LM head), every one with its own random weights so that each comes from memory, in that order,
for each `row_width` (panels a one-row call walks at once; 1 is the walk before it became 4; bf16 on
`vdpbf16ps` or AMX walks its own way whatever the width, so its rows differ only by the noise): whole
passes, the widths interleaved, medians of --repeat. Per shape, the median microseconds of a call
within those passes and its GB/s. Last, the cost of a call with nothing to read (a 16 x 16 matrix): the
kernel's fixed cost, its two threads' start and barrier included. --dtype bf16 streams bf16 panels (half
the bytes); --isa compares the instruction levels the kernel can take here (avx2: two FMAs a pair,
avx512_bf16: one dot-product instruction, amx: the tiles), each level a row of the table
beside each width. Last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from svrmad_local.kernels import cpu_linear  # noqa: E402
from svrmad_local.models.default import ensure_default_model  # noqa: E402


def read_bandwidths(mib: int = 512, repeat: int = 7) -> dict:
    """GB/s of torch's sum over one tensor and dot over two, best of `repeat`."""
    x, y = torch.ones(mib * 2**20 // 4), torch.ones(mib * 2**20 // 4)
    out = {}
    for name, fn, nbytes in (("sum", lambda: x.sum(), x.numel() * 4), ("dot", lambda: torch.dot(x, y), x.numel() * 8)):
        fn()
        best = min(_seconds(fn) for _ in range(repeat))
        out[name] = round(nbytes / best / 1e9, 1)
    return out


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of a decode step's GEMMs, in the order a step runs them (siblings fused)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or h // heads
    layer = [("qkv", (heads + 2 * kv) * hd, h), ("o_proj", h, heads * hd), ("gate_up", 2 * i, h), ("down", h, i)]
    return layer * config["num_hidden_layers"] + [("lm_head", config["vocab_size"], h)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder whose config.json gives the shapes (default: the embedded one)")
    ap.add_argument("--widths", default="1,2,4", help="row_width values to compare (panels at once)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--isa", help="instruction levels to compare, e.g. avx2,avx512_bf16 (default: the best here)")
    args = ap.parse_args()
    if not cpu_linear.available():
        raise SystemExit(f"the panel kernel is not available: {cpu_linear.unavailable_reason()}")
    config = json.loads((Path(args.model or ensure_default_model()) / "config.json").read_text())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    mod = cpu_linear._KERNEL.module()
    best = cpu_linear.isa()
    levels = args.isa.split(",") if args.isa else [best]
    for name in levels:
        if name not in cpu_linear.ISA_NAMES or cpu_linear.ISA_NAMES.index(name) > cpu_linear.ISA_NAMES.index(best):
            raise SystemExit(f"--isa {name}: this CPU takes {', '.join(cpu_linear.ISA_NAMES[: cpu_linear.ISA_NAMES.index(best) + 1])}")
    widths = [(int(w), lv) for w in args.widths.split(",") for lv in levels]
    bw = read_bandwidths()
    print(f"read bandwidth: sum {bw['sum']} GB/s, dot {bw['dot']} GB/s; {torch.get_num_threads()} threads; {args.dtype}")

    shapes = step_shapes(config)
    gen = torch.Generator().manual_seed(0)
    weights = [cpu_linear.pack(torch.randn(n, k, generator=gen).to(dtype)) for _, n, k in shapes]
    xs = [torch.randn(1, k, generator=gen).to(dtype) for _, _, k in shapes]
    size = torch.empty((), dtype=dtype).element_size()
    step_bytes = sum(n * k * size for _, n, k in shapes)
    passes = {w: [] for w in widths}
    calls = {w: [[] for _ in shapes] for w in widths}
    with torch.inference_mode():
        for rep in range(args.repeat + 1):  # the first round warms up
            for width, level in widths:
                mod.set_isa_level(cpu_linear.ISA_NAMES.index(level))
                fns = [cpu_linear.bound(wt, n, None, width) for wt, (_, n, _) in zip(weights, shapes)]
                per = []
                t0 = time.perf_counter()
                for f, x in zip(fns, xs):
                    t = time.perf_counter()
                    f(x)
                    per.append(time.perf_counter() - t)
                total = time.perf_counter() - t0
                if rep:
                    passes[width, level].append(total)
                    for c, s in zip(calls[width, level], per):
                        c.append(s)
    mod.set_isa_level(cpu_linear.ISA_NAMES.index(best))
    rows = []
    for width, level in widths:
        ms = statistics.median(passes[width, level]) * 1e3
        by_shape = {}
        for (name, n, k), c in zip(shapes, calls[width, level]):
            by_shape.setdefault((name, n, k), []).extend(c)
        shape_rows = [{"name": name, "n": n, "k": k, "us": round(statistics.median(c) * 1e6, 1),
                       "gb_s": round(n * k * size / statistics.median(c) / 1e9, 1)} for (name, n, k), c in by_shape.items()]
        row = {"row_width": width, "isa": level, "step_ms": round(ms, 2), "gb_s": round(step_bytes / ms / 1e6, 1),
               "of_sum_bandwidth": round(step_bytes / ms / 1e6 / bw["sum"], 3), "shapes": shape_rows}
        rows.append(row)
        print(f"row_width {width} {level}: a step of linears {ms:6.2f} ms, {row['gb_s']:5.1f} GB/s "
              f"({row['of_sum_bandwidth']:.0%} of the sum's)   " +
              "   ".join(f"{s['name']} {s['us']:.0f} us {s['gb_s']:.1f} GB/s" for s in shape_rows))
    tiny, x16 = cpu_linear.pack(torch.randn(16, 16).to(dtype)), torch.randn(1, 16).to(dtype)
    f = cpu_linear.bound(tiny, 16)
    f(x16)
    empty_us = min(_seconds(lambda: [f(x16) for _ in range(1000)]) for _ in range(5)) / 1000 * 1e6
    print(f"a call with nothing to read (16 x 16): {empty_us:.2f} us, x {len(shapes)} calls a step = "
          f"{empty_us * len(shapes) / 1e3:.2f} ms")
    print(json.dumps({"dtype": args.dtype, "read_bandwidth_gb_s": bw, "step_bytes": step_bytes, "calls": len(shapes),
                      "empty_call_us": round(empty_us, 2), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
