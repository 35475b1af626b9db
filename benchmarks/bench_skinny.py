"""The few-row linear (kernels/skinny.py) against F.linear (cuBLAS) at Qwen3-1.7B's decode shapes, bf16 (a script).

    python benchmarks/bench_skinny.py [--rows 1,2,4,8,16,32] [--dtype bf16|fp16|fp32] [--chain LAYERS] [--json]
    python benchmarks/bench_skinny.py --dry-run   # CPU: tiny shapes through Triton's interpreter

Qwen3-1.7B: hidden 2,048, 16 query heads and 8 KV heads of 128 dims, MLP 6,144, vocabulary 151,936. The
shapes (N x K): q/k/v fused 4,096 x 2,048 (as the engine runs them on a GPU: models/linear.fuse_dense) and
apart (q and o_proj 2,048 x 2,048, k and v 1,024 x 2,048: `--linear aten`), gate/up fused 12,288 x 2,048
and apart 6,144 x 2,048, down 2,048 x 6,144, the LM head 151,936 x 2,048. Per shape and row count M, microseconds of a call (10 calls captured in
a CUDA graph, replayed 5 times between CUDA events, the median: the device's time as a captured decode step
pays it, without the host's launch cost; each call reads another copy of the weight so that none is read
from the L2 cache: a decode step reads every weight once, cold; skinny.time_call, what the engine times) for F.linear and for every config of skinny.CONFIGS,
and GB/s of weight read (N x K x the element size over the time); `best` is the fastest config, `engine`
whether the engine's gemv="auto" would take it (5% faster than F.linear, engine/gemv.py). Each config
is also checked once: its output against F.linear's in fp32 (`max_diff`, relative to the largest value)
and, captured in a CUDA graph and replayed, the same bits as eager (`graph_ok`: no host sync, and the
split-K sum does not depend on scheduling). First line: the card's copy bandwidth (a 1 GiB device copy,
bytes read + written over the time) for reference. `--chain L` then times L decode layers' norms and
linears back to back in one graph (`chain`: each shape's best config at one row) with programmatic
dependent launch off, on, and on with the skinny kernel prefetching 1, 4 and 16 KB of each weight row
before it waits (kernels/pdl.py): what the boundaries between kernels cost, and which prefetch pays.
`--floor` measures what no linear kernel can beat: per shape, the time one launch takes to read the weight's
bytes and do nothing else (`read_floor`: a kernel that sums each program's contiguous chunk, the fastest of
FLOOR_LAUNCHES, cold copies as above), and each row's `of_floor` (the floor's time over the best config's: 1.0
reads as fast as a bare read); then `read_step`: a decode step's linears at Qwen3-1.7B's shape (q/k/v, o_proj,
gate/up, down for each of 28 layers, and the LM head) read by one such kernel each, back to back in one
graph, PDL off, on, and on with a prefetch before the wait, against the weight-streaming limit (those bytes over the card's sum-read rate, as
bench_decode.py takes it): the most a decode step of one kernel a linear could reach at one row.
With --json the last line is one JSON object.
On a machine without CUDA it says so and exits 0 (--dry-run runs the script on the CPU, interpreted).
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

H, I, V, Q, KV = 2048, 6144, 151936, 16 * 128, 8 * 128  # Qwen3-1.7B
SHAPES = {"qkv": (Q + 2 * KV, H), "q/o_proj": (H, H), "k/v": (KV, H), "gate_up": (2 * I, H), "gate/up": (I, H),
          "down": (H, I), "lm_head": (V, H)}
TINY = {"qkv": (48, 40), "down": (40, 72)}
TINY_STEP = {"qkv": (64, 32), "q/o_proj": (32, 32), "gate_up": (96, 32), "down": (32, 48), "lm_head": (160, 32)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_bandwidth(device, gib: float = 1.0) -> float:
    """GB/s of a device-to-device copy, bytes read plus written, best of 5."""
    n = int(gib * 2**30) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return round(2 * n * 4 / best / 1e9, 1)


def cpu_timer(weight, bias):
    """The dry run's timer: wall seconds of one interpreted call (checks the script, not the kernel's speed)."""
    from svrmad_local.kernels import skinny

    def timer(m, candidate):
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
        t0 = time.perf_counter()
        (torch.nn.functional.linear(x, weight, bias) if candidate == "torch" else
         skinny.skinny_linear(x, weight, bias, candidate))
        return time.perf_counter() - t0
    return timer


def check(weight, cfg, graphs: bool) -> dict:
    """The config's output at 3 rows against F.linear in fp32, and (on a GPU) replayed from a graph against eager."""
    from svrmad_local.kernels import skinny

    x = torch.randn(3, weight.shape[1], device=weight.device, dtype=weight.dtype)
    eager = skinny.skinny_linear(x, weight, None, cfg)
    ref = torch.nn.functional.linear(x.float(), weight.float())
    out = {"max_diff": float(((eager.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())}
    if graphs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = skinny.skinny_linear(x, weight, None, cfg)
        g.replay()
        torch.cuda.synchronize()
        out["graph_ok"] = bool(torch.equal(captured, eager))
    return out


PREFETCHES = (1024, 4096, 16384)  # a row's first bytes, a 2,048-wide bf16 row, whole rows up to 8,192 wide


def chain(device, dtype, picks: dict, layers: int, dims=(H, I, Q, KV), prefetches=PREFETCHES) -> dict:
    """A decode layer's norms and linears back to back, `layers` layers of their own weights, one row, as a
    captured step runs them: add + RMSNorm, q/k/v, o_proj, add + RMSNorm, gate/up, down with SiLU(gate) * up
    (Qwen3-1.7B's shapes; `picks` the config per shape). Microseconds a layer and GB/s of weight read, in
    `arms`: every kernel launched after the one before ends (`off`), launched while it runs (`on`,
    kernels/pdl.py), and so with the skinny kernel prefetching each of `prefetches` bytes of its rows before
    it waits (`prefetch_B`; skinny.PREFETCH_BYTES is the engine's); whether all give the same bits. On the
    CPU (the dry run) each arm runs once eagerly, PDL off."""
    from svrmad_local.kernels import fused_triton, pdl, skinny

    h, i, q, kv = dims
    shapes = {"qkv": (q + 2 * kv, h), "q/o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}
    ws = [{name: torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5 for name, (n, k) in shapes.items()}
          for _ in range(layers)]
    norm = torch.ones(h, device=device, dtype=dtype)
    x = torch.randn(1, h, device=device, dtype=dtype)
    cfg = {name: picks.get(name, skinny.DEFAULT) for name in shapes}

    def step():
        out, res = x, x
        for w in ws:
            y, res = fused_triton.add_rms_norm(out, res, norm, 1e-6)
            a = skinny.skinny_linear(y, w["qkv"], None, cfg["qkv"])[:, :q]
            y, res = fused_triton.add_rms_norm(skinny.skinny_linear(a, w["q/o_proj"], None, cfg["q/o_proj"]), res,
                                               norm, 1e-6)
            gu = skinny.skinny_linear(y, w["gate_up"], None, cfg["gate_up"])
            out = skinny.skinny_linear(gu[:, :i], w["down"], None, cfg["down"], up=gu[:, i:])
        return out

    why = pdl.why_not(device)
    arms = {"off": (False, 0)}
    if why is None:
        arms.update(on=(True, 0), **{f"prefetch_{b}": (True, b) for b in prefetches})
    gb = sum(n * k for n, k in shapes.values()) * x.element_size() / 1e9
    result = {"layers": layers, "pdl": why or "on", "configs": {k: str(v) for k, v in cfg.items()},
              "engine_prefetch": skinny.PREFETCH_BYTES, "arms": {}}
    outs, kept = {}, (pdl.use(False), skinny.PREFETCH_BYTES)
    try:
        for arm, (on, prefetch) in arms.items():
            pdl.use(on)
            skinny.PREFETCH_BYTES = prefetch
            if device.type == "cuda":
                seconds = skinny.time_call(step, reps=5, inner=1)
                outs[arm] = step()
            else:
                t0 = time.perf_counter()
                outs[arm] = step()
                seconds = time.perf_counter() - t0
            result["arms"][arm] = {"us_per_layer": round(seconds / layers * 1e6, 2),
                                   "gbps": round(gb * layers / seconds, 1)}
    finally:
        pdl.use(kept[0])
        skinny.PREFETCH_BYTES = kept[1]
    first = next(iter(outs.values()))
    result["same_bits"] = all(torch.equal(first, o) for o in outs.values())
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="row counts, comma-separated (default: the engine's, skinny.ROWS)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--shapes", help=f"comma-separated names of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes through Triton's interpreter")
    ap.add_argument("--floor", action="store_true",
                    help="also time a bare read of each weight (what no linear beats) and a decode step's linears "
                         "read bare, one kernel each, against the weight-streaming limit")
    ap.add_argument("--chain", type=int, default=0, metavar="LAYERS",
                    help="also time that many decode layers' norms and linears back to back in one graph, with "
                         "programmatic dependent launch off, on, and on with the weight prefetch")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench_skinny: needs CUDA (--dry-run checks the script on the CPU)")
        return 0
    from svrmad_local.engine import gemv
    from svrmad_local.kernels import skinny

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = DTYPES[args.dtype]
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(skinny.ROWS)
    shapes = TINY if args.dry_run else {k: SHAPES[k] for k in (args.shapes.split(",") if args.shapes else SHAPES)}
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreted)",
              "dtype": args.dtype, "margin": gemv.MARGIN, "shapes": {}}
    if device.type == "cuda":
        result["copy_gbps"] = copy_bandwidth(device)
        print(f"{result['device']}: copy {result['copy_gbps']} GB/s (read + write)")
    torch.manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        timer = cpu_timer(w, None) if args.dry_run else skinny.cuda_timer(w, None)
        gb = n * k * w.element_size() / 1e9
        shape = result["shapes"][name] = {"n": n, "k": k, "checks": {}, "rows": {}}
        for cfg in skinny.CONFIGS:
            try:
                shape["checks"][str(cfg)] = check(w, cfg, graphs=device.type == "cuda")
            except Exception as exc:  # noqa: BLE001 - a config that fails here is one line of the table
                shape["checks"][str(cfg)] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        for m in rows:
            torch_s = timer(m, "torch")
            times = {str(c): timer(m, c) for c in skinny.CONFIGS
                     if "error" not in shape["checks"][str(c)] and skinny.runs(c, m)}
            best = min(times, key=times.get) if times else None
            row = shape["rows"][m] = {
                "torch_us": round(torch_s * 1e6, 2), "torch_gbps": round(gb / torch_s, 1),
                "configs_us": {c: round(t * 1e6, 2) for c, t in times.items()}, "best": best}
            if best is not None:
                row.update(best_us=round(times[best] * 1e6, 2), best_gbps=round(gb / times[best], 1),
                           speedup=round(torch_s / times[best], 3),
                           # what the engine's choice would take here: its own rule over these figures
                           engine=bool(gemv.pick({f"{n}x{k}": {str(m): {"torch": torch_s, **times}}})))
            print(f"{name:9s} {n:>6d}x{k:<5d} M={m}: F.linear {row['torch_us']:8.2f} us {row['torch_gbps']:7.1f} GB/s"
                  + (f" | skinny {row['best_us']:8.2f} us {row['best_gbps']:7.1f} GB/s ({best}) x{row['speedup']:.2f}"
                     f"{' taken' if row['engine'] else ''}" if best else " | skinny: no config ran"))
        bad = {c: v for c, v in shape["checks"].items() if "error" in v or not v.get("graph_ok", True)
               or v["max_diff"] > 2e-2}
        if bad:
            print(f"{name}: configs that failed their check: {bad}")
    if args.chain:
        by_name = {str(c): c for c in skinny.CONFIGS}
        picks = {name: by_name[shape["rows"][1]["best"]] for name, shape in result["shapes"].items()
                 if 1 in shape["rows"] and shape["rows"][1].get("best")}
        c = result["chain"] = chain(device, dtype, picks, args.chain, dims=(32, 24, 32, 16) if args.dry_run else
                                    (H, I, Q, KV))
        print(f"chain of {c['layers']} layers (PDL: {c['pdl']}): " + ", ".join(
            f"{arm} {a['us_per_layer']} us a layer ({a['gbps']} GB/s)" for arm, a in c["arms"].items())
            + f"; same bits: {c['same_bits']}")
    failed = None
    if args.floor:
        try:
            add_floors(result, device, dtype, args.dry_run)
        except Exception as exc:  # noqa: BLE001 - the configs' figures above still come out, and the run fails
            failed = result["floor_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"bench_skinny --floor: {failed}")
    if args.json:
        print(json.dumps(result))
    return 1 if failed else 0


def add_floors(result: dict, device, dtype, dry: bool) -> None:
    """--floor: each timed shape's bare read (`read_floor`) and each of its rows' `of_floor`; then the step of
    bare reads (`read_step`: 28 layers at Qwen3-1.7B's shapes, 2 at TINY_STEP's in the dry run)."""
    import read_floor as floor  # here, after main set TRITON_INTERPRET: a kernel is jitted or interpreted as defined
    from bench_decode import read_bandwidth

    for name, shape in result["shapes"].items():
        f = shape["read_floor"] = floor.read_floor(torch.randn(shape["n"], shape["k"], device=device, dtype=dtype))
        print(f"{name:9s} {shape['n']:>6d}x{shape['k']:<5d} a bare read: {f['us']:8.2f} us {f['gbps']:7.1f} GB/s "
              f"({f['launch']})")
        for row in shape["rows"].values():
            if row.get("best_us"):  # 1.0: the config reads as fast as the bare read of its bytes
                row["of_floor"] = round(f["us"] / row["best_us"], 3)
    step_shapes = TINY_STEP if dry else SHAPES
    floors = {name: result["shapes"][name]["read_floor"] if name in result["shapes"] and step_shapes is SHAPES else
              floor.read_floor(torch.randn(*step_shapes[name], device=device, dtype=dtype))
              for name in floor.STEP + ("lm_head",)}
    gbps = round(read_bandwidth(16 if dry else 512, device=device) / 1e9, 1)
    r = result["read_step"] = floor.read_step(device, dtype, step_shapes, floors, 2 if dry else 28, gbps)
    print(f"a decode step's {r['launches']} linears ({r['gb']} GB) read bare, one kernel each: " + ", ".join(
        f"PDL {arm} {a['ms']} ms ({a['gbps']} GB/s, {a.get('of_limit', 0):.0%} of the weight-streaming limit)"
        for arm, a in r["arms"].items()) + f"; the card's sum read {gbps} GB/s")


if __name__ == "__main__":
    sys.exit(main())
