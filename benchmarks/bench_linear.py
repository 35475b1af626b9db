"""F.linear against oneDNN (packed once, and on the dense weight) and our panels, at a model's linear shapes.

Per shape: for each distinct (out, in) of the model's nn.Linear modules (LM head included) and each M
(rows of a step), the best of --repeat runs of each path, side by side. A weight that small stays in
cache across repeats, which a real step never sees; so the second table runs every linear of the
model once per "step", each with its own weights (the model's own, as the engine packs them: q/k/v
and gate/up fused), the way a decode step streams them from memory. Last line one JSON object.
What `--linear auto` measures and chooses on this machine: benchmarks/bench_calibrate.py.

    python benchmarks/bench_linear.py [--model PATH] [--dtype fp32|bf16] [--rows 1,8,24,64]
                                      [--step-rows 1,4,8,24,64,512] [--repeat 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from svrmad_local.models.default import ensure_default_model  # noqa: E402
from svrmad_local.kernels import cpu_linear  # noqa: E402
from svrmad_local.models.layouts import BATCH_HINT  # noqa: E402
from svrmad_local.models.linear import select_linear  # noqa: E402
from svrmad_local.models.loader import load_model  # noqa: E402


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", default="1,8,24,64")
    ap.add_argument("--step-rows", default="1,4,8,24,64,512")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch build has no oneDNN")
    model = load_model(args.model or ensure_default_model(), device="cpu", dtype=args.dtype).model
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    rows = [int(r) for r in args.rows.split(",")]
    table = []
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, {args.dtype}; "
          f"panels on {cpu_linear.isa() if cpu_linear.available() else '-'}; ms per call")
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        panels = cpu_linear.pack(w) if cpu_linear.available() else None
        for m in rows:
            x = torch.randn(m, in_f).to(dtype)
            aten = best_ms(lambda: torch.nn.functional.linear(x, w), args.repeat)
            pk = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.repeat)
            dense = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), args.repeat)
            pn = best_ms(lambda: cpu_linear.linear(x, panels, out_f), args.repeat) if panels is not None else float("nan")
            table.append({"out": out_f, "in": in_f, "M": m, "aten_ms": round(aten, 4), "onednn_packed_ms": round(pk, 4),
                          "onednn_dense_ms": round(dense, 4), "panels_ms": round(pn, 4),
                          "aten_over_packed": round(aten / pk, 2)})
            print(f"{out_f:6d}x{in_f:<5d} M={m:<3d} F.linear {aten:8.3f}   oneDNN packed {pk:8.3f} ({aten / pk:4.1f}x)"
                  f"   oneDNN dense {dense:8.3f} ({aten / dense:4.1f}x)   panels {pn:8.3f} ({aten / pn:4.1f}x)")
    steps = step_table(args.model, [int(r) for r in args.step_rows.split(",")], args.dtype)
    print(json.dumps({"cpu": torch.backends.cpu.get_cpu_capability(), "dtype": args.dtype, "rows": table, "steps": steps}))
    return 0


def step_table(model_path, rows: list[int], dtype: str = "fp32") -> list[dict]:
    """ms for every linear of the model once (one step's worth), oneDNN packed against panels."""
    backends = ["onednn"] + (["panels"] if cpu_linear.available() else [])
    linears = {}
    for b in backends:
        model = load_model(model_path or ensure_default_model(), device="cpu", dtype=dtype).model
        select_linear(model, b)
        # one call a GEMM: a fused group's first part computes the whole group
        mods = [m for m in model.modules() if type(m).__name__ in ("PackedLinear", "FusedGroup")]
        linears[b] = [(m, m.in_features) for m in mods]
    print("\nevery linear of the model once, distinct weights (a decode step's stream); ms")
    out = []
    for m in rows:
        row = {"M": m}
        for b in backends:
            xs = {k: torch.randn(m, k).to(linears[b][0][0].weight.dtype) for _, k in linears[b]}
            row[f"{b}_ms"] = round(best_ms(lambda: [mod(xs[k]) for mod, k in linears[b]], 3 if m <= 64 else 1), 2)
        if "panels_ms" in row:
            row["onednn_over_panels"] = round(row["onednn_ms"] / row["panels_ms"], 2)
        print("  ".join(f"{k} {v}" for k, v in row.items()))
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
