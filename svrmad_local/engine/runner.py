"""One forward step: flatten the scheduled runs, run the model body, read logits only where needed.

The LM head is applied to the few rows that sample (the last position of each finished prefill or
decode) and, in chunks, to the rows a scoring request asks about: never to every prompt position.
"""

from __future__ import annotations

import inspect
import itertools
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from svrmad_local import kernels
from svrmad_local.kernels._backend import FORCE_ENV, staged
from svrmad_local.kernels import cpu_decode
from svrmad_local.models import hf

from . import mla
from .attention import FLASH_PAGE, HAS_FLASH_ATTN, Attachment, PagedKV, Span, StepContext, flash_attn_varlen_func
from .context import set_context
from .execution import AttentionPaths, Choice
from .kv_cache import BlockTables, DeviceTables, KVCache
from .scheduler import Batch
from .spec import ModelSpec


@dataclass
class StepInput:
    """One step in plain numbers: the new token ids in row order; per run (start, end, block ids
    covering [0, end)), decode runs first (`num_decode` of them); cache row copies to apply first; per
    run its sequence's (uid, blocks_epoch), which the device's copy of the decode rows' block tables is
    kept by (kv_cache.DeviceTables; None: the tables are built from the runs)."""

    ids: list[int]
    runs: list[tuple[int, int, list[int]]]
    num_decode: int
    copies: list[tuple[int, int, int]]
    keys: list[tuple[int, int]] | None = None


class ModelRunner:
    def __init__(self, model, attached: Attachment, cache: KVCache, spec: ModelSpec, block_size: int,
                 paths: AttentionPaths):
        self.model = model
        self.attached = attached
        self.body = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.cache = cache
        self.spec = spec
        self.block_size = block_size
        self.device = self.body.get_input_embeddings().weight.device
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        # the attention choices, made once (choose_attention, engine/execution.py): read, never recomputed
        self.paths = paths
        # the static decode path (engine/graphs.py) reads the cache in place even where flash-attn runs
        self.static_paths = replace(paths, decode=paths.inplace_decode, flash=False, cascade=None)
        # the Triton path reads the levels' block tables on the host (cascade_plan moves them once a step)
        self.levels_device = self.device if paths.cascade in (None, "torch") else torch.device("cpu")
        self.static = None  # engine.graphs.StaticDecode: decode-only steps at fixed shapes (set by the engine)
        self.paged_kv = PagedKV()
        self.decoder = None  # engine.decoder.Decoder where our forward runs (set by the engine)
        self.tp = None  # set by engine.tp for tensor parallelism: sends each step to the other ranks
        self.tables = DeviceTables(self.device)  # the decode rows' block tables, kept between steps

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
    def forward(self, batch: Batch) -> torch.Tensor:
        """Runs the model over the step's new tokens; returns the final hidden states [T, H] in the
        order of `batch.work` (the decode runs, then the prefill runs)."""
        step = self.prepare(batch)
        if self.tp is not None:
            self.tp.send(step)
        return self.execute(step)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Runs one step on this rank (the leader's, or one a tensor-parallel follower received): its
        queued cache copies first, then the forward."""
        self.cache.apply_copies(step.copies)
        shape = self.static.shape(step) if self.static is not None else None
        if shape is not None:
            return self.static.run(step, shape)
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
        context parked for the attention and the cache hook: final hidden states [T, H]."""
        set_context(ctx)
        try:
            with self.attached():
                if self.decoder is not None:
                    return self.decoder(ids, pos)
                return hf.run_body(self.body, ids, pos, self.paged_kv).last_hidden_state[0]
        finally:
            set_context(None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the raw distribution for a few rows."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.device)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def choose_attention(attention: str, cascade: str, kernel_impl: str, mla_mode: str, device: torch.device,
                     dtype: torch.dtype, spec: ModelSpec, block_size: int) -> tuple[AttentionPaths, dict[str, Choice]]:
    """How the steps attend, decided once at build: the switches the runner and the hooks read
    (AttentionPaths), and the record's attention, decode, prefill, cascade and mla choices with their
    reasons. A path asked for by name that cannot run here is an error, naming why."""
    if attention not in ("auto", "flash", "sdpa", "paged"):
        raise ValueError(f"attention must be auto, flash, sdpa or paged, got {attention!r}")
    triton_ok = kernels.select_impl(kernel_impl, device, "paged_decode") == "triton"
    flash_paged_ok = flash_takes_block_table() if HAS_FLASH_ATTN else False
    flash = choose_flash(attention, HAS_FLASH_ATTN, device, dtype, spec.has_latent, block_size, triton_ok, flash_paged_ok)
    if attention == "flash" and not flash:
        raise ValueError("attention='flash' needs flash-attn installed, a CUDA device, fp16/bf16 weights and "
                         "no latent (MLA) layers")
    on_cascade = _cascade_enabled(cascade, kernel_impl, device) and not flash
    # decode rows read K/V in place through their block tables instead of gathering every sequence's
    # context in every layer: Triton's split-K kernel (kernels/paged_decode.py) where Triton runs, the
    # compiled C++ one (kernels/cpu_decode.py) on the CPU; "sdpa" keeps the gather path. The static
    # decode path (engine/graphs.py) takes it even where flash-attn runs the dynamic steps.
    inplace = None
    if attention in ("auto", "paged", "flash"):
        if triton_ok:
            inplace = "triton"
        elif device.type == "cpu" and cpu_decode.available():
            inplace = "cpu"
    if attention == "paged" and inplace is None:
        raise ValueError("attention='paged' needs Triton (a GPU, or kernel_impl='triton' under its interpreter) "
                         f"or, on the CPU, the compiled kernel: {cpu_decode.unavailable_reason() or 'not built'}")
    decode = None if flash or on_cascade else inplace
    # where decode runs Triton's kernel (a GPU without flash-attn), per-head K/V prefill chunks are read in
    # place too (kernels/paged_prefill.py) instead of gathered per layer; the CPU keeps its prefill path
    prefill_in_place = decode == "triton"
    flash_paged = flash and flash_paged_ok and block_size % FLASH_PAGE == 0
    mla_absorbed = mla.check_mode(mla_mode) == "absorbed" and spec.has_latent
    mla_impl = kernels.select_impl(kernel_impl, device, "mla_decode")
    cascade_impl = kernels.select_impl(kernel_impl, device, "cascade_attention")
    summary = ("flash-attn" if flash else "sdpa") + (f"+paged-decode:{decode}" if decode else "") \
        + ("+paged-prefill:triton" if prefill_in_place else "") + (" (paged)" if flash_paged else "") \
        + (f"+mla-absorbed:{mla_impl}" if mla_absorbed else "") + (f"+cascade:{cascade_impl}" if on_cascade else "")
    paths = AttentionPaths(kernel_impl, flash, flash_paged, decode, inplace, prefill_in_place, mla_absorbed,
                           cascade_impl if on_cascade else None, summary)
    no_kernel = _why_no_inplace(attention, device, kernel_impl)
    # a fallback: the in-place decode kernel was wanted (not attention='sdpa', nor kernel_impl='torch' on a GPU)
    missed = attention != "sdpa" and inplace is None and "kv" in {s.kind for s in spec.layers} \
        and (device.type == "cpu" or (kernel_impl != "torch" and not _torch_forced()))
    if flash:
        attn = Choice("attention", "flash-attn" + (" (paged)" if flash_paged else ""), "asked for" if attention == "flash"
                      else "it reads the cache in place" if flash_paged else "our Triton kernels cannot run here")
    else:
        attn = Choice("attention", "sdpa", _why_not_flash(attention, device, dtype, spec.has_latent, block_size,
                                                          flash_paged_ok))
    if on_cascade:
        dec = Choice("decode", f"cascade:{cascade_impl}", "cascade='on': shared prefixes attended once")
    elif flash:
        dec = Choice("decode", "flash-attn", f"flash-attn runs the steps (the static path: {inplace or 'none'})")
    elif decode:
        dec = Choice("decode", f"in place:{decode}", "kernels/paged_decode.py" if decode == "triton"
                     else "the compiled CPU kernel (kernels/cpu_decode.py)")
    else:
        dec = Choice("decode", "gather", "attention='sdpa'" if attention == "sdpa" else no_kernel, fell_back=missed)
    if flash:
        pre = Choice("prefill", "flash-attn", "flash-attn runs the steps")
    elif prefill_in_place:
        pre = Choice("prefill", "in place:triton", "kernels/paged_prefill.py")
    else:
        pre = Choice("prefill", "gather", "the CPU has no in-place prefill kernel" if device.type == "cpu" else
                     "attention='sdpa'" if attention == "sdpa" else no_kernel, fell_back=missed and device.type != "cpu")
    casc = Choice("cascade", f"on:{cascade_impl}" if on_cascade else "off",
                  "asked for" if on_cascade else "flash-attn runs the steps" if cascade == "on"
                  else "as asked" if cascade == "off" else "auto is off: measured slower (runner._cascade_enabled)")
    latent = Choice("mla", f"absorbed:{mla_impl}" if mla_absorbed else "expanded" if spec.has_latent else "none",
                    f"mla={mla_mode!r}" if spec.has_latent else "no latent (MLA) layers")
    return paths, {c.name: c for c in (attn, dec, pre, casc, latent)}


def _why_not_flash(attention: str, device: torch.device, dtype: torch.dtype, latent: bool, block_size: int,
                   paged: bool) -> str:
    """Why the steps attend through SDPA and our kernels rather than flash-attn (choose_flash said no)."""
    if attention in ("sdpa", "paged"):
        return f"attention={attention!r}"
    if not HAS_FLASH_ATTN:
        return "flash-attn is not installed"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs fp16/bf16, not {str(dtype).removeprefix('torch.')}"
    if latent:
        return "latent (MLA) layers"
    why = "its varlen call takes no block table" if not paged else f"blocks of {block_size} tokens are not whole 256-token pages"
    return f"our Triton kernels read the cache in place; flash-attn would gather it ({why})"


def _torch_forced() -> bool:
    """The environment forces every kernel's torch reference (kernels._backend.FORCE_ENV)."""
    return os.environ.get(FORCE_ENV, "").lower() == "torch"


def _why_no_inplace(attention: str, device: torch.device, kernel_impl: str) -> str:
    """Why no in-place decode kernel runs here (for the record's reason)."""
    if attention == "sdpa":
        return "attention='sdpa'"
    if device.type == "cpu":
        return f"the compiled CPU decode kernel is unavailable: {cpu_decode.unavailable_reason() or 'not built'}"
    if not kernels.HAS_TRITON:
        return "Triton is not installed"
    if kernel_impl == "torch":
        return "kernel_impl='torch'"
    if _torch_forced():
        return f"{FORCE_ENV}=torch"
    return "Triton's decode kernel failed earlier in this process: its torch reference runs (engine.info['fallbacks'])"


def choose_flash(attention: str, installed: bool, device: torch.device, dtype: torch.dtype, latent: bool,
                 block_size: int, triton_ok: bool, paged: bool = True) -> bool:
    """Whether steps attend through flash-attn's varlen call. It needs a CUDA device, fp16/bf16 and no
    latent layers; asked for ("flash"), it is taken; under "auto" only where it reads the cache in place
    (blocks of a multiple of its 256-token pages, and an installed release whose varlen call takes a
    block table: `paged`, see `flash_takes_block_table`) or where our Triton kernels, which read any
    block size in place, cannot run: flash-attn over a gather of every context in every layer is what
    they replace."""
    if not (installed and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not latent):
        return False
    if attention == "flash":
        return True
    return attention == "auto" and ((paged and block_size % FLASH_PAGE == 0) or not triton_ok)


def flash_takes_block_table(fn=None) -> bool:
    """Whether the installed flash-attn's varlen call reads a paged cache: its `block_table` argument came
    in flash-attn 2.5.7 (Dao-AILab/flash-attention#831); `flash-attn>=2.5` admits releases without it,
    which would fail at the first step. Read from the signature, not the version string."""
    fn = fn if fn is not None else flash_attn_varlen_func
    if fn is None:
        return False
    try:
        return "block_table" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a compiled function without a signature: assume the old call
        return False


def _cascade_enabled(cascade: str, kernel_impl: str, device: torch.device) -> bool:
    """"auto" is off, as measured: on the CPU the torch reference costs more in per-level overhead
    than the shared gathers save; on an H100 the Triton path (one plan per step) made bench_engine's
    debate workload slower (1.7B shape: 12.4 s vs 8.1 s), and the kernel alone breaks even with
    attention over per-query copies only at a 16k-token prefix shared by 32 queries (docs/kernels.md).
    "on" turns it on anywhere (Triton on CUDA, the torch reference elsewhere)."""
    if cascade not in ("auto", "on", "off"):
        raise ValueError(f"cascade must be auto, on or off, got {cascade!r}")
    return cascade == "on"


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
