"""Tensor parallelism at run time: one engine over a model that models/shard.py split across a group.

Each rank holds its slice of every split weight (models/shard.py says which, docs/plan.md why) and the
model's own modules run on it; the only collectives inside the forward are the all-reduces this
module hooks after each attention block and each MLP/MoE block (their outputs are partial sums over
the rank's heads, columns or expert slices): two per decoder layer.

The group's first rank (its leader) runs the engine as usual: the controllers, the scheduler,
sampling. Each step it broadcasts the step's plain numbers (`scheduler.StepInput`: token ids, positions,
block tables, cache copies) as two int64 tensors (`pack`), and the other ranks run the same forward on
their shard, through the static decode path where the leader's takes it (engine/graphs.py: every rank
captures the same graphs, NCCL's all-reduces inside, or none). Block tables are
identical on all ranks because only the leader decides them; each rank's paged cache holds its own KV
heads (the spec probe sees the local head count). Embeddings and the LM head are whole on every rank,
so sampling and the token statistics need no collective and the tokens come from the leader alone.

Several groups may share one launch (replicas of a TP group, svrmad_local/job/launch.py): every collective
here names its group.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.distributed as dist

from svrmad_local.dist import Group, GroupLost, lost_rank  # noqa: F401  (Group, GroupLost: public here too)

from .scheduler import StepInput


def group_of(model) -> Group | None:
    """The tensor-parallel group the model was split over (models/shard.py), None for a whole model."""
    g = getattr(model, "svrmad_tp", None)
    return g if g is not None and g.size > 1 else None


def _cpu_or(device: torch.device, group: Group) -> torch.device:
    return device if dist.get_backend(group.pg) == "nccl" else torch.device("cpu")


def agree_on_blocks(num_blocks: int, device: torch.device, group: Group) -> int:
    """Every rank allocates the same number of blocks (the smallest budget), since the leader's block
    tables index all of them."""
    t = torch.tensor([num_blocks], dtype=torch.long, device=_cpu_or(device, group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.pg)
    return int(t.item())


def ranks_where(flags: list[bool], device: torch.device, group: Group) -> list[list[int]]:
    """Per flag, the group ranks (indices in the group) where it holds, in one collective: every rank
    learns each one's, so all take the same decision (capture a graph or not) and their collectives keep
    pairing up."""
    t = torch.zeros(len(flags), group.size, dtype=torch.long, device=_cpu_or(device, group))
    t[:, group.rank] = torch.tensor([int(bool(f)) for f in flags], dtype=torch.long)
    dist.all_reduce(t, group=group.pg)
    return [[r for r, f in enumerate(row) if f] for row in t.tolist()]


def graphs_record_collectives(group: Group) -> bool:
    """Whether a CUDA graph can record this group's all-reduce: NCCL's kernels run on the device and are
    captured with the step (NCCL 2.9 and later); gloo's go through the host."""
    return dist.get_backend(group.pg) == "nccl"


def ready_for_capture(device: torch.device, group: Group) -> None:
    """Before the first capture: NCCL makes a group's communicator at its first collective, which a
    graph cannot record, so one all-reduce on the device first, then the device synchronised (vLLM and
    SGLang do the same before theirs)."""
    all_reduce(torch.zeros(1, device=_cpu_or(device, group)), group)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sums `t` over the group, in place: the row-parallel end of an attention or MLP block (our decoder
    calls it after o_proj and after the MLP; the modules' path hooks the same call, models/shard.py)."""
    with lost_rank(group):
        dist.all_reduce(t, group=group.pg)
    return t


class StepChannel:
    """The leader sends every step (or None to stop) to the other ranks of its group, as tensors: a
    header of HEADER int64 values (`pack` says which), then the step's numbers in one int64 tensor, two
    broadcasts on the group's device (the GPU under NCCL, the host under gloo); no pickle."""

    def __init__(self, group: Group, device: torch.device | str = "cpu"):
        self.group = group
        self.device = _cpu_or(torch.device(device), group)

    def send(self, step: StepInput | None) -> None:
        header, payload = pack(step)
        with lost_rank(self.group):
            dist.broadcast(header.to(self.device), src=self.group.leader, group=self.group.pg)
            if payload.numel():
                dist.broadcast(payload.to(self.device), src=self.group.leader, group=self.group.pg)

    def recv(self) -> StepInput | None:
        with lost_rank(self.group, f"its leader (rank {self.group.leader}) stopped sending steps"):
            header = torch.empty(HEADER, dtype=torch.long, device=self.device)
            dist.broadcast(header, src=self.group.leader, group=self.group.pg)
            header = header.cpu()
            payload = torch.empty(payload_size(header), dtype=torch.long, device=self.device)
            if payload.numel():
                dist.broadcast(payload, src=self.group.leader, group=self.group.pg)
        return unpack(header, payload.cpu())


# The header: [kind (STOP or STEP), ids, runs, num_decode, copies, keys (-1: None), blocks (all runs')]
HEADER, STOP, STEP = 7, 0, 1


def pack(step: StepInput | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step, None packing as the stop: the payload is the token ids, each run's
    start, end and number of blocks, every run's blocks one after the other, the copies' (src, dst,
    rows) and the keys' (uid, epoch), all int64. Every field of StepInput is an integer or a list of
    them; `keys` may be None, which the header says with -1."""
    if step is None:
        return torch.tensor([STOP] + [0] * (HEADER - 1)), torch.empty(0, dtype=torch.long)
    blocks = [b for _, _, b in step.runs]
    n_blocks = sum(map(len, blocks))
    keys = step.keys
    header = [STEP, len(step.ids), len(step.runs), step.num_decode, len(step.copies),
              -1 if keys is None else len(keys), n_blocks]
    parts = [step.ids, (x for s, e, b in step.runs for x in (s, e, len(b))), itertools.chain.from_iterable(blocks),
             itertools.chain.from_iterable(step.copies), itertools.chain.from_iterable(keys or ())]
    size = payload_size(header)
    payload = np.fromiter(itertools.chain(*parts), dtype=np.int64, count=size)
    return torch.tensor(header), torch.from_numpy(payload)


def payload_size(header) -> int:
    """How many int64 values follow a header."""
    kind, ids, runs, _, copies, keys, blocks = (int(x) for x in header)
    return 0 if kind == STOP else ids + 3 * runs + blocks + 3 * copies + 2 * max(keys, 0)


def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInput | None:
    """The StepInput `pack` made (None for the stop), in Python ints."""
    kind, n_ids, n_runs, num_decode, n_copies, n_keys, n_blocks = header.tolist()
    if kind == STOP:
        return None
    if kind != STEP or len(payload) != payload_size(header):
        raise ValueError(f"a step header {header.tolist()} that does not match its {len(payload)} values")
    values = payload.tolist()
    at = n_ids
    ids, shape = values[:at], values[at:at + 3 * n_runs]
    at += 3 * n_runs
    runs = []
    for i in range(n_runs):
        start, end, n = shape[3 * i: 3 * i + 3]
        runs.append((start, end, values[at:at + n]))
        at += n
    copies = [tuple(values[at + 3 * i: at + 3 * i + 3]) for i in range(n_copies)]
    at += 3 * n_copies
    keys = None if n_keys < 0 else [tuple(values[at + 2 * i: at + 2 * i + 2]) for i in range(n_keys)]
    return StepInput(ids, runs, num_decode, copies, keys)
