"""Tensor parallelism at run time: one engine over a model that models/shard.py split across a group.

Each rank holds its slice of every split weight (models/shard.py says which, docs/plan.md why) and the
model's own modules run on it; the only collectives inside the forward are the all-reduces this
module hooks after each attention block and each MLP/MoE block (their outputs are partial sums over
the rank's heads, columns or expert slices): two per decoder layer.

The group's first rank (its leader) runs the engine as usual: the controllers, the scheduler,
sampling. Each step it broadcasts the step's plain numbers (`runner.StepInput`: token ids, positions,
block tables, cache copies) and the other ranks run the same forward on their shard. Block tables are
identical on all ranks because only the leader decides them; each rank's paged cache holds its own KV
heads (the spec probe sees the local head count). Embeddings and the LM head are whole on every rank,
so sampling and the token statistics need no collective and the tokens come from the leader alone.

Several groups may share one launch (replicas of a TP group, svrmad_local/job/launch.py): every collective
here names its group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from svrmad_local.dist import Group, GroupLost, lost_rank  # noqa: F401  (Group, GroupLost: public here too)


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


def all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Sums `t` over the group, in place: the row-parallel end of an attention or MLP block (our decoder
    calls it after o_proj and after the MLP; the modules' path hooks the same call, models/shard.py)."""
    with lost_rank(group):
        dist.all_reduce(t, group=group.pg)
    return t


class StepChannel:
    """The leader sends every step (or None to stop) to the other ranks of its group."""

    def __init__(self, group: Group):
        self.group = group

    def send(self, step) -> None:
        with lost_rank(self.group):
            dist.broadcast_object_list([step], src=self.group.leader, group=self.group.pg)

    def recv(self):
        box = [None]
        with lost_rank(self.group, f"its leader (rank {self.group.leader}) stopped sending steps"):
            dist.broadcast_object_list(box, src=self.group.leader, group=self.group.pg)
        return box[0]
