"""Benchmark of the packed-weight GEMMs (a script, not a test).

    python benchmarks/bench_quant.py [--ms 1,8,64,512] [--reps 20] [--only moe|fp8]
    python benchmarks/bench_quant.py --cpu-smoke      # tiny shapes on the CPU: checks it runs

Times, per shape and M (tokens), on CUDA:
- ``triton``: our kernel on the packed bytes (kernels/quant_triton.py);
- ``deq+mm``: dequantize-then-matmul, what runs without a packed kernel: the packed weight is
  expanded to bf16 at every call (per expert for the MoE), then ``x @ W^T``;
- ``bf16``: the matmul alone on weights dequantized beforehand (the speed a bf16 checkpoint would
  give, at 2-4x the memory), the bar a packed kernel should approach at large M and beat at small M,
  where reading the weight is the cost.
and prints ``deq+mm / triton`` and ``bf16 / triton`` side by side (above 1: ours is faster).

Shapes: GPT-OSS-120B experts (hidden 2880, intermediate 2880, 128 experts, top-4; gate_up 2880 ->
5760, down 2880 -> 2880; M tokens route 4M rows, uniformly at random) and DeepSeek-V3.1 FP8
projections with 128 x 128 blocks (q_a 7168 -> 1536, q_b 1536 -> 24576, kv_a_proj_with_mqa 7168 ->
576, kv_b 512 -> 32768, o 16384 -> 7168, experts 7168 -> 2048 and 2048 -> 7168).

``--cpu-smoke`` runs tiny versions of the same cases once each (the Triton path through the
interpreter when TRITON_INTERPRET=1 was set, else skipped), checks every path agrees, and prints the
same table: CPU figures mean nothing. The last line is one JSON object with every row.
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
if "--cpu-smoke" not in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)  # timings must never come from the numpy interpreter

import torch  # noqa: E402

from svrmad_local.kernels import quant_triton as qt  # noqa: E402
from svrmad_local.kernels._backend import HAS_TRITON, interpreter_ready  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]

GPT_OSS = dict(hidden=2880, inter=2880, experts=128, top_k=4)
DEEPSEEK = [  # (name, in K, out N)
    ("q_a_proj", 7168, 1536), ("q_b_proj", 1536, 24576), ("kv_a_proj_with_mqa", 7168, 576),
    ("kv_b_proj", 512, 32768), ("o_proj", 16384, 7168), ("expert gate/up", 7168, 2048),
    ("expert down", 2048, 7168),
]
SMOKE_OSS = dict(hidden=64, inter=32, experts=4, top_k=2)
SMOKE_DEEPSEEK = [("ragged kv_a", 72, 40), ("square", 64, 64)]


# ----------------------------------------------------------------------------------------------
# The baseline: dequantize with plain torch, then matmul
# ----------------------------------------------------------------------------------------------

def dequant_mxfp4(blocks, scales, dtype=torch.bfloat16):
    """[..., N, K/32, 16] uint8 + [..., N, K/32] e8m0 -> [..., N, K]: element 2j is byte j's low nibble."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    vals = torch.stack([lut[(blocks & 15).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    vals = vals * torch.exp2(scales.float() - 127)[..., None]
    return vals.flatten(-2).to(dtype)


def dequant_fp8(weight, scale_inv, block, dtype=torch.bfloat16):
    bn, bk = block
    n, k = weight.shape
    s = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * s).to(dtype)


def grouped_reference(x, counts, weights_of):
    """Rows of x sorted by expert; ``weights_of(e)`` gives expert e's dense [N, K]."""
    outs, r = [], 0
    for e, c in enumerate(counts):
        if c:
            outs.append(x[r:r + c] @ weights_of(e).T)
        r += c
    return torch.cat(outs)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, reps):
    """Median of ``reps`` calls after one warm-up (compilation), in ms."""
    out = fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    times.sort()
    return out, 1e3 * times[len(times) // 2]


def _row(name, m, fns, dev, reps, triton_ok):
    """Time each path (name -> fn), check they agree with the bf16 one, return the table row."""
    row = dict(shape=name, M=m)
    outs = {}
    for path, fn in fns.items():
        if path == "triton" and not triton_ok:
            row[path] = None
            continue
        outs[path], row[path] = _time(fn, dev, reps)
    ref = outs["bf16"].float()
    for path, out in outs.items():
        err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        if err > 2e-2:
            raise SystemExit(f"{name} M={m}: {path} disagrees with the bf16 matmul (relative error {err:.3g})")
    for path in ("deq+mm", "bf16"):
        row[f"{path}/triton"] = row[path] / row["triton"] if row.get("triton") else None
    return row


def moe_rows(cfg, ms, dev, dtype, reps, triton_ok, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    e, h, inter, top_k = cfg["experts"], cfg["hidden"], cfg["inter"], cfg["top_k"]
    rows = []
    for name, n, k in ((f"gpt-oss experts gate_up {h}->{2 * inter}", 2 * inter, h),
                       (f"gpt-oss experts down {inter}->{h}", h, inter)):
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, device=dev, dtype=torch.uint8)
        scales = torch.randint(118, 124, (e, n, k // 32), generator=g, device=dev, dtype=torch.uint8)
        dense = dequant_mxfp4(blocks, scales, dtype)  # for the bf16 column only
        for m in ms:
            choice = torch.rand(m, e, generator=g, device=dev).topk(top_k, dim=1).indices.flatten()
            counts = torch.bincount(choice, minlength=e)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            counts = counts.tolist()
            x = torch.randn(m * top_k, k, generator=g, device=dev, dtype=dtype)
            fns = {
                "triton": lambda: qt.mxfp4_grouped_matmul_triton(x, offsets, blocks, scales),
                "deq+mm": lambda: grouped_reference(x, counts, lambda i: dequant_mxfp4(blocks[i], scales[i], dtype)),
                "bf16": lambda: grouped_reference(x, counts, lambda i: dense[i]),
            }
            rows.append(_row(name, m, fns, dev, reps, triton_ok))
        del dense
    return rows


def fp8_rows(shapes, ms, dev, dtype, reps, triton_ok, block=(128, 128), seed=1):
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = []
    for name, k, n in shapes:
        weight = (torch.randn(n, k, generator=g, device=dev) * 100).to(torch.float8_e4m3fn)
        grid = (-(-n // block[0]), -(-k // block[1]))
        scale_inv = torch.rand(grid, generator=g, device=dev) * k**-0.5 / 50
        dense = dequant_fp8(weight, scale_inv, block, dtype)
        for m in ms:
            x = torch.randn(m, k, generator=g, device=dev, dtype=dtype)
            fns = {
                "triton": lambda: qt.fp8_matmul_triton(x, weight, scale_inv, block),
                "deq+mm": lambda: x @ dequant_fp8(weight, scale_inv, block, dtype).T,
                "bf16": lambda: x @ dense.T,
            }
            rows.append(_row(f"deepseek fp8 {name} {k}->{n}", m, fns, dev, reps, triton_ok))
        del dense
    return rows


def _ms(v):
    return "-" if v is None else f"{v:.3f}"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,64,512", help="token counts M, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", choices=["moe", "fp8"])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, each path once")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        dev, dtype, reps, ms = torch.device("cpu"), torch.bfloat16, 1, [1, 5]
        oss, deepseek, block = SMOKE_OSS, SMOKE_DEEPSEEK, (16, 32)
        triton_ok = interpreter_ready()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_quant times GPU kernels: no CUDA device here (use --cpu-smoke to check it runs)")
        dev, dtype, reps = torch.device("cuda"), torch.bfloat16, args.reps
        ms = [int(v) for v in args.ms.split(",")]
        oss, deepseek, block = GPT_OSS, DEEPSEEK, (128, 128)
        triton_ok = HAS_TRITON
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke: figures mean nothing)"
    print(f"# bench_quant on {name}, {dtype}, reps {reps}, triton {'on' if triton_ok else 'off'}")
    rows = []
    if args.only != "fp8":
        rows += moe_rows(oss, ms, dev, dtype, reps, triton_ok)
    if args.only != "moe":
        rows += fp8_rows(deepseek, ms, dev, dtype, reps, triton_ok, block)
    width = max(len(r["shape"]) for r in rows)
    print(f"{'shape':<{width}} {'M':>5} {'triton ms':>10} {'deq+mm ms':>10} {'bf16 ms':>9} "
          f"{'deq+mm/triton':>14} {'bf16/triton':>12}")
    for r in rows:
        print(f"{r['shape']:<{width}} {r['M']:>5} {_ms(r['triton']):>10} {_ms(r['deq+mm']):>10} "
              f"{_ms(r['bf16']):>9} {_ratio(r['deq+mm/triton']):>14} {_ratio(r['bf16/triton']):>12}")
    print(json.dumps(dict(device=name, dtype=str(dtype), reps=reps, rows=rows)))


if __name__ == "__main__":
    main()
