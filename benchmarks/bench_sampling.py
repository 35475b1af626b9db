"""A decode step's sampling and token statistics on the CPU: the compiled step (kernels/cpu_ops.py
`sample_pack`: the draw as torch's ops called from C++ with its compiled top-k and argmax, the statistics
in one pass of its own) against torch's ops called one by one from Python, side by side in one process
(a script).

    python benchmarks/bench_sampling.py [--batches 1,8,32] [--vocabs 49152,151936] [--rounds 7] [--greedy]
        [--device cuda [--replays 50]]

For each vocabulary and batch size, the rows' fp32 logits (bf16-rounded random values, as a bf16 LM head
gives: ties near the top) go through what `Step._sample` runs after the LM head, `sampler.sample_packed`:
the sampling (top-k 40, top-p 0.95, a seeded draw per row; `--greedy`: the argmax), the statistics
(log-softmax, entropy, the chosen token's log-prob, the top 20) and their packing for the host. Each round
times both sides once, alternating (SVRMAD_CPU_OPS=0 for torch's side: `sample_rows`, `stats_from_logits`
and `pack` from Python, torch's own top-k and argmax), so both meet the machine's same moments; prints the
medians in ms and their ratio (> 1: the compiled side is faster), and fails if the two sides' tokens or
top ids differ, or the compiled side's log-probs differ from torch's, or its entropies from a float64
truth, by more than float rounding (engine/stats.py `disagreement`: the statistics sum in another order).
Last line: one JSON object.

On a GPU (`--device cuda`), the two Triton kernels (kernels/sample_pack.py) against torch's ops, each
captured in a CUDA graph as the static decode step holds them and replayed `--replays` times a round
(CUDA events): the median us a step, their ratio, and how far the two sides' rows agree (tokens, ids
and the largest log-prob difference: they sum in other orders, so bits may differ; equal bf16 logits in a
row's top-k order lower id first in the kernels, in an order of torch's own in its top-k).
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

from svrmad_local.engine import sampler, stats
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


def on_gpu(args) -> int:
    """The Triton kernels against torch's ops, each side replayed from its own CUDA graph."""
    from svrmad_local.kernels import sample_pack

    dev, gen, rows = torch.device(args.device), torch.Generator().manual_seed(0), []
    K, topk = sampler.SAMPLE_TOP_K, stats.STATS_TOP_K

    def torch_side(logits, table):
        return sampler.packed_by_torch(logits, table, K, topk)

    def graphed(fn, *inputs):
        fn(*inputs)  # compiles the Triton kernels, warms torch's up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(*inputs)
        return g, out

    for V in (int(v) for v in args.vocabs.split(",")):
        for B in (int(b) for b in args.batches.split(",")):
            logits = (torch.randn(B, V, generator=gen) * 3).bfloat16().float().to(dev)
            params = [SamplingParams(temperature=0.0 if args.greedy else 1.0)] * B
            table = torch.from_numpy(sampler.prepare(params, [random.Random(i) for i in range(B)], V).table).to(dev)
            sides = {"triton": graphed(lambda x, t: sample_pack.sample_pack(x, t, K, topk), logits, table),
                     "torch": graphed(torch_side, logits, table)}
            us = {k: [] for k in sides}
            for r in range(args.rounds + 1):
                for name, (g, _) in sides.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(args.replays):
                        g.replay()
                    end.record()
                    end.synchronize()
                    if r:
                        us[name].append(start.elapsed_time(end) * 1e3 / args.replays)
            a, b = sides["triton"][1], sides["torch"][1]
            med = {k: round(statistics.median(v), 2) for k, v in us.items()}
            rows.append({"vocab": V, "batch": B, "triton_us": med["triton"], "torch_us": med["torch"],
                         "ratio": round(med["torch"] / med["triton"], 2),
                         "tokens_equal": int((a[:, 0] == b[:, 0]).sum()), "rows": B,
                         "ids_equal": bool(torch.equal(a[:, 3 + topk:], b[:, 3 + topk:])),
                         "max_logprob_diff": float((a[:, 1] - b[:, 1]).abs().max())})
            print(f"vocab {V:7d} batch {B:3d}: triton {med['triton']:8.2f} us   torch {med['torch']:8.2f} us   "
                  f"{rows[-1]['ratio']:.2f}x  tokens equal {rows[-1]['tokens_equal']}/{B}", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "greedy": args.greedy, "rows": rows}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocabs", default="49152,151936")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--replays", type=int, default=50, help="graph replays a round (--device cuda)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_sampling: --device cuda needs a CUDA device")
        return on_gpu(args)
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
                why = stats.disagreement(out_c, out_t, logits, stats.STATS_TOP_K)
                if why:
                    raise SystemExit(f"bench_sampling: the two sides differ at vocab {V}, batch {B}: {why}")
                if r:
                    ms["compiled"].append(t_c)
                    ms["torch"].append(t_t)
            med = {k: round(statistics.median(v), 3) for k, v in ms.items()}  # the ratio is of the figures shown
            rows.append({"vocab": V, "batch": B, "compiled_ms": med["compiled"], "torch_ms": med["torch"],
                         "ratio": round(med["torch"] / med["compiled"], 2)})
            print(f"vocab {V:7d} batch {B:3d}: compiled {med['compiled']:8.3f} ms   torch {med['torch']:8.3f} ms   "
                  f"{rows[-1]['ratio']:.2f}x  (medians of {args.rounds}, alternating; the same tokens)", flush=True)
    print(json.dumps({"greedy": args.greedy, "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
