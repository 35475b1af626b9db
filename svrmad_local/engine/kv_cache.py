"""The tensors of the paged KV cache: the block pool's K/V rows, and the block tables kernels read.

The blocks' ids, ref counts and prefix tree live in the torch-free `block_manager.BlockManager`; this
module holds what those ids index: per layer a flat [slots, heads, dim] K and V (`KVCache`, which also
applies the row copies a step carries first: a prefix hit's or a fork's partial block), and
`BlockTables`, the view that the kernels reading the cache in place take: each run's block ids and
context length, as tensors on the step's device (`DeviceTables` keeps the decode rows' on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from svrmad_local.kernels._backend import staged


class KVCache:
    """The tensors behind the block ids: per layer two tensors of shape [num_blocks * block_size,
    heads, dim] (flat slots), each on its layer's device, shaped by the layer's spec: per-head K and V,
    or for a latent layer the compressed latent and the shared RoPE key (`spec.LayerSpec`)."""

    def __init__(self, num_blocks: int, block_size: int, specs: list, layer_devices: list[torch.device], dtype: torch.dtype,
                 zeroed: bool = False):
        """`zeroed`: the provisional cache a profiled forward reads (engine/build.py) holds zeros, not whatever
        the memory held (a NaN there would spread through the forward); the real pool is never filled."""
        slots = num_blocks * block_size
        self.block_size = block_size
        new = torch.zeros if zeroed else torch.empty
        self.k = [new(slots, *s.k_shape, dtype=dtype, device=d) for s, d in zip(specs, layer_devices)]
        self.v = [new(slots, *s.v_shape, dtype=dtype, device=d) for s, d in zip(specs, layer_devices)]
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `slots` (any shape) as [*slots.shape, heads, dim], written into scratch
        buffers kept across layers and steps: a fresh gather per layer costs more in page faults than
        in copying on the CPU. The result is valid until the next gather of the same shape."""
        k, v = self.k[layer], self.v[layer]
        n = slots.numel()
        key = (k.device, k.shape[1:], v.shape[1:])
        buf = self._scratch.get(key)
        if buf is None or buf[0].shape[0] < n:
            size = max(n, int(1.25 * (buf[0].shape[0] if buf else 0)))
            buf = (k.new_empty(size, *k.shape[1:]), v.new_empty(size, *v.shape[1:]))
            self._scratch[key] = buf
        kb, vb = buf[0][:n], buf[1][:n]
        torch.index_select(k, 0, slots.reshape(-1), out=kb)
        torch.index_select(v, 0, slots.reshape(-1), out=vb)
        return kb.view(*slots.shape, *k.shape[1:]), vb.view(*slots.shape, *v.shape[1:])

    @staticmethod
    def bytes_per_block(specs: list, block_size: int, dtype: torch.dtype) -> int:
        return block_size * sum(s.bytes_per_token(dtype) for s in specs)

    def apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (src, dst, rows) in order, the first `rows` token rows of block `src` copied into
        block `dst`, in every layer: the copies a step carries (`StepInput.copies`, queued by the
        scheduler), applied by every rank before the step's forward."""
        bs = self.block_size
        for src, dst, rows in copies:
            s, d = src * bs, dst * bs
            for k, v in zip(self.k, self.v):
                k[d : d + rows] = k[s : s + rows]
                v[d : d + rows] = v[s : s + rows]


@dataclass
class BlockTables:
    """Runs' view of the cache for the kernels that read it in place (decode rows; prefill runs on the
    Triton path): block ids [R, W] (padded with block 0) and context lengths [R] (the run's new tokens
    included), int32 on the step's device; `host_lens` the same lengths as host ints where the step built
    them (paged prefill lays out its tiles from them, so no layer reads the device's copy back)."""

    block_table: torch.Tensor
    lens: torch.Tensor
    host_lens: list[int] | None = None
    _long: tuple | None = field(default=None, repr=False, compare=False)

    def as_long(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table, lens) in int64, the compiled CPU decode kernel's index type: converted once a
        step, on first use, rather than by the kernel in each layer's call."""
        if self._long is None:
            self._long = (self.block_table.long(), self.lens.long())
        return self._long

    @classmethod
    def build(cls, tables: list[list[int]], lens: list[int], device) -> "BlockTables":
        width = max(len(t) for t in tables)
        return cls(staged([t + [0] * (width - len(t)) for t in tables], torch.int32, device),
                   staged(lens, torch.int32, device), list(lens))  # pinned: the copies never block the host

    @classmethod
    def of_runs(cls, runs, device) -> "BlockTables":
        """From a step's runs (start, end, block ids covering [0, end)): each run's table, its end as length."""
        return cls.build([b for _, _, b in runs], [e for _, e, _ in runs], device)

    def to(self, device) -> "BlockTables":
        return BlockTables(self.block_table.to(device, non_blocking=True), self.lens.to(device, non_blocking=True),
                           self.host_lens)


class DeviceTables:
    """Every decoding sequence's block table, kept on the step's device between steps and appended to:
    a decode step uploads the few block ids its sequences gained (one a sequence every `block_size`
    tokens) and gathers its rows on the device, so its host work does not grow with the context (a table
    rebuilt from Python lists each step costs a long context's length in every step). A sequence's row is
    rewritten whole only when its blocks changed other than by an append (`Sequence.blocks_epoch`: an
    identical cached block adopted, a preemption, a fork). Rows and columns grow by doubling as needed; a
    row not used for the longest time is handed to a new sequence when none is free."""

    def __init__(self, device, rows: int = 8, width: int = 64):
        self.device = torch.device(device)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self.meta: list[tuple[int, int, int]] = [(-1, 0, 0)] * rows  # per row: (uid, epoch, blocks written)
        self.row_of: dict[int, int] = {}
        self.used = [0] * rows  # the step that last read each row
        self.step = 0

    def select(self, runs, keys) -> BlockTables:
        """The block tables [R, W] and lengths of `runs` ((start, end, block ids covering [0, end)), as in
        scheduler.StepInput) of the sequences `keys` ((uid, blocks_epoch) each), after writing the block ids
        each row lacks."""
        self.step += 1
        rows, cols, vals, order, ends = [], [], [], [], []
        width = 1
        for (_, end, blocks), (uid, epoch) in zip(runs, keys):
            r = self._row(uid)
            n = len(blocks)
            u, e, written = self.meta[r]
            start = written if (u, e) == (uid, epoch) and written <= n else 0
            if start < n:
                rows.extend([r] * (n - start))
                cols.extend(range(start, n))
                vals.extend(blocks[start:])
            self.meta[r] = (uid, epoch, n)
            self.used[r] = self.step
            order.append(r)
            ends.append(end)
            width = max(width, n)
        self._fit(width)
        if vals:
            index = staged([rows, cols], torch.long, self.device)
            self.table[index[0], index[1]] = staged(vals, torch.int32, self.device)
        picked = torch.index_select(self.table[:, :width], 0, staged(order, torch.long, self.device))
        return BlockTables(picked, staged(ends, torch.int32, self.device), ends)

    def _row(self, uid: int) -> int:
        r = self.row_of.get(uid)
        if r is not None:
            return r
        free = [i for i, (u, _, _) in enumerate(self.meta) if u == -1]
        if free:
            r = free[0]
        else:  # the row read longest ago, unless every row is in this step: then more rows
            r = min(range(len(self.used)), key=self.used.__getitem__)
            if self.used[r] == self.step:
                r = len(self.meta)
                self._fit(rows=2 * r)
            else:
                del self.row_of[self.meta[r][0]]
        self.row_of[uid] = r
        self.meta[r] = (uid, -1, 0)  # an epoch no sequence has: written whole
        return r

    def _fit(self, width: int = 0, rows: int = 0) -> None:
        """Grows the table (doubling) to at least `rows` rows and `width` columns, keeping its contents."""
        R, W = self.table.shape
        if rows <= R and width <= W:
            return
        R2, W2 = max(R, rows), W
        while W2 < width:
            W2 *= 2
        grown = torch.zeros(R2, W2, dtype=torch.int32, device=self.device)
        grown[:R, :W] = self.table
        self.table = grown
        self.meta += [(-1, 0, 0)] * (R2 - R)
        self.used += [0] * (R2 - R)
