"""SiLU-and-multiply on the CPU (kernels/cpu_ops.py `silu_mul`) at its loop widths, side by side in one run.

    python benchmarks/bench_silu_mul.py [--batches 1,8,32] [--inter 1536] [--dtype bf16|fp32] [--repeat 300]

The two halves of one gate/up output [B, 2 x inter] (the default model's MLP: inter 1,536), as the decoder
hands them over. For each batch B: microseconds a call (the median of --repeat) of the compiled op at this
CPU's level (sixteen lanes where the build and the CPU have AVX-512), of the same op capped at its eight-lane
AVX2 loop, and of torch's `F.silu(gate) * up`; the two compiled widths' outputs must be the same bits (the run
stops otherwise). A decode step calls it once a layer (30 layers in the default). The last line is one JSON
object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from svrmad_local.kernels import cpu_ops  # noqa: E402


def median_us(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--inter", type=int, default=1536, help="the MLP's width (default 1536, the default model's)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args(argv)
    if not cpu_ops.available():
        print(f"bench_silu_mul: no compiled CPU ops here: {cpu_ops.unavailable_reason()}")
        return 0
    mod = cpu_ops._KERNEL.module()
    full = mod.set_isa_level(99)
    wide = mod.isa_level() >= 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = []
    try:
        for B in (int(b) for b in args.batches.split(",")):
            gate_up = (torch.randn(B, 2 * args.inter, generator=torch.Generator().manual_seed(B)) * 4).to(dtype)
            gate, up = gate_up[:, :args.inter], gate_up[:, args.inter:]
            row = {"batch": B}
            outs = {}
            for name, level in (("level_us", full), ("avx2_loop_us", 0)):
                mod.set_isa_level(level)
                outs[name] = cpu_ops.silu_mul(gate, up)
                row[name] = median_us(lambda: cpu_ops.silu_mul(gate, up), args.repeat)
            mod.set_isa_level(full)
            if not torch.equal(outs["level_us"], outs["avx2_loop_us"]):
                raise SystemExit(f"batch {B}: the sixteen-lane loop's output is not the eight-lane loop's")
            row["torch_us"] = median_us(lambda: F.silu(gate) * up, args.repeat)
            row["avx2_over_level"] = round(row["avx2_loop_us"] / row["level_us"], 2)
            rows.append(row)
            print(f"batch {B:3d}: {row['level_us']:8.2f} us at this CPU's level, {row['avx2_loop_us']:8.2f} us on the "
                  f"AVX2 loop ({row['avx2_over_level']}x), torch {row['torch_us']:8.2f} us")
    finally:
        mod.set_isa_level(full)
    print(json.dumps({"dtype": args.dtype, "inter": args.inter, "sixteen_lanes": wide, "isa_level": full,
                      "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
