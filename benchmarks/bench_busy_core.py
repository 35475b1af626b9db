"""bench_engine.py quiet and beside busy loops pinned to one core, side by side in one run.

Another process busy on one of the cores the engine asked for (a notebook, a second job, a build)
is the commonest load a user's machine has. This script times `bench_engine.py` (each run a fresh
process) with nothing else running, then with `--loops` processes of `while True: pass` pinned to the
last core of this process's affinity (what `taskset -c N python -c "while True: pass"` does), for
each OMP_NUM_THREADS setting asked for, and prints each busy time over its quiet time.

    python benchmarks/bench_busy_core.py [--omp unset,2,1] [--loops 1] [--full] [--also CHECKOUT]
        [-- bench_engine args]

--full times bench_engine's full run (the engine, then a plain model.generate loop in the same
process) instead of --skip-naive. --also CHECKOUT times another checkout's bench_engine.py (an older
commit, say) the same way, each setting's runs one after the other. Last line: one JSON object
{checkout: {setting: {quiet_s, busy_s, ratio}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def busy_loops(n: int, core: int) -> list[subprocess.Popen]:
    """n processes spinning on `core` (pinned before they start spinning)."""
    code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def run_bench(root: Path, omp: str, extra: list[str], full: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("OMP_NUM_THREADS", None)
    if omp != "unset":
        env["OMP_NUM_THREADS"] = omp
    cmd = [sys.executable, str(root / "benchmarks" / "bench_engine.py"), *([] if full else ["--skip-naive"]), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_engine.py failed ({omp=}):\n{out.stderr[-2000:]}")
    said = [line for line in out.stderr.splitlines() if "thread" in line or "core" in line]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "said": said}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--omp", default="unset,2", help="OMP_NUM_THREADS settings, comma-separated ('unset': not set)")
    ap.add_argument("--loops", type=int, default=1, help="busy loops, all pinned to the last core")
    ap.add_argument("--full", action="store_true", help="bench_engine's full run (engine, then the generate loop)")
    ap.add_argument("--also", type=Path, help="another checkout timed the same way (e.g. an older commit)")
    ap.add_argument("rest", nargs="*", help="bench_engine.py arguments (after --)")
    args = ap.parse_args()
    core = max(os.sched_getaffinity(0))
    roots = {"this": ROOT, **({str(args.also): args.also.resolve()} if args.also else {})}
    results: dict = {name: {} for name in roots}
    for omp in args.omp.split(","):
        for name, root in roots.items():
            quiet = run_bench(root, omp, args.rest, args.full)
            loops = busy_loops(args.loops, core)
            try:
                time.sleep(0.5)
                busy = run_bench(root, omp, args.rest, args.full)
            finally:
                for p in loops:
                    p.kill()
                    p.wait()
            row = {"quiet_s": quiet["engine_s"], "busy_s": busy["engine_s"],
                   "ratio": round(busy["engine_s"] / quiet["engine_s"], 2)}
            if args.full:
                row.update(naive_quiet_s=quiet["naive_s"], naive_busy_s=busy["naive_s"])
            row["said_busy"] = busy["said"]
            results[name][f"OMP_NUM_THREADS={omp}"] = row
            print(f"{name}: OMP_NUM_THREADS={omp:5s} engine quiet {quiet['engine_s']:7.1f} s   beside {args.loops} "
                  f"busy loop(s) on core {core}: {busy['engine_s']:7.1f} s   ({row['ratio']:.2f}x)"
                  + (f"   plain loop {quiet['naive_s']:.1f} s -> {busy['naive_s']:.1f} s" if args.full else ""),
                  flush=True)
            for line in busy["said"]:
                print(f"    said: {line}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
