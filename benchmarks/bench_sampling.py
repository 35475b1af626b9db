"""A decode step's sampling and token statistics on the CPU: the compiled step (kernels/cpu_ops.py
`sample_pack`: torch's ops called from C++, its top-k and argmax compiled selections) against the same
torch ops called one by one from Python, side by side in one process (a script).

    python benchmarks/bench_sampling.py [--batches 1,8,32] [--vocabs 49152,151936] [--rounds 7] [--greedy]

For each vocabulary and batch size, the rows' fp32 logits (bf16-rounded random values, as a bf16 LM head
gives: ties near the top) go through what `Step._sample` runs after the LM head, `sampler.sample_packed`:
the sampling (top-k 40, top-p 0.95, a seeded draw per row; `--greedy`: the argmax), the statistics
(log-softmax, entropy, the chosen token's log-prob, the top 20) and their packing for the host. Each round
times both sides once, alternating (SVRMAD_CPU_OPS=0 for torch's side: `sample_rows`, `stats_from_logits`
and `pack` from Python, torch's own top-k and argmax), so both meet the machine's same moments; prints the
medians in ms and their ratio (> 1: the compiled side is faster), and fails if the two sides' packed rows
differ in any bit. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from svrmad_local.engine import sampler
from svrmad_local.engine.config import SamplingParams
from svrmad_local.kernels import cpu_ops


def step(logits: torch.Tensor, params: list[SamplingParams], seed: int) -> torch.Tensor:
    draws = sampler.prepare(params, [random.Random(seed + i) for i in range(len(params))], logits.shape[1])
    return sampler.sample_packed(logits, draws)


def timed(logits, params, seed: int, compiled: bool) -> tuple[float, torch.Tensor]:
    if compiled:
        os.environ.pop("SVRMAD_CPU_OPS", None)
    else:
        os.environ["SVRMAD_CPU_OPS"] = "0"
    try:
        t0 = time.perf_counter()
        out = step(logits, params, seed)
        return (time.perf_counter() - t0) * 1e3, out
    finally:
        os.environ.pop("SVRMAD_CPU_OPS", None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocabs", default="49152,151936")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--greedy", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("SVRMAD_CPU_OPS") == "0" or not cpu_ops.available():
        raise SystemExit(f"bench_sampling: the compiled ops do not run here: {cpu_ops.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for V in (int(v) for v in args.vocabs.split(",")):
        for B in (int(b) for b in args.batches.split(",")):
            params = [SamplingParams(temperature=0.0 if args.greedy else 1.0)] * B
            ms = {"compiled": [], "torch": []}
            for r in range(args.rounds + 1):  # round 0 warms both sides up, untimed
                logits = (torch.randn(B, V, generator=gen) * 3).bfloat16().float()
                (t_c, out_c), (t_t, out_t) = (timed(logits, params, r, c) for c in (True, False))
                if not torch.equal(out_c, out_t):
                    raise SystemExit(f"bench_sampling: the two sides differ at vocab {V}, batch {B}")
                if r:
                    ms["compiled"].append(t_c)
                    ms["torch"].append(t_t)
            med = {k: round(statistics.median(v), 3) for k, v in ms.items()}  # the ratio is of the figures shown
            rows.append({"vocab": V, "batch": B, "compiled_ms": med["compiled"], "torch_ms": med["torch"],
                         "ratio": round(med["torch"] / med["compiled"], 2)})
            print(f"vocab {V:7d} batch {B:3d}: compiled {med['compiled']:8.3f} ms   torch {med['torch']:8.3f} ms   "
                  f"{rows[-1]['ratio']:.2f}x  (medians of {args.rounds}, alternating; the same bits)", flush=True)
    print(json.dumps({"greedy": args.greedy, "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
