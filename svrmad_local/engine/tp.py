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

Several groups may share one launch (replicas of a TP group, svrmad_local/dist.py): every collective
here names its group.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from svrmad_local.dist import GroupLost


@dataclass(frozen=True)
class Group:
    """One tensor-parallel group: `ranks` are global ranks, `rank` this process's index among them."""

    ranks: tuple[int, ...]
    rank: int
    pg: object = None  # the torch.distributed ProcessGroup (None: the default group)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        """The global rank that runs the engine and sends the steps."""
        return self.ranks[0]

    @classmethod
    def whole_world(cls) -> Group:
        """Every process of the launch (read from torchrun's environment before the group exists, so
        a refusal of the split comes before any collective)."""
        if dist.is_initialized():
            return cls(tuple(range(dist.get_world_size())), dist.get_rank(), None)
        return cls(tuple(range(int(os.environ.get("WORLD_SIZE", "1")))), int(os.environ.get("RANK", "0")), None)


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


def reduce_outputs(module: torch.nn.Module, group: Group) -> None:
    """Sum `module`'s output (a tensor, or a tuple whose first item is the tensor) over the group, in
    place, after every forward: the row-parallel end of an attention or MLP block."""

    def hook(_mod, _args, out):
        t = out[0] if isinstance(out, tuple) else out
        with lost_rank(group):
            dist.all_reduce(t, group=group.pg)
        return out

    module.register_forward_hook(hook)


@contextmanager
def lost_rank(group: Group, what: str = "a rank of the tensor-parallel group stopped"):
    """A collective that fails because a peer is gone becomes GroupLost: one line, and the run stops
    (a question it was computing is not recorded as failed; a rerun computes it)."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        raise GroupLost(f"rank {dist.get_rank()} (tensor-parallel group {list(group.ranks)}): {what} "
                        f"({' '.join(str(exc).split())[:160]})") from None


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
