"""The process groups the engine and the model use, low enough for both: a tensor-parallel `Group`, the
`GroupLost` a collective raises when a peer is gone (`lost_rank`), and `shutdown`, the end of every
process group while the interpreter still runs.

The launch itself (who this process is, the c10d store, the start message, the split into replicas of
a tensor-parallel group) is the job's: svrmad_local/job/launch.py.

The end of a process: `shutdown()` destroys every process group and waits for gloo's threads to end
while the interpreter still runs. A group left to the interpreter's exit ends its threads during
finalization, where one that still holds the last collective's tensor must take the interpreter's lock
to free it: the process aborts inside gloo ("terminate called without an active exception") or hangs.
The replica that finishes first met that at its exit, early in a run (the idle replica of a short run);
under load the window is wide.
"""

from __future__ import annotations

import gc
import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

from svrmad_local.errors import UserError


class GroupLost(UserError, RuntimeError):
    """A rank of a tensor-parallel group stopped (died, or was killed) while the others waited on it:
    the run stops with one line; what was committed stays, and a rerun resumes."""

    @staticmethod
    def behind(exc: BaseException | None) -> GroupLost | None:
        """The GroupLost an exception was raised from, if any (a question's failure wraps it)."""
        while exc is not None and not isinstance(exc, GroupLost):
            exc = exc.__cause__ or exc.__context__
        return exc


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
        import torch.distributed as dist

        if dist.is_initialized():
            return cls(tuple(range(dist.get_world_size())), dist.get_rank(), None)
        return cls(tuple(range(int(os.environ.get("WORLD_SIZE", "1")))), int(os.environ.get("RANK", "0")), None)


@contextmanager
def lost_rank(group: Group, what: str = "a rank of the tensor-parallel group stopped"):
    """A collective that fails because a peer is gone becomes GroupLost: one line, and the run stops
    (a question it was computing is not recorded as failed; a rerun computes it)."""
    import torch.distributed as dist

    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        # the failed collective's frames hold its group: let it go, so shutdown() can end the group's threads
        traceback.clear_frames(exc.__traceback__)
        raise GroupLost(f"rank {dist.get_rank()} (tensor-parallel group {list(group.ranks)}): {what} "
                        f"({' '.join(str(exc).split())[:160]})") from None


def shutdown(groups: list[Group] = ()) -> None:
    """Destroy every process group and end gloo's threads now, while the interpreter runs: torch's own
    references go with destroy_process_group, ours with `groups`' (a Group held by a model or an engine
    keeps its ranks, not its process group); a group's threads end when its last reference does."""
    import torch.distributed as dist

    for g in groups:
        object.__setattr__(g, "pg", None)  # frozen: a Group is shared by the model, the engine and its channel
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # a cycle may hold the last reference