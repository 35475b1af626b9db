"""Which sequences run this step, and where their KV goes.

Continuous batching: running sequences (decoding, or part-way through a chunked prefill) go first,
then waiting ones are admitted while the token budget, the sequence cap and free blocks allow.
Admission reuses the longest cached prefix (`BlockManager.match`). When a running sequence needs
a block and none is free, the most recently admitted sequence is preempted: its blocks go back to
the cache (indexed, so its recompute is mostly a cache hit) and it waits at the head of the queue.
Memory therefore never exceeds the budget and a full cache never crashes the engine.
"""

from __future__ import annotations

from collections import deque

from .kv_cache import BlockManager, CacheFull, KVCache, common_prefix
from .runner import Work
from .sequence import Sequence


class RequestTooLarge(ValueError):
    """The request can never fit in the KV-cache budget."""


class Scheduler:
    def __init__(self, blocks: BlockManager, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = blocks
        self.cache = cache
        self.bs = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        need = -(-(len(seq.tokens) + 1) // self.bs)
        if need > self.bm.num_blocks:
            raise RequestTooLarge(
                f"request {seq.request.id}: {len(seq.tokens)} tokens need {need} KV blocks but the whole "
                f"budget holds {self.bm.num_blocks}; raise kv_cache_memory or shorten the prompt"
            )
        self.waiting.append(seq)

    # -- block bookkeeping ------------------------------------------------------------------
    def reserve(self, seq: Sequence, end: int) -> None:
        """Make sure `seq` holds blocks for positions [0, end); raises CacheFull."""
        while len(seq.blocks) * self.bs < end:
            seq.blocks.append(self.bm.allocate())

    def index_full_blocks(self, seq: Sequence) -> None:
        """Put the blocks `seq` has filled into the prefix tree (possibly adopting identical ones)."""
        while (seq.num_indexed + 1) * self.bs <= seq.num_computed:
            self._register(seq, seq.num_indexed, (seq.num_indexed + 1) * self.bs)
            seq.num_indexed += 1

    def _register(self, seq: Sequence, i: int, end: int) -> None:
        """Index block i of `seq`, holding tokens [i * bs, end), under its predecessor."""
        parent = seq.blocks[i - 1] if i else None
        seq.blocks[i] = self.bm.register(parent, seq.blocks[i], tuple(seq.tokens[i * self.bs : end]))

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, indexing its last partial block so later prompts can copy it."""
        self.index_full_blocks(seq)
        rows = seq.num_computed - seq.num_indexed * self.bs
        if 0 < rows < self.bs and seq.num_indexed < len(seq.blocks):
            self._register(seq, seq.num_indexed, seq.num_computed)
        self.bm.release(seq.blocks)
        seq.blocks, seq.num_computed, seq.num_indexed = [], 0, 0

    def _admit_blocks(self, seq: Sequence, inflight: list[Sequence]) -> str:
        """Reuse the cached prefix and allocate the rest of the known tokens. Returns "ok",
        "full" (the cache cannot take it now; nothing held) or "defer": its uncached part starts
        with at least a block's worth of tokens that a prompt admitted this step is computing, so
        it waits one step and then reads them from the cache (SGLang's in-batch prefix sharing:
        the S debates of one receiver share the DebateFormat head after [question + answer])."""
        limit = len(seq.tokens) - 1
        if seq.request.score_from is not None:
            limit = min(limit, seq.request.score_from - 1)  # scored positions need their hidden states
        shared, covered, partial = self.bm.match(seq.tokens, max(limit, 0))
        seq.blocks, seq.num_computed, seq.num_indexed = shared, covered, len(shared)
        if partial is not None:
            covered += partial[1]
        if any(common_prefix(seq.tokens, o.tokens, limit) - covered >= self.bs for o in inflight):
            if partial is not None:
                self.bm.release([partial[0]])
            self.free(seq)
            return "defer"
        try:
            if partial is not None:
                src, rows = partial
                self.reserve(seq, seq.num_computed + 1)
                self.cache.copy_rows(src, seq.blocks[-1], rows)
                seq.num_computed += rows
            self.reserve(seq, len(seq.tokens))
        except CacheFull:
            self.free(seq)
            return "full"
        finally:
            if partial is not None:
                self.bm.release([partial[0]])
        return "ok"

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free(seq)
        seq.request.usage.preemptions += 1
        self.waiting.appendleft(seq)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[Work]:
        work: list[Work] = []
        budget = self.max_tokens
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while True:
                try:
                    self.reserve(seq, seq.num_computed + n)
                    break
                except CacheFull:
                    victim = self.running[-1]
                    work = [w for w in work if w.seq is not victim]
                    self.preempt(victim)
                    if victim is seq:
                        break
            if seq in self.running:
                work.append(Work(seq, seq.num_computed, seq.num_computed + n))
                budget -= n
        admitted: list[Sequence] = []
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            verdict = self._admit_blocks(seq, admitted)
            if verdict == "full":
                break
            self.waiting.popleft()
            if verdict == "defer":
                deferred.append(seq)
                continue
            self.running.append(seq)
            admitted.append(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            work.append(Work(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if not work and self.waiting and not self.running and not deferred:
            seq = self.waiting[0]
            raise RequestTooLarge(f"request {seq.request.id} cannot be admitted: the KV-cache budget is too small for it")
        work.sort(key=lambda w: w.end - w.start != 1)  # single-token runs first: they batch in one call
        return work
