"""The scheduler and the block manager are bookkeeping without tensors: they import no torch, and the
cache row copies they decide (a prefix hit's or a fork's partial block) ride in the `Batch`, in the
order they were decided, for the runner to apply before the step's forward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from svrmad_local.engine.block_manager import BlockManager
from svrmad_local.engine.config import SamplingParams
from svrmad_local.engine.kv_cache import KVCache
from svrmad_local.engine.scheduler import Scheduler
from svrmad_local.engine.sequence import Request, Sequence

ROOT = Path(__file__).resolve().parents[1]
BS = 4


def submit(sch: Scheduler, rid: int, prompt: list[int], n: int = 1) -> Sequence:
    req = Request(rid, prompt, SamplingParams(n=n, max_tokens=4), None)
    seq = Sequence(req, 0, list(prompt), len(prompt), None, is_leader_prefill=n > 1)
    req.sequences.append(seq)
    sch.add(seq)
    return seq


def step(sch: Scheduler):
    """One step as engine/step.py runs it, without the forward: schedule, then the computed counts move."""
    batch = sch.schedule()
    sch.postprocess(batch)
    return batch


# Two n=2 requests through the scheduler alone, the second's prompt sharing the first's up to one row of
# its partial last block; every sample stops at its first token. Printed: the copies queued, and the
# heavy modules the interpreter ended with.
SCENARIO = """
import json, sys
from svrmad_local.engine.block_manager import BlockManager
from svrmad_local.engine.config import SamplingParams
from svrmad_local.engine.scheduler import Scheduler
from svrmad_local.engine.sequence import Request, Sequence

sch = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64)
copies = []
for rid, prompt in ((1, list(range(10))), (2, list(range(9)) + [50, 51])):
    req = Request(rid, prompt, SamplingParams(n=2, max_tokens=4), None)
    lead = Sequence(req, 0, list(prompt), len(prompt), None, is_leader_prefill=True)
    req.sequences.append(lead)
    sch.add(lead)
    batch = sch.schedule()
    sch.postprocess(batch)
    copies += batch.copies
    child = Sequence(req, 1, list(prompt), len(prompt), None)
    req.sequences.append(child)
    sch.fork(lead, child)
    for s in (lead, child):
        s.tokens.append(99)
        sch.finish(s, "stop")
heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton', 'transformers'))
print(json.dumps({"heavy": heavy, "copies": copies + sch.copies}))
"""


def test_the_bookkeeping_imports_no_torch():
    """A fresh interpreter runs prefix hits and forks through the block manager and the scheduler: no
    torch (nor numpy, Triton or transformers) is loaded on the way, and the copies are queued, not made."""
    done = subprocess.run([sys.executable, "-c", SCENARIO], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["heavy"] == []
    # request 1 in blocks 0-2, its fork copies block 2's two rows (tokens 8, 9) into block 3; request 2
    # matches blocks 0, 1 and one row of block 2, copied into the block 3 the fork gave back (its partial
    # block was not indexed beside block 2's): both in request 2's step, in that order; request 2's fork
    # copies block 3's three rows (8, 50, 51) into block 4, queued for a step still to come
    assert out["copies"] == [[2, 3, 2], [2, 3, 1], [3, 4, 3]]


def test_a_prefix_hit_queues_its_partial_block_copy_in_the_batch():
    sch = Scheduler(BlockManager(16, BS), max_num_seqs=8, max_num_batched_tokens=64)
    a = submit(sch, 1, list(range(10)))
    first = step(sch)
    assert first.copies == []
    src = a.blocks[2]
    sch.finish(a, "stop")  # its last partial block [8, 9] is indexed: a later prompt copies its rows
    b = submit(sch, 2, list(range(9)) + [50, 51])
    batch = step(sch)
    assert batch.copies == [(src, b.blocks[2], 1)] and b.blocks[2] != src  # token 8: one row
    assert batch.prefill[0].start == 9  # the forward starts after the copied row
    assert sch.copies == []


def test_a_fork_between_steps_rides_in_the_next_batch_and_waits_for_a_step_that_runs():
    """A fork is made after the forward that computed its leader's prompt: its copy goes with the next
    step. Where that step has no work (every sample stopped at its first token), the copy waits for the
    next step that runs: the child's block is indexed in the prefix tree already, holding those rows."""
    sch = Scheduler(BlockManager(16, BS), max_num_seqs=8, max_num_batched_tokens=64)
    lead = submit(sch, 1, [7, 8, 9, 10, 11, 12], n=2)
    step(sch)
    child = Sequence(lead.request, 1, list(lead.tokens), lead.num_prompt, None)
    lead.request.sequences.append(child)
    sch.fork(lead, child)
    fork_copy = (lead.blocks[1], child.blocks[1], 2)
    assert sch.copies == [fork_copy]
    for s in (lead, child):
        s.tokens.append(99)
        sch.finish(s, "stop")
    empty = sch.schedule()
    assert not empty and empty.copies == [] and sch.copies == [fork_copy]
    submit(sch, 2, [1, 2, 3])
    assert step(sch).copies == [fork_copy] and sch.copies == []


def test_copies_apply_in_the_order_they_were_queued():
    """A copy may read a block an earlier copy of the same step wrote (a reused block): order matters."""
    spec = type("Spec", (), {"k_shape": (1, 2), "v_shape": (1, 2)})()
    cache = KVCache(3, BS, [spec], [torch.device("cpu")], torch.float32, zeroed=True)
    cache.k[0][:BS] = cache.v[0][:BS] = 1.0
    cache.apply_copies([(0, 1, 3), (1, 2, 2)])
    assert cache.k[0][2 * BS : 2 * BS + 2].eq(1).all() and cache.v[0][2 * BS + 2 :].eq(0).all()
    assert cache.k[0][BS : BS + 3].eq(1).all() and cache.k[0][BS + 3].eq(0).all()
