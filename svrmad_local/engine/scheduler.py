"""Which sequences run each step, where their KV goes, and every change of a sequence's state.

Continuous batching: running sequences (decoding, or part-way through a chunked prefill) go first,
then waiting ones are admitted while the token budget, the sequence cap and free blocks allow.
Admission reuses the longest cached prefix (`BlockManager.match`). When a running sequence needs a
block and none is free, the most recently admitted sequence is preempted: its blocks go back to the
cache (indexed, so its recompute is mostly a cache hit) and it waits at the head of the queue.
Memory therefore never exceeds the budget and a full cache never crashes the engine.

The scheduler owns every transition of a sequence (admit, preempt, fork, finish, abort); the engine
only decides *when* (sampling, stop conditions) and resolves requests. It touches no tensor: where a
sequence starts from rows of another block (a prefix hit's or a fork's partial block), it queues the
copy, and the next `Batch` carries the queued copies to the runner, which applies them, in order,
before the step's forward reads or writes the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, CacheFull, common_prefix
from .sequence import Sequence


class RequestTooLarge(ValueError):
    """The request can never fit in the KV-cache budget."""


@dataclass
class Work:
    """Sequence `seq` computes tokens[start:end] this step."""

    seq: Sequence
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Batch:
    """One step: single-token runs (decodes, batched in one attention call) and multi-token runs
    (prefill chunks), in the row order the runner lays them out; sequences that can never fit; and the
    cache row copies (src block, dst block, rows) queued since the last step, to apply first, in order."""

    decode: list[Work] = field(default_factory=list)
    prefill: list[Work] = field(default_factory=list)
    rejected: list[tuple[Sequence, RequestTooLarge]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def work(self) -> list[Work]:
        return self.decode + self.prefill

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = blocks
        self.bs = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # row copies (src block, dst block, rows) queued for the next step that runs: a fork made after a
        # step's forward waits here, as do copies whose step has no work (every sequence stopped)
        self.copies: list[tuple[int, int, int]] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """A sequence waits and the sequence cap leaves it room (blocks and tokens permitting)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def add(self, seq: Sequence) -> None:
        need = -(-(len(seq.tokens) + 1) // self.bs)
        if need > self.bm.num_blocks:
            raise RequestTooLarge(
                f"request {seq.request.id}: {len(seq.tokens)} tokens need {need} KV blocks but the whole "
                f"budget holds {self.bm.num_blocks}; raise kv_cache_memory or shorten the prompt"
            )
        self.waiting.append(seq)

    # -- block bookkeeping ------------------------------------------------------------------
    # Every change of a sequence's blocks goes through these three, which keep its request's count of the
    # blocks its sequences hold (`held_blocks`) and mark a change other than an append (`blocks_epoch`:
    # the runner's device copy of the table is appended to, and rewritten only then).
    def _set_blocks(self, seq: Sequence, blocks: list[int]) -> None:
        held = seq.request.held_blocks
        for b in seq.blocks:
            held[b] -= 1
            if not held[b]:
                del held[b]
        for b in blocks:
            held[b] = held.get(b, 0) + 1
        seq.blocks = blocks
        seq.blocks_epoch += 1

    def _append_block(self, seq: Sequence, b: int) -> None:
        seq.blocks.append(b)
        held = seq.request.held_blocks
        held[b] = held.get(b, 0) + 1

    def _replace_block(self, seq: Sequence, i: int, b: int) -> None:
        old, held = seq.blocks[i], seq.request.held_blocks
        if b == old:
            return
        held[old] -= 1
        if not held[old]:
            del held[old]
        held[b] = held.get(b, 0) + 1
        seq.blocks[i] = b
        seq.blocks_epoch += 1

    def reserve(self, seq: Sequence, end: int) -> None:
        """Make sure `seq` holds blocks for positions [0, end); raises CacheFull."""
        while len(seq.blocks) * self.bs < end:
            self._append_block(seq, self.bm.allocate())

    def index_full_blocks(self, seq: Sequence) -> None:
        """Put the blocks `seq` has filled into the prefix tree (possibly adopting identical ones)."""
        while (seq.num_indexed + 1) * self.bs <= seq.num_computed:
            self._register(seq, seq.num_indexed, (seq.num_indexed + 1) * self.bs)
            seq.num_indexed += 1

    def _register(self, seq: Sequence, i: int, end: int) -> None:
        """Index block i of `seq`, holding tokens [i * bs, end), under its predecessor."""
        parent = seq.blocks[i - 1] if i else None
        self._replace_block(seq, i, self.bm.register(parent, seq.blocks[i], tuple(seq.tokens[i * self.bs : end])))

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, indexing its last partial block so later prompts can copy it."""
        self.index_full_blocks(seq)
        rows = seq.num_computed - seq.num_indexed * self.bs
        if 0 < rows < self.bs and seq.num_indexed < len(seq.blocks):
            self._register(seq, seq.num_indexed, seq.num_computed)
        self.bm.release(seq.blocks)
        self._set_blocks(seq, [])
        seq.num_computed, seq.num_indexed = 0, 0

    def _admit_blocks(self, seq: Sequence, inflight: list[Sequence]) -> str:
        """Reuse the cached prefix and allocate the rest of the known tokens. Returns "ok",
        "full" (the cache cannot take it now; nothing held) or "defer": its uncached part starts
        with at least a block's worth of tokens that a prompt in this step's batch is computing
        (`inflight`: admitted now, or a chunked prefill continuing), so it waits one step and then
        reads them from the cache (SGLang's in-batch prefix sharing: the S debates of one receiver
        share the DebateFormat head after [question + answer])."""
        limit = len(seq.tokens) - 1
        if seq.request.score_from is not None:
            limit = min(limit, seq.request.score_from - 1)  # scored positions need their hidden states
        shared, covered, partial = self.bm.match(seq.tokens, max(limit, 0))
        self._set_blocks(seq, shared)
        seq.num_computed, seq.num_indexed = covered, len(shared)
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
                self.copies.append((src, seq.blocks[-1], rows))
                seq.num_computed += rows
            self.reserve(seq, len(seq.tokens))
        except CacheFull:
            self.free(seq)
            return "full"
        finally:
            if partial is not None:
                self.bm.release([partial[0]])
        return "ok"

    # -- transitions --------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free(seq)
        seq.request.usage.preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, leader: Sequence, child: Sequence) -> None:
        """Start sample `child` of an n > 1 request from its leader's prompt KV: full blocks shared,
        the partial last block copied. With no room (or no sequence slot) it waits and is
        recomputed from the cache when admitted."""
        bs = self.bs
        full = leader.num_computed // bs
        for b in leader.blocks[:full]:
            self.bm.incref(b)
        self._set_blocks(child, list(leader.blocks[:full]))
        child.num_indexed, child.num_computed = min(full, leader.num_indexed), full * bs
        rows = leader.num_computed - full * bs
        if rows:
            try:
                self.reserve(child, full * bs + 1)
                self.copies.append((leader.blocks[full], child.blocks[-1], rows))
                child.num_computed += rows
            except CacheFull:
                self.free(child)
        if child.blocks and len(self.running) < self.max_num_seqs:
            self.running.append(child)
        else:
            if child.blocks:
                self.free(child)
            self.waiting.appendleft(child)

    def finish(self, seq: Sequence, reason: str) -> bool:
        """Take `seq` out of the queues and free its blocks. Returns True when this was the last
        unfinished sequence of its request."""
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # a fork that found no room and stopped on its first token
            self.waiting.remove(seq)
        self.free(seq)
        req = seq.request
        req.finished.append(seq)
        return len(req.finished) == req.num_outputs

    def abort(self, request) -> None:
        """Drop every unfinished sequence of `request` (it failed)."""
        for seq in [s for s in list(self.running) + list(self.waiting) if s.request is request]:
            (self.running if seq in self.running else self.waiting).remove(seq)
            self.free(seq)

    def abort_all(self) -> None:
        """Drop every sequence (after a failed step): blocks go back, queues empty."""
        for seq in list(self.running) + list(self.waiting):
            self.free(seq)
        self.running.clear()
        self.waiting.clear()

    def postprocess(self, batch: Batch) -> None:
        """After the forward: the step's KV is written, so the computed counts move and the newly
        filled blocks enter the prefix tree."""
        for w in batch.work:
            w.seq.num_computed = w.end
            if w.seq.blocks:
                self.index_full_blocks(w.seq)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, admit: bool = True, skip=()) -> Batch:
        """The next step's batch. A step scheduled before the previous one's tokens are read
        (EngineConfig.overlap) admits nothing (`admit` False: a waiting sequence may hold a token not yet
        known) and leaves out the running sequences in `skip` (the previous step ends them by length)."""
        work: list[Work] = []
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running or budget == 0 or seq in skip:
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
        deferred: list[Sequence] = []
        # prompts whose tokens this step computes: running prefill chunks (a long prompt admitted in
        # an earlier step), then each prompt admitted now
        computing = [w.seq for w in work if w.num_tokens > 1]
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            verdict = self._admit_blocks(seq, computing)
            if verdict == "full":
                break
            self.waiting.popleft()
            if verdict == "defer":
                deferred.append(seq)
                continue
            self.running.append(seq)
            computing.append(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            work.append(Work(seq, seq.num_computed, seq.num_computed + n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        batch = Batch([w for w in work if w.num_tokens == 1], [w for w in work if w.num_tokens != 1])
        if batch:  # only a step that runs applies them; the blocks they fill may be indexed already
            batch.copies, self.copies = self.copies, []
        if admit and not batch and self.waiting and not self.running and not deferred:
            seq = self.waiting.popleft()
            batch.rejected.append((seq, RequestTooLarge(
                f"request {seq.request.id} cannot be admitted: the KV-cache budget is too small for it")))
        return batch


@dataclass
class StepInput:
    """One step in plain numbers, what the runner makes of a Batch (and what a tensor-parallel leader
    sends its followers, engine/tp.py): the new token ids in row order; per run (start, end, block ids
    covering [0, end)), decode runs first (`num_decode` of them); cache row copies to apply first; per
    run its sequence's (uid, blocks_epoch), which the device's copy of the decode rows' block tables
    (kv_cache.DeviceTables) and the tensor-parallel channel's mirror of the tables (tp.TableMirror) are
    kept by (None: the tables are built, and sent, from the runs whole). `fed`: the ids are placeholders, the
    real ones still on the leader's device in its previous step's rows (EngineConfig.overlap): the leader
    gathers them there and every rank takes them from it (graphs.StaticDecode)."""

    ids: list[int]
    runs: list[tuple[int, int, list[int]]]
    num_decode: int
    copies: list[tuple[int, int, int]]
    keys: list[tuple[int, int]] | None = None
    fed: bool = False
