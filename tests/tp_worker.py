"""Run by tests/test_tp.py under torchrun: one tensor-parallel engine over each given checkpoint in turn
(one launch for them all: starting the processes is the slow part). The leader writes, per checkpoint,
what it generated (greedy, seeded forks, teacher-forced log-probs) and every rank's resident bytes.
Every mode ends the way the product does (svrmad_local.dist.shutdown) and says how many of the threads
that making its process groups started are still there (gloo's: none, or the exit can abort)."""

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from svrmad_local import dist as svrmad_dist
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.params import SamplingParams
from svrmad_local.models.loader import load_model

CONFIG = dict(block_size=4, kv_cache_memory=4 * 2**20)


def workload(engine):
    """The same calls the single-process side of the test makes."""
    prompts = [[3 + (7 * i + 5 * j) % 390 for j in range(n)] for i, n in enumerate((9, 21, 14))]
    greedy = engine.generate_sync(prompts + [prompts[1][:17] + [5, 6]], SamplingParams(temperature=0, max_tokens=10,
                                                                                        ignore_eos=True))
    forks = engine.generate_sync([prompts[0]], SamplingParams(n=3, max_tokens=8, seed=11, ignore_eos=True))[0]
    score = engine.score_sync(prompts[2], [7, 8, 9, 10, 11], topk=3)
    return {"greedy": [o.completions[0].token_ids for o in greedy],
            "greedy_logprobs": [o.completions[0].logprobs for o in greedy],
            "forks": [c.token_ids for c in forks.completions], "score": score.logprobs,
            "computed": engine.totals.computed_tokens}


def crowded(model, world: int) -> dict:
    """An engine config whose KV cache holds 12 blocks of 4 tokens on each rank (its share of the KV heads):
    too few for `crowded_workload` at once, so the scheduler preempts and recomputes."""
    c = model.config
    heads = c.num_key_value_heads // world
    block = c.num_hidden_layers * 2 * 4 * heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads) * 4
    return dict(block_size=4, kv_cache_memory=12 * block, max_num_seqs=8)


def crowded_workload(engine):
    """Sequences that cross many block boundaries in a cache too small for them all: preemptions, forks
    sharing their prompt's blocks, and twin prompts whose blocks the prefix cache adopts (each a change of
    a sequence's blocks other than an append)."""
    prompts = [[3 + (11 * i + 7 * j) % 390 for j in range(10)] for i in range(5)]
    prompts.append(prompts[2])  # a twin, admitted with its sibling: one adopts the other's cached blocks
    params = [SamplingParams(max_tokens=24, seed=9 + i, ignore_eos=True) for i in range(len(prompts))]
    outs = engine.generate_sync(prompts, params)
    forks = engine.generate_sync([prompts[0]], SamplingParams(n=3, max_tokens=14, seed=5, ignore_eos=True))[0]
    return {"tokens": [o.completions[0].token_ids for o in outs], "forks": [c.token_ids for c in forks.completions],
            "preemptions": sum(o.usage.preemptions for o in [*outs, forks])}


def resident_bytes(model) -> int:
    """The bytes this rank holds: parameters and buffers, packed or not, each tensor once."""
    seen = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in seen.values())


def tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@contextmanager
def started_threads(box: set):
    """The threads started inside the block (gloo's, when it makes process groups) go into `box`."""
    before = tasks()
    yield
    box.update(tasks() - before)


def follower_quits(out: str, path: str) -> None:
    """The follower runs 3 steps and exits cleanly (torchrun sees no failure and stops nobody): the
    leader's next collective must end its request with GroupLost, one line, instead of hanging; then
    the leader ends as the product does, and its interpreter exits normally (no abort, no hang)."""
    from svrmad_local.dist import GroupLost

    gloo: set = set()
    with started_threads(gloo):
        dist.init_process_group("gloo")
    engine = Engine(load_model(path, device="cpu", dtype="fp32", tp=True).model, None, EngineConfig(**CONFIG))
    if dist.get_rank() == 1:
        for _ in range(3):
            engine.runner.execute(engine.built.channel.recv())
        os._exit(0)
    try:
        engine.generate_sync([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        said = "no error"
    except GroupLost as exc:
        said = str(exc)
    engine.close()
    svrmad_dist.shutdown()
    with open(out, "w") as f:
        json.dump({"said": said, "gloo_threads_left": len(gloo & tasks()), "gloo_threads": len(gloo)}, f)


def replicas(out: str, steps: int, lose: str) -> None:
    """Replicas of TP-2 groups made as `svrmad run --tp 2` makes them (svrmad_local/job/launch.py): the first replica's
    leader sends `steps` steps (each with an all-reduce, as a forward has), the other replica none, so it
    ends while the first still works; `lose` "follower" (or "leader"): the first replica's follower (its
    leader) quits after 3 steps.
    Each rank ends with Dist.close() and writes how many gloo threads are left."""
    from svrmad_local.dist import GroupLost
    from svrmad_local.engine.scheduler import StepInput
    from svrmad_local.job.launch import Dist
    from svrmad_local.engine.tp import StepChannel

    gloo: set = set()
    with started_threads(gloo):
        d = Dist.from_env()
        group, view = d.split(2)
    channel, said = StepChannel(group), None
    try:
        if group.rank == 0:
            for i in range(steps if view.rank == 0 else 0):
                if lose == "leader" and i == 3:
                    os._exit(0)
                channel.send(StepInput(list(range(64)), [(0, 64, list(range(16)))], 0, [], [(i, 0)]))
                dist.all_reduce(torch.ones(256), group=group.pg)
            channel.send(None)
        else:
            n = 0
            while channel.recv() is not None:
                dist.all_reduce(torch.ones(256), group=group.pg)
                n += 1
                if lose == "follower" and view.rank == 0 and n == 3:
                    os._exit(0)  # the lost rank (cleanly: torchrun stops nobody)
    except GroupLost as exc:
        said = str(exc)
    d.close()
    Path(f"{out}.{d.rank}").write_text(json.dumps({"said": said, "gloo_threads_left": len(gloo & tasks()),
                                                   "gloo_threads": len(gloo), "pg_left": group.pg is not None}))

@contextmanager
def counting(engine):
    """Counts the leader's forward steps and its all-reduces inside the block (engine/tp.py looks
    dist.all_reduce up at each call)."""
    count = {"steps": 0, "all_reduce": 0}
    execute, all_reduce = engine.runner.execute, dist.all_reduce

    def step(s, *rest):
        count["steps"] += 1
        return execute(s, *rest)

    def reduce(*args, **kwargs):
        count["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    engine.runner.execute, dist.all_reduce = step, reduce
    try:
        yield count
    finally:
        engine.runner.execute, dist.all_reduce = execute, all_reduce


def static_steps(engine) -> list[int]:
    """A box counting, from now on, the steps this rank runs through the static decode path, those of them
    that sampled inside the step, and the calls of its LM head (any path): stays [0, 0, n] without the path."""
    box, static = [0, 0, 0], engine.runner.static
    engine.runner.lm_head.register_forward_hook(lambda *_: box.__setitem__(2, box[2] + 1))
    if static is not None:
        run = static.run

        def counted(step, shape, *rest):
            out = run(step, shape, *rest)
            box[0] += 1
            box[1] += out.packed is not None
            return out

        static.run = counted
    return box


def main(out: str, paths: list[str], device: str = "cpu", graphs: str = "auto", overlap: str = "auto") -> None:
    """`device` "cuda": every rank on the one GPU there is, over gloo (SVRMAD_DIST_BACKEND=gloo, set by
    the test), in fp32: the packed kernels and the split shapes on the device, without several GPUs.
    `graphs`: the engine's cuda_graphs ("static": the static decode path on every rank); `overlap` its
    overlap ("on": decode steps launched before the leader reads the one before)."""
    dist.init_process_group("gloo")
    results = {}
    for path in paths:
        lm = load_model(path, device=device, dtype="fp32", tp=True)
        sizes = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, resident_bytes(lm.model))
        engine = Engine(lm.model, None, EngineConfig(**CONFIG, cuda_graphs=graphs, overlap=overlap))
        static = static_steps(engine)
        if dist.get_rank() == 0:
            with counting(engine) as count:
                done = workload(engine)
            results[path] = {**done, "world": dist.get_world_size(), "resident": sizes, "decoder": engine.info["decoder"],
                             "kv_shape_here": list(engine.spec.layers[0].k_shape), "collectives": count,
                             "graphs": engine.info["cuda_graphs"], "overlapped_steps": engine.totals.overlapped_steps}
            engine.close()
        else:
            engine.follow()
        sampling = engine.runner.static is not None and engine.runner.static.sampling
        engine._worker.join(timeout=60)  # let go by close() (the leader) or at the end of follow() (the others)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, [*static, sampling, not engine._worker.is_alive()])
        results.setdefault(path, {}).update(zip(("static_steps", "sampled_inside", "head_calls", "sampling",
                                                 "worker_ended"), map(list, zip(*per_rank))))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    svrmad_dist.shutdown()


def stand_in_capture(out: str, path: str) -> None:
    """Graphs captured under --tp, with the stand-in graph API of tests/test_graphs.py (a capture runs the
    step, a replay recomputes it) and the group taken as one whose all-reduce a graph records (NCCL's):
    rank 1's captures at 4 rows fail, rank 0's all succeed. Each rank writes its shapes, failures and
    replays, how many of its static steps sampled inside and how often its LM head ran while serving; the
    leader also the workload's tokens."""
    from pytest import MonkeyPatch

    from svrmad_local.engine import tp
    from tests.test_graphs import StandIn

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with MonkeyPatch.context() as mp:
        StandIn(mp, fail=lambda P, W: RuntimeError("injected") if rank == 1 and P == 4 else None)
        mp.setattr(tp, "graphs_record_collectives", lambda group: True)
        engine = Engine(load_model(path, device="cpu", dtype="fp32", tp=True).model, None,
                        EngineConfig(**CONFIG, max_num_seqs=8))
        static, done, counts = engine.runner.static, {}, static_steps(engine)
        if rank == 0:
            done = workload(engine)
            engine.close()
        else:
            engine.follow()
    got = {**done, "graphs": sorted(static.graphs), "failed": sorted([*s, why] for s, why in static.failed.items()),
           "replays": static.replays, "info": engine.info["cuda_graphs"], "sampling": static.sampling,
           "sampled_inside": counts[1], "head_calls": counts[2]}
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    svrmad_dist.shutdown()


def crowded_main(out: str, path: str) -> None:
    """`crowded_workload` on a tensor-parallel engine. The leader also writes how many block ids its steps
    carried against how many their runs' tables hold, and whether every rank's mirror of those tables
    (engine/tp.TableMirror) ended equal to the leader's."""
    from svrmad_local.engine import tp

    dist.init_process_group("gloo")
    model = load_model(path, device="cpu", dtype="fp32", tp=True).model
    engine = Engine(model, None, EngineConfig(**crowded(model, dist.get_world_size())))
    done, carried = {}, {"sent": 0, "whole": 0}
    if dist.get_rank() == 0:
        pack = tp.pack

        def counted(step, mirror=None):
            header, payload = pack(step, mirror)
            if step is not None:
                carried["sent"] += int(header[6])
                carried["whole"] += sum(len(b) for _, _, b in step.runs)
            return header, payload

        tp.pack = counted
        done = crowded_workload(engine)
        tp.pack = pack
        engine.close()
    else:
        engine.follow()
    mirrors = [None] * dist.get_world_size()
    dist.all_gather_object(mirrors, list(engine.built.channel.mirror.tables.items()))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({**done, **carried, "mirrors_equal": all(m == mirrors[0] for m in mirrors),
                                         "mirror_size": len(mirrors[0])}))
    svrmad_dist.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--follower-quits":
        follower_quits(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--replicas":
        replicas(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "--device":
        main(sys.argv[3], sys.argv[4:], device=sys.argv[2])
    elif sys.argv[1] == "--stand-in":
        stand_in_capture(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--crowded":
        crowded_main(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--graphs":
        main(sys.argv[3], sys.argv[4:], graphs=sys.argv[2])
    elif sys.argv[1] == "--overlap":
        main(sys.argv[2], sys.argv[3:], graphs="static", overlap="on")
    else:
        main(sys.argv[1], sys.argv[2:])
