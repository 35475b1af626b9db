"""Tensor parallelism: one engine over a model that transformers sharded across a process group.

The model is loaded with transformers' own `tp_plan="auto"` (q/k/v/o and the MLP split by heads and
columns, collectives inside its modules), so every rank must run every forward together. Rank 0 runs
the engine as usual: the controllers, the scheduler, sampling. Each step it broadcasts the step's
plain numbers (`runner.StepInput`: token ids, positions, block tables, cache copies) and the other
ranks run the same forward on their shard of the heads. Block tables are identical on all ranks
because only rank 0 decides them; each rank's paged cache holds its own KV heads (the spec probe sees
the local head count). The LM head is gathered once into a full copy on rank 0, so sampling and the
token statistics need no collective and the tokens come from rank 0 alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_sharded(model) -> bool:
    """True when transformers sharded the model's weights (DTensor parameters) over >1 rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def agree_on_blocks(num_blocks: int, device: torch.device) -> int:
    """Every rank allocates the same number of blocks (the smallest budget), since rank 0's block
    tables index all of them."""
    t = torch.tensor([num_blocks], dtype=torch.long, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def full_lm_head(head: torch.nn.Module) -> torch.nn.Linear:
    """A plain Linear with the whole (gathered) LM head; a collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    weight = head.weight.full_tensor() if isinstance(head.weight, DTensor) else head.weight
    bias = getattr(head, "bias", None)
    if isinstance(bias, DTensor):
        bias = bias.full_tensor()
    out = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out.eval()


class StepChannel:
    """Rank 0 sends every step (or None to stop) to the other ranks of the group."""

    def __init__(self, group=None):
        self.group = group

    def send(self, step) -> None:
        dist.broadcast_object_list([step], src=0, group=self.group)

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
