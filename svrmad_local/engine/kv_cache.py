"""Paged KV-cache with a prefix tree, so identical token prefixes are computed once.

The cache is a fixed pool of blocks (`block_size` tokens of K and V for every layer), allocated up
front under the user's memory budget: memory can never grow past it. Blocks are ref-counted.

Reuse is indexed by a tree whose nodes are blocks and whose edges are the tokens a block holds
(SGLang's radix cache at block granularity, vLLM's chained block hash in tree form):
- a *full* block whose whole token run (and whole prefix) matches is shared by reference;
- where the match ends inside a block, the matching rows are *copied* into a fresh block of the
  request (copy-on-write). So reuse is exact to the token, not rounded down to a block, which
  matters for debates: [question + own answer] rarely ends on a block boundary.
Unreferenced blocks stay in the tree as cache and are evicted least-recently-used first, a whole
subtree at a time (a block is only reachable through its ancestors).

`BlockTables` is the view of the cache that the kernels reading it in place take: each run's
block ids and context length, as tensors on the step's device.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from svrmad_local.kernels._backend import staged


class CacheFull(RuntimeError):
    """No free or evictable block: the scheduler must wait or preempt."""


@dataclass(eq=False)
class Node:
    block: int
    key: tuple[int, ...]
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)


class BlockManager:
    """Ids, ref counts, the prefix tree and LRU eviction; no tensors (see `KVCache`)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget holds no block (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks still in the tree
        self.root = Node(-1, (), None)
        self.node_of: dict[int, Node] = {}  # block id -> its node while it is in the tree
        self.peak_used = 0
        self.evictions = 0
        self._tick = itertools.count()

    # -- accounting -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)

    # -- allocation -------------------------------------------------------------------------
    def allocate(self) -> int:
        if not self.free:
            if not self.lru:
                raise CacheFull("KV-cache budget exhausted")
            self._evict(next(iter(self.lru)))
        b = self.free.pop()
        self.ref[b] = 1
        self._note_peak()
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.lru.pop(b, None)
        self.ref[b] += 1
        self._note_peak()

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds stays cached if it is in the
        tree, else goes back to the free list. Deepest first so LRU evicts leaves first."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} released more often than held"
            if self.ref[b] == 0:
                if b in self.node_of:
                    self.lru[b] = None
                else:
                    self.free.append(b)

    def _evict(self, b: int) -> None:
        node = self.node_of[b]
        assert self.ref[b] == 0, "evicting a referenced block"
        if node.parent is not None:
            node.parent.children.pop(node.key, None)
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}
            del self.node_of[n.block]
            self.lru.pop(n.block, None)
            self.free.append(n.block)
            self.evictions += 1

    # -- the prefix tree --------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> tuple[list[int], int, tuple[int, int] | None]:
        """Longest cached prefix of `tokens[:limit]`.

        Returns (shared full blocks, now referenced by the caller; number of tokens they cover;
        `(source block, rows)` to copy into the caller's next block, or None; the source is
        referenced too, so allocating the copy target cannot evict it: release it after copying).
        """
        bs = self.block_size
        node, shared, pos = self.root, [], 0
        while pos < limit:
            chunk = tuple(tokens[pos : min(pos + bs, limit)])
            child = node.children.get(chunk) if len(chunk) == bs else None
            if child is not None:
                shared.append(child.block)
                node, pos = child, pos + bs
                continue
            best, best_len = None, 0
            for key, c in node.children.items():
                n = common_prefix(key, chunk)
                if n > best_len:
                    best, best_len = c, n
            partial = (best.block, best_len) if best is not None else None
            break
        else:
            partial = None
        for b in shared:
            self.incref(b)
        if partial is not None:
            self.incref(partial[0])  # held while its rows are copied; the caller releases it
        return shared, pos, partial

    def register(self, parent_block: int | None, block: int, key: tuple[int, ...]) -> int:
        """Put `block` (holding `key`'s KV, after the run ending at `parent_block`) in the tree.

        Returns the block the caller should hold: its own, or an identical block already cached
        (then the caller's reference moves to that one and its own block is released).
        """
        parent = self.root if parent_block is None else self.node_of.get(parent_block)
        if parent is None:
            return block  # the chain above is not indexed (evicted or private): keep it private
        existing = parent.children.get(key)
        if existing is not None and existing.block != block:
            self.incref(existing.block)
            self.release([block])
            return existing.block
        if existing is None:
            if len(key) < self.block_size:
                # a partial block is only worth indexing if no cached sibling already covers it
                if any(common_prefix(k, key) == len(key) for k in parent.children):
                    return block
            node = Node(block, key, parent)
            parent.children[key] = node
            self.node_of[block] = node
        return block

    def in_tree(self, block: int) -> bool:
        return block in self.node_of


def common_prefix(a, b, limit: int | None = None) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit]) if limit is not None else zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
        self._copies: list[tuple[int, int, int]] = []
        self.replay = False  # a tensor-parallel follower: copies arrive with the steps

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

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` token rows of block `src` into block `dst`, in every layer. Done at
        once, and remembered until the next step is prepared (`take_copies`), so that tensor-parallel
        ranks, whose caches only the steps change, replay it in the same order."""
        self._apply(src, dst, rows)
        self._copies.append((src, dst, rows))

    def _apply(self, src: int, dst: int, rows: int) -> None:
        s, d = src * self.block_size, dst * self.block_size
        for k, v in zip(self.k, self.v):
            k[d : d + rows] = k[s : s + rows]
            v[d : d + rows] = v[s : s + rows]

    def take_copies(self) -> list[tuple[int, int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def apply_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """Replay copies made on another rank (a no-op for the copies this cache made itself)."""
        if self.replay:
            for c in copies:
                self._apply(*c)


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
        runner.StepInput) of the sequences `keys` ((uid, blocks_epoch) each), after writing the block ids
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
