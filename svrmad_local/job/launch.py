"""The launch of `svrmad run`: data parallel over processes started by torchrun or `accelerate launch`:
who this process is, the c10d store they share, and how the launch splits into replicas of a
tensor-parallel group. (The groups themselves, and the end of every process group, stand lower, in
svrmad_local/dist.py, where the engine and the model use them.)

The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `torch.distributed`'s
env:// rendezvous turns them into a TCPStore (torchrun's own, when its agent hosts one). The store's
atomic `add` is the shared work queue (each rank takes the next question index when it has a free
slot), and its set/get hands rank 0's decisions (the RunConfig, the questions to run) to the other
ranks without a collective, so a rank that idles for an hour waiting on a long question never hits
a collective timeout. The process group itself is initialised too (gloo on CPU, nccl on CUDA, each
rank on cuda:LOCAL_RANK) for what needs collectives (tensor parallel).

With `--tp T` the W processes are W/T replicas of T consecutive ranks (torchrun numbers a node's
processes consecutively, so a group whose T divides --nproc-per-node stays on one node, on NVLink):
each group has its own process group for its collectives, and the groups' first ranks (the
leaders) are the data-parallel workers, taking questions from the one shared counter as single
processes do without --tp. The other ranks of a group only follow their leader's steps.

The run's start message: rank 0 publishes the RunConfig and the questions to run (or the one-line
error that stops everyone) under "start"; at the end each worker publishes what it did under
"rank/i" and rank 0 waits for all of them.

The end of a process: `close()` (dist.shutdown where no Dist was made) destroys every process group
and waits for gloo's threads to end while the interpreter still runs (svrmad_local/dist.py says why).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from svrmad_local.dist import Group, shutdown

STORE_TIMEOUT = timedelta(hours=2)  # how long a rank waits for rank 0's start message


BACKEND_ENV = "SVRMAD_DIST_BACKEND"


def backend_for(cuda: bool) -> str:
    """nccl on GPUs, gloo on CPUs; SVRMAD_DIST_BACKEND=gloo on a GPU machine lets several ranks share one
    GPU (collectives through the host: slow, but the tensor-parallel path then runs on a machine of one
    GPU, as the GPU check does)."""
    asked = os.environ.get(BACKEND_ENV, "").strip().lower()
    if asked and asked not in ("nccl", "gloo"):
        raise ValueError(f"{BACKEND_ENV}={asked!r}: use nccl or gloo")
    return asked or ("nccl" if cuda else "gloo")


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    store: Any = None  # a torch.distributed Store (None in a single process)
    gpu: int = 0  # this rank's GPU: LOCAL_RANK, or LOCAL_RANK modulo the GPUs where gloo lets ranks share one
    groups: list[Group] = field(default_factory=list, repr=False)  # the tensor-parallel groups split() made

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Dist:
        """The launcher's process group, or a single process when there is none."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return cls()
        import torch
        import torch.distributed as dist

        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        backend = backend_for(cuda)
        gpu = local_rank
        if cuda:
            count = torch.cuda.device_count()
            if backend == "nccl" and local_rank >= count:
                raise ValueError(f"LOCAL_RANK {local_rank}, but only {count} GPU(s) are visible: one process a GPU "
                                 f"(torchrun --nproc-per-node {count})")
            gpu = local_rank % count  # gloo: ranks may share a GPU
            torch.cuda.set_device(gpu)
        store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=STORE_TIMEOUT))
        if not dist.is_initialized():
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
        # torchrun restarts a failed group with the same store: keep each attempt's keys apart
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(rank, world, local_rank, dist.PrefixStore(f"svrmad/{attempt}", store), gpu)

    # -- replicas of a tensor-parallel group -------------------------------------------------
    def check_tp(self, tp: int) -> None:
        """One line when the launch does not split into whole tensor-parallel groups."""
        if tp > 1 and self.world_size % tp:
            raise ValueError(f"--tp {tp} needs a number of processes that is a multiple of {tp} (replicas of {tp} "
                             f"ranks, e.g. torchrun --nproc-per-node {tp}); this launch has {self.world_size}")

    def split(self, tp: int):
        """(this rank's Group or None for tp 1, the replicas' data-parallel view): the view
        numbers the replicas 0..W/T-1 and shares the store, so its counters are the whole launch's.
        Every rank calls this (making the groups is a collective)."""
        if tp <= 1:
            return None, self
        import torch.distributed as dist

        self.check_tp(tp)
        mine = None
        for first in range(0, self.world_size, tp):  # every rank makes every group, in the same order
            ranks = tuple(range(first, first + tp))
            pg = dist.new_group(list(ranks))
            if self.rank in ranks:
                mine = Group(ranks, self.rank - first, pg)
                self.groups.append(mine)
        replicas = self.world_size // tp
        view = Dist(self.rank // tp, replicas, self.local_rank, self.store) if replicas > 1 else Dist()
        return mine, view

    # -- the run's start and end messages ------------------------------------------------------
    def start(self, message: dict) -> None:
        """Rank 0: what the other ranks start from ({"error": line} stops them)."""
        if self.enabled:
            self.publish("start", message)

    def wait_start(self) -> dict:
        return self.fetch("start")

    def announce(self, make: Callable[[], dict]) -> dict | None:
        """The start of a launch, on every rank: rank 0 runs `make` and sends what it returns to the
        others (a failure is sent as such, so they stop, and raised here); the others wait for it. The
        message on every rank, or None on a rank whose rank 0 failed (it has said why)."""
        if self.is_main:
            try:
                message = make()
            except BaseException as exc:
                self.start({"error": str(exc)})
                raise
            self.start(message)
            return message
        start = self.wait_start()
        return None if "error" in start else start

    def gather(self, info: dict) -> list[dict] | None:
        """Each worker's `info` (its questions, its engine's counters); the list on rank 0 once every
        worker has published, None on the others."""
        self.publish(f"rank/{self.rank}", info)
        self.store.add("finished", 1)
        if not self.is_main:
            return None
        self.wait_count("finished", self.world_size)
        return [self.fetch(f"rank/{r}") for r in range(self.world_size)]

    def device(self, asked: str | None) -> str | None:
        """This rank's device: cuda:LOCAL_RANK for "cuda" or the default on a GPU machine."""
        if not self.enabled:
            return asked
        import torch

        if asked in (None, "cuda") and torch.cuda.is_available():
            return f"cuda:{self.gpu}"
        return asked

    # -- the shared store ---------------------------------------------------------------------
    def publish(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value, default=str))

    def fetch(self, key: str) -> Any:
        """Blocks until `key` is published (up to STORE_TIMEOUT)."""
        return json.loads(self.store.get(key))

    def take(self, key: str) -> int:
        """The next value of a shared counter (0, 1, 2, ... across all ranks)."""
        return self.store.add(key, 1) - 1

    def count(self, key: str) -> int:
        return self.store.add(key, 0)

    def barrier(self, name: str) -> None:
        """Every rank reaches `name` before any goes on (the store wakes the waiters at once)."""
        self.store.set(f"{name}/{self.rank}", "1")
        self.store.wait([f"{name}/{r}" for r in range(self.world_size)])

    def wait_count(self, key: str, n: int, poll_s: float = 0.5) -> None:
        """Wait until counter `key` reaches n (polling: no store timeout however long it takes)."""
        while self.count(key) < n:
            time.sleep(poll_s)

    def close(self) -> None:
        """Every process group destroyed and its threads ended (see the module's docstring); a Group that
        split() made has no process group left afterwards."""
        if self.enabled:
            shutdown(self.groups)
        self.groups.clear()
