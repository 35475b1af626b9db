"""The engine's torch state, built once on its worker thread: what it built, returned as one frozen record.

`build(model, cfg)` returns a `Built`: the model's spec, the KV cache and its block manager, the
runner, the KV budget (sized from `EngineConfig.kv_cache_memory`, agreed across ranks under tensor
parallelism), the tensor-parallel state, and `execution`, the record of every execution choice
(engine/execution.py), each made once by engine/choices.py on the way. The engine keeps the `Built`
and reads its fields; nothing assigns onto the engine what the build made, and nothing is patched
into the runner afterwards (it gets its decoder, static path and channel in its constructor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from svrmad_local.models.linear import weight_bytes

from . import choices, graphs, mla, tp
from .attention import Attachment
from .block_manager import BlockManager
from .config import EngineConfig
from .execution import Execution
from .kv_cache import KVCache
from .memory import (available_memory, empty_cache, fraction, keep_freed_memory, kv_pool, measurable, measure,
                     workload_cap)
from .runner import ModelRunner
from .scheduler import StepInput
from .spec import ModelSpec, inspect_model
from .threads import StepWatch

log = logging.getLogger("svrmad_local")


@dataclass(frozen=True)
class KVBudget:
    """How big the KV pool is and why: `bytes` and `rule` (how they were chosen, engine/memory.py),
    `block_bytes` (one block over every layer), `held` (per measured device, what the profiled forward
    took), `devices` (per device, what the pool takes there and its budget there) and `graph_reserve`
    (bytes of the budget kept for the decode graphs)."""

    bytes: int
    rule: str
    block_bytes: int
    held: dict[str, int]
    devices: dict[str, dict]
    graph_reserve: int


@dataclass(frozen=True)
class Built:
    """What `build` made, read by the engine (engine.py) and never assigned to: the model's spec, the
    cache, the runner, the block manager (over every block but the static path's scratch one), the
    execution record, the KV budget, the block size and the model's context, the tensor-parallel state
    (`group`, this process's `rank` in it, the `channel` the leader sends its steps on and the others
    receive them from; None, 0 and None for a whole model), the CPU's step watch (None on an
    accelerator), the weights' bytes and the linears' calibration (None where `auto` measured nothing)."""

    spec: ModelSpec
    cache: KVCache
    runner: ModelRunner
    blocks: BlockManager
    execution: Execution
    budget: KVBudget
    block_size: int
    max_model_len: int
    group: Any  # svrmad_local.dist.Group
    rank: int
    channel: tp.StepChannel | None
    watch: StepWatch | None
    weight_bytes: int
    linear_calibration: Any  # models.calibrate.Calibration

    @property
    def sharded(self) -> bool:
        return self.group is not None


def layer_device(model, layers, i: int) -> torch.device:
    """Where layer i's KV lives: its own device under an accelerate device map."""
    if layers is not None and i < len(layers):
        p = next(layers[i].parameters(), None)
        if p is not None:
            return p.device
    return model.base_model.get_input_embeddings().weight.device


def build(model, cfg: EngineConfig) -> Built:
    """The engine's torch state (worker thread): linears, probe, KV-cache, runner, and the record of every
    choice made on the way (engine/choices.py, engine/execution.py)."""
    attached = Attachment(model)
    spec = inspect_model(model, attached)  # raises UnsupportedModel, naming the feature (before any timing)
    head = model.get_output_embeddings().weight
    device = model.base_model.get_input_embeddings().weight.device
    launches = choices.pdl_choice(cfg.pdl, device)  # how the kernels launch, before any is timed or captured
    made = choices.forward_choices(model, spec, cfg, device, head.dtype)  # the linears repacked before any timing
    paths = made.paths
    layers = model.base_model.layers if hasattr(model.base_model, "layers") else None
    devices = [layer_device(model, layers, i) for i in range(len(spec.layers))]
    layer_bytes = [KVCache.bytes_per_block([s], cfg.block_size, spec.dtype) for s in spec.layers]
    block_bytes = sum(layer_bytes)
    mc = model.config.get_text_config()
    max_model_len = getattr(mc, "max_position_embeddings", None) or 1 << 30
    cap = workload_cap(cfg.max_num_seqs, max_model_len, cfg.block_size, block_bytes)
    group = tp.group_of(model)
    watch = None
    if devices[0].type == "cpu":
        keep_freed_memory()
        watch = StepWatch(cfg.adapt_threads)  # the team sized to the cores it gets; warns on barrier sleeps
    # Where the pool's size depends on what a forward takes (a GPU; the default or a fraction), a
    # provisional runner over a provisional cache measures a forward at the largest prefill chunk, and
    # the decode graphs' memory too; the real cache and runner are made after both, from the memory
    # free before any of it.
    free = {d: available_memory(d) for d in dict.fromkeys(devices)}
    profiling = any(measurable(d) for d in devices) and (cfg.kv_cache_memory is None
                                                          or fraction(cfg.kv_cache_memory) is not None)
    measure_graphs = cfg.cuda_graphs in ("auto", "on") and graphs.can_capture(devices[0])
    tokens, context = profile_shape(cfg, max_model_len, model if paths.mla_absorbed else None, spec.dtype)
    provisional = 0
    if profiling or measure_graphs:
        provisional = max(graphs.PROVISIONAL_BLOCKS, -(-(tokens + context) // cfg.block_size) if profiling else 0)
    cache = KVCache(provisional, cfg.block_size, spec.layers, devices, spec.dtype, zeroed=True) if provisional \
        else None
    probe = ModelRunner(model, attached, cache, spec, cfg.block_size, paths, made.decoder,
                        sampling=made.sampling) if provisional else None
    held = {}
    if profiling:  # every rank of a tensor-parallel group profiles (the forward's collectives pair up)
        held = measure(devices, lambda: profile_forward(probe, model, tokens, context))
    pool = kv_pool(cfg.kv_cache_memory, devices, layer_bytes, cap, held, free)
    num_blocks = pool.blocks()
    if group is not None:
        num_blocks = tp.agree_on_blocks(num_blocks, devices[0], group)
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} holds {num_blocks} blocks of {block_bytes} bytes "
                         f"({pool.rule}); need at least 2")
    why_off = graphs.why_off(cfg.cuda_graphs, device, paths, spec, devices, group)
    graph_reserve, found = 0, []  # bytes of the KV budget kept for the decode graphs; what keeps them off
    if measure_graphs:
        if why_off is None:
            graph_reserve, found = graphs.graph_memory(probe, cfg.max_num_seqs,
                                                       max_blocks(max_model_len, cfg.block_size, num_blocks))
        short = pool.blocks({devices[0]: graph_reserve}) < 3
        if short:
            why_off = why_off or (f"the decode graphs take {graph_reserve} bytes, leaving less than 3 KV blocks of "
                                  f"kv_cache_memory={cfg.kv_cache_memory!r}")
        # every rank keeps the graphs or none (their captures' warm-up steps meet in collectives)
        if group is not None and tp.ranks_where([short], devices[0], group)[0] and not short:
            short, why_off = True, "the decode graphs leave less than 3 KV blocks on another tensor-parallel rank"
        if short:
            graph_reserve = 0
        num_blocks = min(num_blocks, pool.blocks({devices[0]: graph_reserve}))
        if group is not None:  # the ranks' graphs may take different memory: the smallest cache again
            num_blocks = tp.agree_on_blocks(num_blocks, devices[0], group)
    # the provisional cache's memory goes back before the real one is made
    del probe, cache
    empty_cache(devices)
    cache = KVCache(num_blocks, cfg.block_size, spec.layers, devices, spec.dtype)
    plan, graphs_made = choices.graphs_choice(cfg.cuda_graphs, why_off, num_blocks, found, device, cfg.max_num_seqs,
                                              max_blocks(max_model_len, cfg.block_size, num_blocks))
    rank, channel = 0, None
    if group is not None:  # tensor parallel: the group's leader runs the engine, the others follow its steps
        rank, channel = group.rank, tp.StepChannel(group, device, tp.keep_for(cfg.max_num_seqs))
    runner = ModelRunner(model, attached, cache, spec, cfg.block_size, paths, made.decoder, plan,
                         channel if rank == 0 else None, made.sampling)
    if runner.static is not None and runner.static.capture:  # every shape at start-up, before any request
        runner.static.capture_all()
    # the static path's padding rows write a scratch block that no sequence may own: the last one
    blocks = BlockManager(num_blocks - (plan is not None), cfg.block_size)
    execution = choices.record(model, spec, cfg, device, head, group, watch, {
        "linear": made.linear, "gemv": made.gemv, "decoder": made.decoder_choice, **made.attention, "graphs": graphs_made,
        "overlap": choices.overlap_choice(cfg.overlap, plan), "pdl": launches, "sampling": made.sampling_choice}, paths)
    log.info("svrmad: %s", execution.line())
    budget = KVBudget(pool.bytes, pool.rule, block_bytes, {str(d): n for d, n in held.items()},
                      pool.per_device(num_blocks), graph_reserve)
    return Built(spec, cache, runner, blocks, execution, budget, cfg.block_size, max_model_len, group, rank, channel,
                 watch, weight_bytes(model), made.calibration)


def max_blocks(max_model_len: int, block_size: int, num_blocks: int) -> int:
    """The static path's widest block table: the model's context, or the cache less its scratch block."""
    return max(1, min(-(-max_model_len // block_size), num_blocks - 1))


def profile_shape(cfg: EngineConfig, max_model_len: int, latent_model, dtype) -> tuple[int, int]:
    """(new tokens, cached context) of the largest step a forward will take, which the KV budget is sized
    after: a prefill chunk of max_num_batched_tokens tokens; where `latent_model`'s latent layers expand
    their context in chunks (MLA absorbed, engine/mla.py), after a cached context of one such chunk."""
    tokens = max(1, min(cfg.max_num_batched_tokens, max_model_len))
    context = 0
    latent = mla.latent_modules(latent_model) if latent_model is not None else []
    if latent:
        m = latent[0]
        context = max(0, min(mla.chunk_slots(m, mla.heads_of(m), dtype, cfg.block_size), max_model_len - tokens))
    return tokens, context


@torch.inference_mode()
def profile_forward(runner, model, tokens: int, context: int) -> None:
    """One prefill step of `tokens` new tokens (token 0) after `context` cached ones over the provisional
    cache, and its LM head row; the absorbed MLA weights are made first, so what they keep is measured
    with it. Build measures what it takes (memory.measure) before sizing the KV pool."""
    if runner.paths.mla_absorbed:
        mla.prepare(model)
    end = context + tokens
    hidden = runner.execute(StepInput([0] * tokens, [(context, end, list(range(-(-end // runner.block_size))))], 0, []))
    runner.logits(hidden[-1:])


