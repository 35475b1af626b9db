"""One forward step: flatten the scheduled runs, run the model body, read logits only where needed.

The LM head is applied to the few rows that sample (the last position of each finished prefill or
decode) and, in chunks, to the rows a scoring request asks about: never to every prompt position.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import torch

from svrmad_local import kernels
from svrmad_local.kernels._backend import staged
from svrmad_local.models import hf

from . import graphs
from .attention import Attachment, PagedKV, Span, StepContext
from .context import set_context
from .execution import AttentionPaths
from .kv_cache import BlockTables, DeviceTables, KVCache
from .scheduler import Batch, StepInput
from .spec import ModelSpec


class ModelRunner:
    """One forward a step, over the model, the KV cache and the attention switches the build chose.

    Everything it runs with comes in its constructor: our decoder (None: the model's own body), the
    static decode path's plan (graphs.Plan, None: off) and the tensor-parallel channel it sends each
    step on (None: it runs alone, or it is a follower). The static path is built here, over this
    runner, from that plan: it reads the runner's cache, switches and body, and the runner replays it;
    built by its owner, it is never patched in afterwards. The build makes a provisional runner (no
    static path, no channel) over a provisional cache where it measures a forward or the graphs'
    memory, then this one over the real cache."""

    def __init__(self, model, attached: Attachment, cache: KVCache, spec: ModelSpec, block_size: int,
                 paths: AttentionPaths, decoder=None, static: graphs.Plan | None = None, tp=None, sampling=None):
        self.model = model
        self.attached = attached
        self.body = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.cache = cache
        self.spec = spec
        self.block_size = block_size
        self.device = self.body.get_input_embeddings().weight.device
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        # the attention choices, made once (engine/choices.py): read, never recomputed
        self.paths = paths
        # the static decode path (engine/graphs.py) reads the cache in place even where flash-attn runs
        self.static_paths = replace(paths, decode=paths.inplace_decode, flash=False, cascade=None)
        # the Triton path reads the levels' block tables on the host (cascade_plan moves them once a step)
        self.levels_device = self.device if paths.cascade in (None, "torch") else torch.device("cpu")
        self.paged_kv = PagedKV()
        self.decoder = decoder  # engine.decoder.Decoder where our forward runs (engine/relinear.py may rebuild it)
        self.tp = tp  # engine.tp.StepChannel on a tensor-parallel leader: sends each step to the other ranks
        self.sampling = sampling  # sampler.FusedRows: the row counts a step samples at in Triton (None: all)
        self.tables = DeviceTables(self.device)  # the decode rows' block tables, kept between steps
        # decode-only steps at fixed shapes (engine/graphs.py); it runs a probe step over the cache now
        self.static = None if static is None else graphs.StaticDecode(
            self, static.max_num_seqs, static.max_blocks, static.scratch, static.capture)

    def prepare(self, batch: Batch) -> StepInput:
        """What every rank needs to run the step, in plain numbers (the tensor-parallel followers
        receive it): new token ids and, per run, its positions and block table; the decode runs
        first; and the cache copies (prefix and fork partial blocks) the scheduler queued since the last step."""
        ids: list[int] = []
        runs = []
        for w in batch.work:
            ids.extend(w.seq.tokens[w.start : w.end])
            runs.append((w.start, w.end, w.seq.blocks[: -(-w.end // self.block_size)]))
        keys = [(w.seq.uid, w.seq.blocks_epoch) for w in batch.work]
        return StepInput(ids, runs, len(batch.decode), batch.copies, keys)

    @torch.inference_mode()
    def forward(self, batch: Batch, draws=None, fed=None, step: StepInput | None = None) -> torch.Tensor | graphs.Decoded:
        """Runs the model over the step's new tokens; returns the final hidden states [T, H] in the
        order of `batch.work` (the decode runs, then the prefill runs), or, where the static decode path
        ran the step, a `graphs.Decoded`: its hidden states, and its rows' tokens and statistics where
        it sampled `draws` (sampler.Draws of a step whose every row samples; None: the Step samples).
        `fed`: its ids are still on the device (`execute`); `step`: the batch already prepared."""
        step = self.prepare(batch) if step is None else step
        step.fed = fed is not None
        if self.tp is not None:
            self.tp.send(step)
        return self.execute(step, draws, fed)

    @torch.inference_mode()
    def execute(self, step: StepInput, draws=None, fed=None) -> torch.Tensor | graphs.Decoded:
        """Runs one step on this rank (the leader's, or one a tensor-parallel follower received): its
        queued cache copies first, then the forward (`forward` says what it returns). `fed`: the step's
        ids are still on the device (graphs.StaticDecode.run), which only a static step can read."""
        self.cache.apply_copies(step.copies)
        shape = self.static.shape(step) if self.static is not None else None
        if shape is not None:
            return self.static.run(step, shape, draws, fed)
        if step.fed:
            raise RuntimeError("a step whose token ids are on the device runs only at a static decode shape")
        dev, bs = self.device, self.block_size
        pos, slot_map, runs = [], [], []
        row = 0
        for start, end, blocks in step.runs:  # plain Python: no torch op per sequence
            pos.extend(range(start, end))
            slot_map.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            runs.append(Span(row, row + end - start, table=(blocks, end, bs, dev)))
            row += end - start
        nd, paths = step.num_decode, self.paths
        ctx = StepContext(self.cache, self.spec.layers, staged(slot_map, torch.long, dev), runs, nd, paths)
        # mla="expanded": latent layers get the step's context back from the cache hook, each distinct slot
        # once (forks share their prefix), to be expanded at once by the model's own code; with MLA
        # absorbed every row attends from the cached latent (engine/mla.py, prefill runs a chunk at a time)
        if self.spec.has_latent and not paths.mla_absorbed:
            # on the host (a unique on the GPU waits for it): the runs' slots come from their block tables
            hosts = [r.host_index() for r in runs]
            slots, inverse = np.unique(np.concatenate(hosts), return_inverse=True)
            ctx.latent_slots, inverse = staged(slots, torch.long, dev), staged(inverse, torch.long, dev)
            parts = inverse.split([h.shape[0] for h in hosts])
            ctx.latent_runs = [Span(r.row0, r.row1, part) for r, part in zip(runs, parts)]
        elif self.spec.has_latent:
            ctx.latent_runs = []
        if nd and (paths.mla_absorbed or paths.decode):  # decode rows read the cache in place
            ctx.decode_tables = self.decode_tables(step)
        if paths.prefill_in_place and len(step.runs) > nd:  # prefill rows read the cache in place
            ctx.prefill_tables = BlockTables.of_runs(step.runs[nd:], dev)
            ctx.prefill_cu = [r.row0 - nd for r in runs[nd:]] + [runs[-1].row1 - nd]  # rows of q[nd:]
        if paths.flash:
            lens = [r.index.shape[0] for r in runs]
            ctx.flash = {
                "cu_q": staged([0] + [r.row1 for r in runs], torch.int32, dev),
                "cu_k": staged([0] + list(itertools.accumulate(lens)), torch.int32, dev),
                "max_q": max(r.row1 - r.row0 for r in runs), "max_k": max(lens),
            }
            if paths.flash_paged:  # flash-attn reads the blocks in place through the block table
                ctx.flash["block_table"] = BlockTables.of_runs(step.runs, dev).block_table
            else:  # blocks smaller than flash-attn's 256-token pages: gather the context first
                ctx.flash["slots"] = torch.cat([r.index for r in runs])
        if paths.cascade and nd >= 2:
            decode = step.runs[:nd]
            ctx.decode_levels = decode_levels([b for _, _, b in decode], [e for _, e, _ in decode], bs,
                                              self.levels_device)
            ctx.decode_pos = staged([e - 1 for _, e, _ in decode], torch.long, dev)
        return self.run_body(ctx, staged([step.ids], torch.long, dev), staged([pos], torch.long, dev))

    def decode_tables(self, step: StepInput) -> BlockTables:
        """The decode rows' block tables: from the device's copy, appended to (DeviceTables), where the step
        names its sequences; else built from the runs."""
        nd = step.num_decode
        if step.keys is None:
            return BlockTables.of_runs(step.runs[:nd], self.device)
        return self.tables.select(step.runs[:nd], step.keys[:nd])

    def run_body(self, ctx: StepContext, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Our decoder (engine/decoder.py), or the model's own body, over ids/pos [1, T] with the step's
        context parked for the attention and the cache hook: final hidden states [T, H]. The model's
        attention is switched to the engine's (`attached`) only for its own body: switching costs ~0.1 ms
        of a ~13 ms batch-1 step on a 2-core Xeon, and our decoder never reads the switch."""
        set_context(ctx)
        try:
            if self.decoder is not None:  # it calls the engine's attention itself: the model's switch stays as it is
                return self.decoder(ids, pos)
            with self.attached():
                return hf.run_body(self.body, ids, pos, self.paged_kv).last_hidden_state[0]
        finally:
            set_context(None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the raw distribution for a few rows."""
        head = getattr(self.decoder, "head", None) or self.lm_head  # our decoder's skinny LM head where it has one
        logits = head(hidden.to(self.lm_head.weight.device)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def decode_levels(tables: list[list[int]], lens: list[int], bs: int, device) -> list:
    """Cascade levels for decode queries: runs of full blocks shared by a group of queries (same
    block ids at the same positions: shared full blocks are immutable), split recursively where the
    group diverges; each query's remaining tokens (its current one included) form its own level."""
    Level = kernels.Level
    levels: list = []

    def full(i: int, d: int):
        return tables[i][d] if (d + 1) * bs <= lens[i] else None

    def own(i: int, d: int) -> None:
        n_blocks = -(-lens[i] // bs)
        levels.append(Level(torch.tensor([i], device=device), torch.tensor(tables[i][d:n_blocks], device=device),
                            lens[i] - d * bs, d * bs))

    def split(group: list[int], d: int) -> None:
        start = d
        while len({full(i, d) for i in group}) == 1 and full(group[0], d) is not None:
            d += 1
        if d > start:
            levels.append(Level(torch.tensor(group, device=device),
                                torch.tensor(tables[group[0]][start:d], device=device), (d - start) * bs, start * bs))
        by: dict = {}
        for i in group:
            by.setdefault(full(i, d) if full(i, d) is not None else ("own", i), []).append(i)
        for sub in by.values():
            own(sub[0], d) if len(sub) == 1 else split(sub, d)

    split(list(range(len(tables))), 0)
    return levels
