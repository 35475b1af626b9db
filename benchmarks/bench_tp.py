"""Tensor parallel on the CPU (gloo): the debate workload at --tp 1, 2, ..., step time and time in collectives.

For each T in --tp, this script starts `torchrun --nproc-per-node T` on itself (--worker); every rank
loads its part of the model (models/shard.py), the leader runs bench_engine.py's debate workload
through the engine and the others follow its steps. Each rank counts its forward steps and the
seconds spent in the two kinds of collective the plan makes: the all-reduces after attention and MLP
blocks, and the step broadcast (leader -> followers). Prints, per T: wall seconds, steps, ms a step,
and per rank the ms a step in all-reduces and in the broadcast. Last line: one JSON object.

    python benchmarks/bench_tp.py [--model PATH] [--tp 1,3] [--questions 2] [--n 6] ...

The embedded default (SmolLM2-135M: 9 heads, 3 KV heads) splits over 3 ranks, not 2: pass --tp 1,3
for it, or --model with heads that 2 divides for --tp 1,2. A meaningful timing needs a quiet machine
with a core per rank; on a GPU node, the same collectives run over NCCL (not measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class Clock:
    """Seconds spent in torch.distributed.all_reduce and broadcast (patched in place:
    engine/tp.py looks them up on the module at each call)."""

    def __init__(self):
        import torch.distributed as dist

        self.seconds = {"all_reduce": 0.0, "broadcast": 0.0}
        self.calls = {"all_reduce": 0, "broadcast": 0}
        for name, key in (("all_reduce", "all_reduce"), ("broadcast", "broadcast")):
            setattr(dist, name, self._timed(getattr(dist, name), key))

    def _timed(self, fn, key):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0
                self.calls[key] += 1

        return timed


def worker(args) -> None:
    import torch.distributed as dist

    from bench_engine import DebateWorkload, run_engine
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.models.default import ensure_default_model
    from svrmad_local.models.loader import load_model

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    lm = load_model(args.model or ensure_default_model(), dtype=args.dtype, device="cpu", tp=tp > 1)
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_cache_memory=args.kv_cache_memory))
    clock = Clock()  # after loading: only the steps' collectives count
    steps = [0]
    execute = engine.runner.execute

    def counted(step, *rest):
        steps[0] += 1
        return execute(step, *rest)

    engine.runner.execute = counted
    wall = None
    if dist.get_rank() == 0:
        wl = DebateWorkload.from_args(args, lm.tokenizer)
        wall, _ = run_engine(engine, wl)
        engine.close()
    elif tp > 1:
        engine.follow()
    mine = {"rank": dist.get_rank(), "steps": steps[0], "seconds": clock.seconds, "calls": clock.calls}
    ranks = [None] * tp
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"tp": tp, "wall_s": wall, "ranks": ranks}))
    dist.destroy_process_group()


def main() -> int:
    from bench_engine import DebateWorkload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    DebateWorkload.add_arguments(ap)
    ap.add_argument("--tp", default="1,3", help="comma-separated group sizes (default 1,3: the embedded model's split)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(argparse.Namespace(**{**json.loads(os.environ["BENCH_TP_SETTINGS"]), "out": args.out}))
        return 0
    # the workload's settings go by environment: torchrun would take --n for one of its own options
    settings = json.dumps({k: v for k, v in vars(args).items() if k not in ("tp", "worker", "out")})
    results = []
    for tp in (int(t) for t in args.tp.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "tp.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
                   str(Path(__file__).resolve()), "--worker", "--out", str(out)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_TP_SETTINGS": settings,
                   "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp))}
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode != 0 or not out.exists():
                print(f"--tp {tp}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(out.read_text())
        lead = r["ranks"][0]
        step_ms = 1e3 * r["wall_s"] / max(1, lead["steps"])
        print(f"--tp {tp}: {r['wall_s']:.2f} s, {lead['steps']} steps, {step_ms:.1f} ms a step")
        for k in r["ranks"]:
            per = {name: 1e3 * s / max(1, k["steps"]) for name, s in k["seconds"].items()}
            print(f"  rank {k['rank']}: {per['all_reduce']:.2f} ms a step in {k['calls']['all_reduce']} all-reduces, "
                  f"{per['broadcast']:.2f} ms in {k['calls']['broadcast']} broadcasts (a step's header and payload)")
        results.append({**r, "step_ms": step_ms})
    print(json.dumps({"bench": "tp", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
