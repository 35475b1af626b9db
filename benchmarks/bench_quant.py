"""Benchmark of the packed-weight GEMMs (a script, not a test).

    python benchmarks/bench_quant.py [--ms 1,8,64,512] [--reps 20] [--only moe|fp8|experts] [--sweep]
    python benchmarks/bench_quant.py --cpu-smoke      # tiny shapes on the CPU: checks it runs

Times, per shape and M (tokens), on CUDA:
- ``triton``: our kernel on the packed bytes (kernels/quant_triton.py);
- ``deq+mm``: dequantize-then-matmul, what runs without a packed kernel: the packed weight is
  expanded to bf16 at every call (per expert for the MoE), then ``x @ W^T``;
- ``bf16``: the matmul alone on weights dequantized beforehand (the speed a bf16 checkpoint would
  give, at 2-4x the memory), the bar a packed kernel should approach at large M and beat at small M,
  where reading the weight is the cost.
and prints ``deq+mm / triton`` and ``bf16 / triton`` side by side (above 1: ours is faster), and the
bytes our kernel reads (the packed weights of the experts that got rows, with their scales; x; the
output) over its time: GB/s, and the fraction of the device's read bandwidth (a large tensor's sum).

``--sweep``: at M = 1 (decode) each dense shape is also timed under a few other tilings (column tile
32 / 64 / 128, split-K off, the table's, twice it; kernels/quant_triton.py `Tiles`), the fastest named:
what the table per GPU generation (`TILE_TABLE`) should say.

Shapes: GPT-OSS-120B experts (hidden 2880, intermediate 2880, 128 experts, top-4; gate_up 2880 ->
5760, down 2880 -> 2880; M tokens route 4M rows, uniformly at random) and DeepSeek-V3.1 FP8
projections with 128 x 128 blocks (q_a 7168 -> 1536, q_b 1536 -> 24576, kv_a_proj_with_mqa 7168 ->
576, kv_b 512 -> 32768, o 16384 -> 7168, experts 7168 -> 2048 and 2048 -> 7168; and the routed experts as
the grouped GEMM, 8 of 256 a token: gate and up 7168 -> 4096, down 2048 -> 7168).

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
DEEPSEEK_EXPERTS = dict(experts=256, top_k=8, shapes=[("gate/up", 7168, 4096), ("down", 2048, 7168)])
SMOKE_OSS = dict(hidden=64, inter=32, experts=4, top_k=2)
SMOKE_DEEPSEEK = [("ragged kv_a", 72, 40), ("square", 64, 64)]
SMOKE_EXPERTS = dict(experts=5, top_k=2, shapes=[("gate/up", 64, 48)])


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


def read_bandwidth(dev, mib: int = 1024) -> float:
    """Bytes/s of a sum over a tensor far larger than any cache (best of a few): the device's read rate."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=dev)
    _, ms = _time(lambda: x.sum(), dev, 5)
    return x.numel() * 4 / (ms / 1e3)


def _row(name, m, fns, dev, reps, triton_ok, read_bytes=None, bandwidth=None):
    """Time each path (name -> fn), check they agree with the bf16 one, return the table row; with
    `read_bytes` (what our kernel reads), its GB/s and fraction of `bandwidth`."""
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
    if read_bytes is not None and row.get("triton"):
        row["read_bytes"] = read_bytes
        row["triton_gb_s"] = read_bytes / (row["triton"] / 1e3) / 1e9
        row["of_bandwidth"] = row["triton_gb_s"] * 1e9 / bandwidth if bandwidth else None
    return row


def _sweep(name, call, k, n, dev, reps, read_bytes, bandwidth, k_unit):
    """M = 1 under other tilings than the table's; the fastest named (what the table should say)."""
    base = qt.tiles(1, n, k, k_unit, dev)
    cands = {"table": base}
    for bn in (32, 64, 128):
        for split in sorted({1, base.split_k, 2 * base.split_k}):
            cands[f"bn{bn}-split{split}"] = qt.Tiles(base.block_m, bn, base.block_k, split, base.num_warps,
                                                     base.num_stages)
    times = {label: _time(lambda: call(cfg), dev, reps)[1] for label, cfg in cands.items()}
    best = min(times, key=times.get)
    return dict(shape=name, table=str(base), times_ms=times, best=best,
                best_of_bandwidth=read_bytes / (times[best] / 1e3) / bandwidth if bandwidth else None)


def _mxfp4_bytes(blocks, active: int, m: int, k: int, n: int, item: int) -> int:
    """Bytes an MXFP4 GEMM reads and writes: `active` experts' (or the matrix's) codes and scales, x, out."""
    per = blocks[0].numel() * 17 // 16 if blocks.dim() == 4 else blocks.numel() * 17 // 16
    return active * per + m * k * item + m * n * item


def routed(g, m: int, e: int, top_k: int, k: int, dev, dtype):
    """(offsets [E+1], rows per expert, x [m * top_k, K]) of m tokens routed to top_k of e experts at random."""
    choice = torch.rand(m, e, generator=g, device=dev).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(choice, minlength=e)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return offsets, counts.tolist(), torch.randn(m * top_k, k, generator=g, device=dev, dtype=dtype)


def moe_rows(cfg, ms, dev, dtype, reps, triton_ok, seed=0, bandwidth=None):
    g = torch.Generator(device=dev).manual_seed(seed)
    e, h, inter, top_k = cfg["experts"], cfg["hidden"], cfg["inter"], cfg["top_k"]
    rows = []
    for name, n, k in ((f"gpt-oss experts gate_up {h}->{2 * inter}", 2 * inter, h),
                       (f"gpt-oss experts down {inter}->{h}", h, inter)):
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, device=dev, dtype=torch.uint8)
        scales = torch.randint(118, 124, (e, n, k // 32), generator=g, device=dev, dtype=torch.uint8)
        dense = dequant_mxfp4(blocks, scales, dtype)  # for the bf16 column only
        for m in ms:
            offsets, counts, x = routed(g, m, e, top_k, k, dev, dtype)
            fns = {
                "triton": lambda: qt.mxfp4_grouped_matmul_triton(x, offsets, blocks, scales),
                "deq+mm": lambda: grouped_reference(x, counts, lambda i: dequant_mxfp4(blocks[i], scales[i], dtype)),
                "bf16": lambda: grouped_reference(x, counts, lambda i: dense[i]),
            }
            active = sum(1 for c in counts if c)
            rows.append(_row(name, m, fns, dev, reps, triton_ok,
                             _mxfp4_bytes(blocks, active, m * top_k, k, n, x.element_size()), bandwidth))
        del dense
    return rows


def fp8_rows(shapes, ms, dev, dtype, reps, triton_ok, block=(128, 128), seed=1, bandwidth=None, sweep=None):
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
            read = weight.numel() + scale_inv.numel() * 4 + m * k * x.element_size() + m * n * x.element_size()
            rows.append(_row(f"deepseek fp8 {name} {k}->{n}", m, fns, dev, reps, triton_ok, read, bandwidth))
            if sweep is not None and m == 1 and triton_ok:
                sweep.append(_sweep(f"deepseek fp8 {name} {k}->{n}", lambda cfg: qt.fp8_matmul_triton(
                    x, weight, scale_inv, block, cfg=cfg), k, n, dev, reps, read, bandwidth, 16))
        del dense
    return rows


def fp8_expert_rows(cfg, ms, dev, dtype, reps, triton_ok, block=(128, 128), seed=2, bandwidth=None):
    """DeepSeek's routed experts as the grouped GEMM (rows sorted by expert, `top_k` of the experts a token)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    e, top_k = cfg["experts"], cfg["top_k"]
    rows = []
    for name, k, n in cfg["shapes"]:
        weight = (torch.randn(e, n, k, generator=g, device=dev) * 100).to(torch.float8_e4m3fn)
        scale_inv = torch.rand(e, -(-n // block[0]), -(-k // block[1]), generator=g, device=dev) * k**-0.5 / 50
        for m in ms:
            offsets, counts, x = routed(g, m, e, top_k, k, dev, dtype)
            dense = {i: dequant_fp8(weight[i], scale_inv[i], block, dtype) for i, c in enumerate(counts) if c}
            fns = {
                "triton": lambda: qt.fp8_grouped_matmul_triton(x, offsets, weight, scale_inv, block),
                "deq+mm": lambda: grouped_reference(x, counts, lambda i: dequant_fp8(weight[i], scale_inv[i], block,
                                                                                     dtype)),
                "bf16": lambda: grouped_reference(x, counts, lambda i: dense[i]),
            }
            active = len(dense)
            read = active * (n * k + scale_inv[0].numel() * 4) + m * top_k * (k + n) * x.element_size()
            rows.append(_row(f"deepseek fp8 experts {name} {k}->{n} ({top_k} of {e})", m, fns, dev, reps, triton_ok,
                             read, bandwidth))
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
    ap.add_argument("--only", choices=["moe", "fp8", "experts"])
    ap.add_argument("--sweep", action="store_true", help="at M = 1, time other tilings of each dense shape too")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, each path once")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        dev, dtype, reps, ms = torch.device("cpu"), torch.bfloat16, 1, [1, 5]
        oss, deepseek, experts, block = SMOKE_OSS, SMOKE_DEEPSEEK, SMOKE_EXPERTS, (16, 32)
        triton_ok = interpreter_ready()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_quant times GPU kernels: no CUDA device here (use --cpu-smoke to check it runs)")
        dev, dtype, reps = torch.device("cuda"), torch.bfloat16, args.reps
        ms = [int(v) for v in args.ms.split(",")]
        oss, deepseek, experts, block = GPT_OSS, DEEPSEEK, DEEPSEEK_EXPERTS, (128, 128)
        triton_ok = HAS_TRITON
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke: figures mean nothing)"
    print(f"# bench_quant on {name}, {dtype}, reps {reps}, triton {'on' if triton_ok else 'off'}")
    bandwidth = read_bandwidth(dev, 64 if args.cpu_smoke else 1024)
    print(f"# read bandwidth {bandwidth / 1e9:.0f} GB/s (a tensor's sum)")
    rows, sweep = [], [] if args.sweep else None
    if args.only in (None, "moe"):
        rows += moe_rows(oss, ms, dev, dtype, reps, triton_ok, bandwidth=bandwidth)
    if args.only in (None, "fp8"):
        rows += fp8_rows(deepseek, ms, dev, dtype, reps, triton_ok, block, bandwidth=bandwidth, sweep=sweep)
    if args.only in (None, "experts"):
        rows += fp8_expert_rows(experts, ms, dev, dtype, reps, triton_ok, block, bandwidth=bandwidth)
    width = max(len(r["shape"]) for r in rows)
    print(f"{'shape':<{width}} {'M':>5} {'triton ms':>10} {'deq+mm ms':>10} {'bf16 ms':>9} "
          f"{'deq+mm/triton':>14} {'bf16/triton':>12} {'GB/s':>7} {'of bw':>6}")
    for r in rows:
        gbs, frac = r.get("triton_gb_s"), r.get("of_bandwidth")
        print(f"{r['shape']:<{width}} {r['M']:>5} {_ms(r['triton']):>10} {_ms(r['deq+mm']):>10} "
              f"{_ms(r['bf16']):>9} {_ratio(r['deq+mm/triton']):>14} {_ratio(r['bf16/triton']):>12} "
              f"{'-' if gbs is None else f'{gbs:.0f}':>7} {'-' if frac is None else f'{frac:.0%}':>6}")
    for r in sweep or []:
        print(f"sweep {r['shape']}: best {r['best']} ({r['times_ms'][r['best']]:.4f} ms, table "
              f"{r['times_ms']['table']:.4f} ms)")
    print(json.dumps(dict(device=name, dtype=str(dtype), reps=reps, bandwidth_gb_s=bandwidth / 1e9, rows=rows,
                          sweep=sweep)))


if __name__ == "__main__":
    main()
