"""The leader's step broadcast under tensor parallel, three ways side by side in one run: the step pickled
through `broadcast_object_list` (what engine/tp.py once did), the two int64 tensors with every run's
whole block table (a step without keys: what `tp.pack` sent before the block tables' mirror), and the
two int64 tensors as the channel sends them now (`tp.StepChannel`: each run's blocks the follower's
mirror lacks). Two processes over gloo on this machine.

    python benchmarks/bench_step_broadcast.py [--batch 1,8,32] [--context 1024,16384] [--steps 200]

Each run is --steps decode steps in a row of B sequences from the given context on, in 16-token blocks,
with keys, no copies; sequence i is i tokens ahead of the context, so the block appends (one a sequence
every 16 steps) spread over the steps as a batch's do. The int64 tensors are larger than the pickle of
the same numbers, which writes small ints in 1-3 bytes. Per (B, context): the mean bytes the follower
receives a step and the mean microseconds a step from the leader's send to the follower's StepInput (the
two processes in lock step: each step ends with a 4-byte reply from the follower, in every column alike),
over the steps after 5 of warm-up (the mirror's first step sends every table whole). Last line: one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK = 16
WARM = 5
WAYS = ("pickle", "whole", "delta")


def decode_steps(batch: int, context: int, steps: int) -> list:
    """`steps` decode steps of `batch` sequences from `context` on, as the runner makes them."""
    from svrmad_local.engine.scheduler import StepInput

    n = -(-(context + batch + steps) // BLOCK)
    # block ids from 1000 up (3 bytes each in a pickle: a cache of up to 65,536 blocks favours the pickle)
    ids = [list(range(1000 + i * n, 1000 + (i + 1) * n)) for i in range(batch)]
    out = []
    for t in range(steps):
        ends = [context + i + t for i in range(batch)]
        runs = [(e - 1, e, ids[i][: -(-e // BLOCK)]) for i, e in enumerate(ends)]
        out.append(StepInput(list(range(batch)), runs, batch, [], [(i, 0) for i in range(batch)]))
    return out


def pickled(channel_rank: int, step, group):
    box = [step if channel_rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from svrmad_local.engine.tp import Group, StepChannel, TableMirror, pack

    results = []
    for batch in args.batch:
        for context in args.context:
            steps = decode_steps(batch, context, args.steps + WARM)
            whole = [replace(s, keys=None) for s in steps]  # no keys: every run's table whole
            mirror = TableMirror()
            sizes = {"pickle": [len(pickle.dumps(s)) for s in steps],
                     "whole": [sum(t.numel() for t in pack(s)) * 8 for s in whole],
                     "delta": [sum(t.numel() for t in pack(s, mirror)) * 8 for s in steps]}
            row = {"batch": batch, "context": context}
            for name in WAYS:
                row[f"{name}_bytes"] = sum(sizes[name][WARM:]) / args.steps
                channel = StepChannel(Group((0, 1), rank, None))  # a fresh mirror at each end
                sent = whole if name == "whole" else steps
                reply = torch.zeros(1)
                for i, step in enumerate(sent):
                    if i == WARM:
                        dist.barrier()
                        t0 = time.perf_counter()
                    if name == "pickle":
                        got = pickled(rank, step, None)
                    elif rank == 0:
                        channel.send(step)
                    else:
                        got = channel.recv()
                    dist.broadcast(reply, src=1)  # the follower has its step: the next one may go
                    if rank == 1 and i in (0, len(sent) - 1):
                        assert got == step
                row[f"{name}_us"] = (time.perf_counter() - t0) / args.steps * 1e6
            results.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", default="1024,16384")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args(argv)
    args.batch = [int(x) for x in args.batch.split(",")]
    args.context = [int(x) for x in args.context.split(",")]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_step_broadcast.{os.getpid()}.json"
    mp.spawn(worker, (args, args.port, str(out)), nprocs=2)
    rows = json.loads(out.read_text())
    out.unlink()
    heads = ("batch", "context", "pickle B", "whole B", "delta B", "pickle us", "whole us", "delta us",
             "whole/delta")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (5, 8, 10, 10, 10, 10, 10, 10, 11))))
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>8} {r['pickle_bytes']:>10.0f} {r['whole_bytes']:>10.0f} "
              f"{r['delta_bytes']:>10.0f} {r['pickle_us']:>10.1f} {r['whole_us']:>10.1f} {r['delta_us']:>10.1f} "
              f"{r['whole_us'] / r['delta_us']:>11.2f}")
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
