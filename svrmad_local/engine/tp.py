"""Tensor parallelism at run time: one engine over a model that models/shard.py split across a group.

Each rank holds its slice of every split weight (models/shard.py says which, docs/plan.md why) and the
model's own modules run on it; the only collectives inside the forward are the all-reduces this
module hooks after each attention block and each MLP/MoE block (their outputs are partial sums over
the rank's heads, columns or expert slices): two per decoder layer.

The group's first rank (its leader) runs the engine as usual: the controllers, the scheduler,
sampling. Each step it broadcasts the step's plain numbers (`scheduler.StepInput`: token ids, positions,
block tables, cache copies) as two int64 tensors (`pack`), and the other ranks run the same forward on
their shard. A run's block table crosses once: both ends of the channel keep a mirror of the tables the
followers hold (`TableMirror`, by sequence uid and blocks_epoch), so a step carries only the blocks a
follower lacks (one a sequence every block_size tokens, or a whole table after its epoch changed) and the
follower rebuilds the same StepInput the leader runs. Every rank runs it through the static decode path
where the leader's takes it (engine/graphs.py: every rank captures the same graphs, NCCL's all-reduces
inside, or none). Block tables are identical on all ranks because only the leader decides them; each
rank's paged cache holds its own KV heads (the spec probe sees the local head count). Embeddings and the
LM head are whole on every rank, so sampling and the token statistics need no collective and the tokens
come from the leader alone. A step launched before the leader read the one before (EngineConfig.overlap)
is sent marked FED: its ids are still on the leader's device, and every rank takes them from there
(`take_leaders`) before the step runs.

Several groups may share one launch (replicas of a TP group, svrmad_local/job/launch.py): every collective
here names its group.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

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


# The header: [kind (STOP or STEP), ids, runs, num_decode, copies, keys (-1: None), blocks (the new blocks of
# all runs)]; each run's numbers: start, end, blocks kept, blocks new, the last block kept (-1: none)
HEADER, STOP, STEP, FED, RUN = 7, 0, 1, 2, 5  # FED: a step whose ids come from the leader's device (StepInput.fed)
KEEP = 1024  # the sequences a channel's mirrors keep at least: many times a step's (max_num_seqs, 64 by default)


def keep_for(max_num_seqs: int) -> int:
    """How many sequences the mirrors keep for an engine of `max_num_seqs`: a step's sequences and as many
    again three times over (preempted and waiting ones come back with their blocks), at least KEEP; fewer
    would resend whole tables every step (correct, but a long context's worth of bytes)."""
    return max(KEEP, 4 * max_num_seqs)


def take_leaders(t: torch.Tensor, group: Group) -> None:
    """`t` on every rank becomes the leader's: the token ids of a step launched before the leader read the
    step that sampled them (StepInput.fed), sent device to device under NCCL, queued behind what is already
    queued (never waited for by the host); over gloo through the host."""
    here = _cpu_or(t.device, group)
    buf = t if here == t.device else t.to(here)
    with lost_rank(group):
        dist.broadcast(buf, src=group.leader, group=group.pg)
    if buf is not t:
        t.copy_(buf)


class TablesDisagree(RuntimeError):
    """A follower's mirror lacks blocks its leader's says it keeps: a bug, never a state to run a step in."""


class TableMirror:
    """The block tables as the followers hold them, one copy at each end of a `StepChannel`: per sequence
    uid, its blocks_epoch and the block ids the last step that ran it carried (a run's list covers its
    context, [0, end)). Within one epoch a sequence's blocks only grow by appends (scheduler.py bumps
    `Sequence.blocks_epoch` on any other change: an adopted cached block, a preemption, a fork), so the
    blocks a follower keeps under the run's (uid, epoch) are the run's leading blocks, and only the rest
    need to cross. Both ends change their mirror only from the steps themselves, in the same order (`put`
    per run, `evict` at the end of each step), so they stay identical without a message of their own.
    The `capacity` uids used most recently are kept; a finished sequence's uid, never seen again, is
    dropped once that many others have run since. A mirror never changes the lists it keeps."""

    def __init__(self, capacity: int = KEEP):
        if capacity < 1:
            raise ValueError(f"a table mirror keeps at least 1 sequence, not {capacity}")
        self.capacity = capacity
        self.tables: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()  # uid: (epoch, blocks), oldest first

    def kept(self, uid: int, epoch: int, n: int) -> int:
        """How many leading blocks of a run of `n` blocks, of sequence `uid` at `epoch`, the followers keep."""
        held = self.tables.get(uid)
        return 0 if held is None or held[0] != epoch else min(len(held[1]), n)

    def rebuild(self, uid: int, epoch: int, kept: int, last: int, new: list[int]) -> list[int]:
        """A run's whole block list from its `kept` leading blocks, the last of them `last` as the leader
        has it, and the `new` ones that crossed; raises TablesDisagree where this mirror does not hold
        what the leader's says."""
        if not kept:
            return new
        held = self.tables.get(uid)
        blocks = held[1] if held is not None and held[0] == epoch else []
        if len(blocks) < kept or blocks[kept - 1] != last:
            have = ("nothing" if held is None else f"epoch {held[0]}" if held[0] != epoch
                    else f"{len(blocks)} blocks" if len(blocks) < kept else f"block {kept - 1} as {blocks[kept - 1]}")
            raise TablesDisagree(
                f"tensor-parallel step: the leader says this rank keeps {kept} blocks of sequence {uid} (epoch "
                f"{epoch}), block {kept - 1} being {last}, and it keeps {have}: the two mirrors of the block "
                "tables disagree (a bug)")
        if kept == len(blocks) and not new:
            return blocks
        return blocks[:kept] + new

    def put(self, uid: int, epoch: int, blocks: list[int]) -> None:
        self.tables[uid] = (epoch, blocks)
        self.tables.move_to_end(uid)

    def evict(self) -> None:
        while len(self.tables) > self.capacity:
            self.tables.popitem(last=False)


class StepChannel:
    """The leader sends every step (or None to stop) to the other ranks of its group, as tensors: a
    header of HEADER int64 values (`pack` says which), then the step's numbers in one int64 tensor, two
    broadcasts on the group's device (the GPU under NCCL, the host under gloo); no pickle. Each end keeps
    a `TableMirror` of the block tables the followers hold, so a run's blocks cross once: a step carries
    only the blocks each follower lacks."""

    def __init__(self, group: Group, device: torch.device | str = "cpu", keep: int = KEEP):
        self.group = group
        self.device = _cpu_or(torch.device(device), group)
        self.mirror = TableMirror(keep)

    def send(self, step: StepInput | None) -> None:
        header, payload = pack(step, self.mirror)
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
        return unpack(header, payload.cpu(), self.mirror)


def pack(step: StepInput | None, mirror: TableMirror | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a step, None packing as the stop: the payload is the token ids, each run's
    RUN numbers (start, end, how many leading blocks the followers keep, how many follow, the last kept
    one as a check), the runs' new blocks one after the other, the copies' (src, dst, rows) and the keys'
    (uid, epoch), all int64. `mirror` is what the followers hold, updated here as `unpack` updates
    theirs (None: they hold nothing); a step without keys sends every run whole and keeps nothing."""
    if step is None:
        return torch.tensor([STOP] + [0] * (HEADER - 1)), torch.empty(0, dtype=torch.long)
    mirror = TableMirror() if mirror is None else mirror
    keys = step.keys
    shape, new = [], []
    for i, (start, end, blocks) in enumerate(step.runs):
        kept = 0
        if keys is not None:
            uid, epoch = keys[i]
            kept = mirror.kept(uid, epoch, len(blocks))
            mirror.put(uid, epoch, blocks)
        shape += (start, end, kept, len(blocks) - kept, blocks[kept - 1] if kept else -1)
        new.append(blocks[kept:] if kept else blocks)
    mirror.evict()
    n_new = sum(map(len, new))
    header = [FED if step.fed else STEP, len(step.ids), len(step.runs), step.num_decode, len(step.copies),
              -1 if keys is None else len(keys), n_new]
    parts = [step.ids, shape, itertools.chain.from_iterable(new), itertools.chain.from_iterable(step.copies),
             itertools.chain.from_iterable(keys or ())]
    payload = np.fromiter(itertools.chain(*parts), dtype=np.int64, count=payload_size(header))
    return torch.tensor(header), torch.from_numpy(payload)


def payload_size(header) -> int:
    """How many int64 values follow a header."""
    kind, ids, runs, _, copies, keys, blocks = (int(x) for x in header)
    return 0 if kind == STOP else ids + RUN * runs + blocks + 3 * copies + 2 * max(keys, 0)


def unpack(header: torch.Tensor, payload: torch.Tensor, mirror: TableMirror | None = None) -> StepInput | None:
    """The StepInput `pack` made (None for the stop), in Python ints, each run's blocks rebuilt whole from
    what `mirror` keeps (the same mirror `pack` saw, None: a fresh one), which it updates."""
    kind, n_ids, n_runs, num_decode, n_copies, n_keys, n_new = header.tolist()
    if kind == STOP:
        return None
    values = payload.tolist()
    shape = values[n_ids:n_ids + RUN * n_runs]
    if (kind not in (STEP, FED) or len(values) != payload_size(header) or n_keys not in (-1, n_runs)
            or sum(shape[3::RUN]) != n_new or min(shape[2::RUN], default=0) < 0 or min(shape[3::RUN], default=0) < 0):
        raise ValueError(f"a step header {header.tolist()} that does not match its {len(values)} values")
    mirror = TableMirror() if mirror is None else mirror
    at = n_ids + RUN * n_runs + n_new
    copies = [tuple(values[at + 3 * i: at + 3 * i + 3]) for i in range(n_copies)]
    at += 3 * n_copies
    keys = None if n_keys < 0 else [tuple(values[at + 2 * i: at + 2 * i + 2]) for i in range(n_keys)]
    runs = []
    at = n_ids + RUN * n_runs
    for i in range(n_runs):
        start, end, kept, n, last = shape[RUN * i: RUN * i + RUN]
        new = values[at:at + n]
        at += n
        if keys is None:
            if kept:
                raise ValueError(f"a step header {header.tolist()} whose run {i} keeps blocks but names no sequence")
            blocks = new
        else:
            uid, epoch = keys[i]
            blocks = mirror.rebuild(uid, epoch, kept, last, new)
            mirror.put(uid, epoch, blocks)
        runs.append((start, end, blocks))
    mirror.evict()
    return StepInput(values[:n_ids], runs, num_decode, copies, keys, kind == FED)
