"""The GPU check's `tests` step: pytest over the GPU tests, spread over worker processes where pytest-xdist
is installed, then each test that failed among the workers run again alone.

Why workers: most of the step's time is the host compiling Triton kernels (one CPU core a process) and
building small models, while the GPU idles; a GPU machine has cores to spare, and the check's call has
minutes. Why the rerun: the workers share the one GPU (its memory, its clock), so a test that fails among
them and passes alone is told apart from one that fails either way; only the latter fails the step, and
the former is named (`passed_alone`), as a test that may not share a device.

    python benchmarks/gpu_tests.py [--workers N] -- PYTEST_ARGS...

Prints pytest's output, then one JSON line: `workers` (1 where xdist is absent or unusable), the first
run's `counts`, `failed` (what still fails), `passed_alone`, and `failures` (sentences; empty = pass).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys

# --durations: the log names the slowest tests, which decide how many workers pay
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--durations=12"]
WORKERS = 4  # a GPU machine's 16 cores keep four compiling with room; the GPU's memory holds four contexts


def counts(text: str) -> dict:
    """pytest's last line as numbers: {"passed": 60, "failed": 1, ...}."""
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}


def failed_ids(text: str) -> list[str]:
    """The node ids pytest's short summary (-rfE) names as FAILED or ERROR, in order, once each."""
    return list(dict.fromkeys(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))


def _pytest(args: list[str], cwd: str | None) -> tuple[int, str]:
    proc = subprocess.run(PYTEST + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="", flush=True)
    return proc.returncode, proc.stdout


def run(args: list[str], workers: int = WORKERS, cwd: str | None = None) -> dict:
    """The step's result (see the module's docstring). pytest's exit 0 and 1 are a run that ended (1: some
    failed); any other (an interrupted run, a usage or internal error) among workers is retried whole without
    them, since an unusable xdist must not cost the step its tests."""
    parallel = workers > 1 and importlib.util.find_spec("xdist") is not None
    result = {"workers": workers if parallel else 1, "passed_alone": [], "failures": []}
    code, text = _pytest((["-n", str(workers)] if parallel else []) + args, cwd)
    if parallel and code not in (0, 1):
        result["workers_failed"] = f"pytest exit {code} with {workers} workers: run again without them"
        result["workers"], parallel = 1, False
        code, text = _pytest(args, cwd)
    result["counts"], failed = counts(text), failed_ids(text)
    if parallel and failed:
        print(f"\n== {len(failed)} failed among {workers} workers: each run again alone\n", flush=True)
        code_alone, alone = _pytest(failed, cwd)
        still = failed_ids(alone)
        result["passed_alone"] = [t for t in failed if t not in still]
        failed = still if code_alone in (0, 1) else failed
        code = code_alone
    result["failed"] = failed
    if failed:
        result["failures"].append(f"{len(failed)} failed: {', '.join(failed[:5])}")
    elif code != 0:
        last = text.strip().splitlines()[-1] if text.strip() else "no output"
        result["failures"].append(f"pytest exit {code}: {last}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=WORKERS, help=f"pytest-xdist workers (default {WORKERS}; 1: none)")
    ap.add_argument("pytest_args", nargs="+", help="after --: what pytest runs")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error(f"--workers must be 1 or more, not {args.workers}")
    result = run(args.pytest_args, args.workers)
    print(json.dumps(result), flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
