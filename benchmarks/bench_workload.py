"""The prefill-heavy debate workload, side by side: `svrmad run` over GSM8K with all five methods.

Each side is one `svrmad run` in a fresh process and a fresh output folder: on this checkout once per
`--variant` (extra `svrmad run` arguments: "" for the defaults, "--kv-cache-memory 2GiB" for the old
CPU budget, "--run-ahead"), and with `--ref PATH` on another checkout at its defaults (for example
main at 8981e79, the reference of docs/measurements.md). The run is seeded, so the sides do the same work
unless their engines differ; the counters show where they differ. Prints, per side, the wall time of
the whole command (load included) and the run's own, engine steps, prompt tokens billed / computed /
reused from the cache, generated tokens, evictions and peak KV; then each side's time against the
first side's. Last line: one JSON object. Nothing here passes or fails; time it on a quiet machine.

    python benchmarks/bench_workload.py [--limit 4] [--ref PATH] [--variant= --variant="--kv-cache-memory 2GiB"]
        [--variant=--run-ahead] [--repeat 1]    (with "=": a variant is itself `svrmad run` flags)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
clock = time.perf_counter  # the tests replace it
METHODS = "svr-mad,self-consistency,group-debate,sid-et,s2-mad"
COUNTERS = ("steps", "prompt_tokens", "computed_tokens", "cached_tokens", "generated_tokens", "evictions",
            "peak_kv_bytes", "kv_budget_bytes")


def python_of(checkout: Path) -> str:
    """The checkout's own venv if it has one, else this interpreter (the checkout comes first on the path)."""
    venv = checkout / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def sides(args) -> list[dict]:
    out = [{"label": f"this checkout {v or '(defaults)'}", "checkout": HERE, "args": v.split()} for v in args.variant]
    if args.ref:
        out.append({"label": f"{args.ref} (defaults)", "checkout": Path(args.ref).resolve(), "args": []})
    return out


def run_side(side: dict, args, out_dir: Path) -> dict:
    cmd = [python_of(side["checkout"]), "-m", "svrmad_local", "run", "--dataset", args.dataset, "--limit",
           str(args.limit), "--methods", args.methods, "--max-tokens", str(args.max_tokens), "--seed", str(args.seed),
           "--out", str(out_dir), *side["args"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(side["checkout"]), os.environ.get("PYTHONPATH", "")])}
    t0 = clock()
    # in the checkout: `python -m` puts the working directory first on the path, ahead of PYTHONPATH, so
    # from here every side would import this checkout's package
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=side["checkout"])
    wall = clock() - t0
    if proc.returncode != 0:  # the last line naming a failure or an error says why (progress bars left out)
        lines = [ln for ln in re.split(r"[\r\n]+", proc.stdout + "\n" + proc.stderr) if ln.strip() and "%|" not in ln]
        why = [ln for ln in lines if "fail" in ln or "error" in ln.lower()] or lines or ["(no output)"]
        raise SystemExit(f"bench_workload: {side['label']} failed (exit {proc.returncode}): {why[-1]}")
    totals = json.loads((out_dir / "run.json").read_text()).get("totals", {})
    engine = totals.get("engine", {})
    return {"wall_s": wall, "run_wall_s": totals.get("wall_s"), **{k: engine.get(k) for k in COUNTERS}}


def fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=4, help="GSM8K questions (default 4, as in docs/measurements.md)")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", action="append", help="a side on this checkout: extra `svrmad run` arguments as "
                   "one string, '' for none (repeat for more sides; default: one side at the defaults)")
    p.add_argument("--ref", help="another checkout to run at its default, e.g. a worktree of main at 8981e79")
    p.add_argument("--repeat", type=int, default=1, help="runs per side, interleaved; medians are printed")
    args = p.parse_args(argv)
    args.variant = args.variant if args.variant is not None else [""]
    todo = sides(args)
    runs: list[list[dict]] = [[] for _ in todo]
    with tempfile.TemporaryDirectory(prefix="bench_workload_") as tmp:
        for r in range(args.repeat):
            for i, side in enumerate(todo):  # interleaved, so a machine that drifts drifts for every side
                runs[i].append(run_side(side, args, Path(tmp) / f"side{i}_run{r}"))
    med = [{k: (statistics.median(x[k] for x in rs) if rs[0][k] is not None else None) for k in rs[0]} for rs in runs]
    keys = ("wall_s", "run_wall_s", *COUNTERS)
    print(f"{args.dataset} --limit {args.limit}, methods {args.methods}, {args.max_tokens} max tokens, "
          f"seed {args.seed}, medians of {args.repeat}")
    print("| side | " + " | ".join(keys) + " | time / first side's |")
    print("|---" * (len(keys) + 2) + "|")
    for side, m in zip(todo, med):
        print(f"| {side['label']} | " + " | ".join(fmt(m[k]) for k in keys) + f" | {m['wall_s'] / med[0]['wall_s']:.2f} |")
    print(json.dumps({"limit": args.limit, "sides": [{"label": s["label"], **m} for s, m in zip(todo, med)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
