"""Where a `svrmad run` spends its time, step by step: runs the job in this process with every engine
step timed inside the model runner, then splits the time.

    python benchmarks/step_profile.py [--log steps.jsonl] -- run --dataset gsm8k --limit 2 \
        --methods svr-mad,self-consistency,group-debate,sid-et,s2-mad --max-tokens 256 --out /tmp/prof

Everything after `--` is `svrmad run`'s own command line. Prints: the steps with a prefill chunk (their
time, prompt tokens and ms a token by chunk size), the decode-only steps (time, rows, and a least-squares
fit `ms = a + b x rows + c x context tokens`: a is the weights' cost a step, c the cost of reading a
token of context), how many times a decode step reads each distinct KV block (what shared-prefix
attention could save), and the time between steps (the LM head over the rows that sample, which
runs after the step, then sampling, statistics, scheduling; py-spy on a --limit 1 run put the LM
head at two thirds of it). The
all-methods workload of docs/measurements.md was split this way. One run measures one machine: name it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict

import numpy as np


@contextlib.contextmanager
def record(path: str):
    """While open, ModelRunner.execute also writes one JSON line a step: [decode rows, prefill tokens,
    context tokens, ms, end time, distinct blocks the decode rows read, blocks they read]."""
    from svrmad_local.engine.runner import ModelRunner

    inner = ModelRunner.execute

    def execute(self, step, *rest):
        t = time.perf_counter()
        result = inner(self, step, *rest)
        end = time.perf_counter()
        nd, bs = step.num_decode, self.block_size
        read = [blocks[: -(-e // bs)] for _s, e, blocks in step.runs[:nd]]
        out.write(json.dumps([nd, sum(e - s for s, e, _b in step.runs[nd:]), sum(e for _s, e, _b in step.runs),
                              round((end - t) * 1e3, 3), round(end, 4), len({b for r in read for b in r}),
                              sum(map(len, read))]) + "\n")
        return result

    with open(path, "w") as out:
        ModelRunner.execute = execute
        try:
            yield
        finally:
            ModelRunner.execute = inner


def report(rows: list[list]) -> None:
    if not rows:
        print("no engine step ran")
        return
    span = rows[-1][4] - (rows[0][4] - rows[0][3] / 1e3)
    decode = [r for r in rows if r[1] == 0]
    prefill = [r for r in rows if r[1] > 0]
    between = sum(max(0.0, b[4] - b[3] / 1e3 - a[4]) for a, b in zip(rows, rows[1:]))
    print(f"{len(rows)} steps over {span:.1f} s; {sum(r[3] for r in rows) / 1e3:.1f} s inside them, {between:.1f} s between "
          "(the LM head, sampling, statistics, scheduling)")
    if prefill:
        tokens = sum(r[1] for r in prefill)
        print(f"steps with a prefill chunk: {len(prefill)}, {sum(r[3] for r in prefill) / 1e3:.1f} s, {tokens} prompt "
              f"tokens, {sum(r[0] for r in prefill)} decode rows beside them")
        by = defaultdict(lambda: [0, 0, 0.0])
        for r in prefill:
            b = by[1 << max(0, int(r[1]).bit_length() - 1)]
            b[0], b[1], b[2] = b[0] + 1, b[1] + r[1], b[2] + r[3]
        for size in sorted(by):
            n, tok, ms = by[size]
            print(f"  chunks of {size}-{2 * size - 1} tokens: {n} steps, {tok} tokens, {ms / 1e3:.1f} s, {ms / tok:.2f} ms a token")
    if decode:
        rows_ = sum(r[0] for r in decode)
        print(f"decode-only steps: {len(decode)}, {sum(r[3] for r in decode) / 1e3:.1f} s, {rows_} rows "
              f"({rows_ / len(decode):.1f} a step), {sum(r[2] for r in decode)} context tokens read")
        if len(decode) >= 3:
            a = np.array([[1.0, r[0], r[2]] for r in decode])
            coef = np.linalg.lstsq(a, np.array([r[3] for r in decode]), rcond=None)[0]
            ctx_s = coef[2] * sum(r[2] for r in decode) / 1e3
            print(f"  fit: ms = {coef[0]:.2f} + {coef[1]:.3f} x rows + {coef[2]:.5f} x context tokens "
                  f"(reading context: {ctx_s:.1f} s of the decode steps)")
        distinct, read = sum(r[5] for r in decode), sum(r[6] for r in decode)
        if distinct:
            print(f"  KV blocks: {read} reads of {distinct} distinct a step ({read / distinct:.2f} reads a block)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: step_profile.py [--log PATH] -- run ARGS... (svrmad's command line after --)", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", default="steps.jsonl", help="one JSON line a step (default: steps.jsonl)")
    args = ap.parse_args(argv[:cut])
    from svrmad_local.cli import main as svrmad

    with record(args.log):
        rc = svrmad(argv[cut + 1:])
    with open(args.log) as f:
        report([json.loads(line) for line in f])
    return rc


if __name__ == "__main__":
    sys.exit(main())
