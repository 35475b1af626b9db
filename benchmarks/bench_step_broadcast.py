"""The leader's step broadcast under tensor parallel, two ways side by side in one run: the step pickled
through `broadcast_object_list` (what engine/tp.py did) against the two int64 tensors it sends now
(`tp.pack`: a fixed header, then the packed numbers). Two processes over gloo on this machine.

    python benchmarks/bench_step_broadcast.py [--batch 1,8,32] [--context 1024,16384] [--steps 200]

Each step is a decode step of B sequences at the given context in 16-token blocks, with keys, no
copies; the int64 tensors are larger than the pickle, which writes small ints in 1-3 bytes. Per
(B, context): bytes the follower receives a step, and microseconds a step from the leader's send to the
follower's StepInput (the mean over --steps, the two processes in lock step: each step ends with a
4-byte reply from the follower, in both columns alike). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK = 16


def decode_step(batch: int, context: int):
    from svrmad_local.engine.scheduler import StepInput

    n = -(-context // BLOCK)
    # block ids from 1000 up (3 bytes each in a pickle: a cache of up to 65,536 blocks favours the pickle)
    runs = [(context - 1, context, list(range(1000 + i * n, 1000 + (i + 1) * n))) for i in range(batch)]
    return StepInput(list(range(batch)), runs, batch, [], [(i, 0) for i in range(batch)])


def pickled(channel_rank: int, step, group):
    box = [step if channel_rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def worker(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from svrmad_local.engine.tp import Group, StepChannel, pack

    channel = StepChannel(Group((0, 1), rank, None))
    results = []
    for batch in args.batch:
        for context in args.context:
            step = decode_step(batch, context)
            header, payload = pack(step)
            row = {"batch": batch, "context": context, "pickle_bytes": len(pickle.dumps(step)),
                   "tensor_bytes": (header.numel() + payload.numel()) * 8}
            for name in ("pickle", "tensor"):
                reply = torch.zeros(1)
                for i in range(args.steps + 5):  # 5 to warm up
                    if i == 5:
                        dist.barrier()
                        t0 = time.perf_counter()
                    if name == "pickle":
                        got = pickled(rank, step, None)
                    elif rank == 0:
                        channel.send(step)
                    else:
                        got = channel.recv()
                    dist.broadcast(reply, src=1)  # the follower has its step: the next one may go
                row[f"{name}_us"] = (time.perf_counter() - t0) / args.steps * 1e6
                if rank == 1:
                    assert got == step
            results.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", default="1024,16384")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args()
    args.batch = [int(x) for x in args.batch.split(",")]
    args.context = [int(x) for x in args.context.split(",")]
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_step_broadcast.{os.getpid()}.json"
    mp.spawn(worker, (args, args.port, str(out)), nprocs=2)
    rows = json.loads(out.read_text())
    out.unlink()
    heads = ("batch", "context", "pickle B", "tensor B", "pickle us", "tensor us", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (5, 8, 10, 10, 10, 10, 6))))
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>8} {r['pickle_bytes']:>10} {r['tensor_bytes']:>10} "
              f"{r['pickle_us']:>10.1f} {r['tensor_us']:>10.1f} {r['pickle_us'] / r['tensor_us']:>6.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
