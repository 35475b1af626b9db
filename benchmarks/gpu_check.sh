#!/usr/bin/env bash
# The GPU check in one command, for a GPU machine (bare and offline will do), or --dry-run on a CPU:
#
#     benchmarks/gpu_check.sh OUTDIR [--steps 1|2|3|a,b,...]   on the GPU machine
#     benchmarks/gpu_check.sh --dry-run OUTDIR                  on a CPU machine: everything but CUDA
#
# It runs benchmarks/gpu_check.py (see its docstring): installs the carried wheels of .whl/ into a private
# folder where the machine's releases fall short, imports the project from the working tree, builds the
# models it needs, runs the GPU tests, the graph / bf16 / flash-attn probes, the kernel, engine and decode
# benchmarks, and writes OUTDIR/summary.json (each step ran or skipped, pass or fail, with its reason and
# figures) and OUTDIR/logs/. Exit 0 when every step that ran passed. How to run it: docs/gpu-check.md.
# PYTHON: the interpreter (default: .venv/bin/python where there is one, else python3).
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
dry=()
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); shift; fi
out=${1:?usage: gpu_check.sh [--dry-run] OUTDIR [--steps 1|2|3|a,b,...]}
shift
exec "$py" benchmarks/gpu_check.py "$out" "${dry[@]}" "$@"
