"""The host-side bookkeeping of the paged KV cache: block ids, ref counts, the prefix tree, LRU eviction.

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

No tensors here, and no torch: the bookkeeping can be unit-tested and reasoned about without a device
(as vLLM v1 keeps its block pool, KV manager and scheduler free of tensors). The scheduler queues the
row copies in its `Batch`; the runner applies them to `kv_cache.KVCache` at the start of the step.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field


class CacheFull(RuntimeError):
    """No free or evictable block: the scheduler must wait or preempt."""


@dataclass(eq=False)
class Node:
    block: int
    key: tuple[int, ...]
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)


class BlockManager:
    """Ids, ref counts, the prefix tree and LRU eviction; the tensors they index are `kv_cache.KVCache`."""

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
