"""The engine's torch state, built once on its worker thread, and the execution choices made on the way.

`build` sets the engine's KV pool (sized from `EngineConfig.kv_cache_memory`, agreed across ranks under
tensor parallelism), its cache, runner and block manager, and gathers every execution choice (each made
by the module that knows it) into `eng.execution`, one frozen record (engine/execution.py) that the
runner reads, `Engine.info` reports, run.json stores, and `svrmad run` says in one line at start.
"""

from __future__ import annotations

import logging

import torch

from svrmad_local.models import calibrate
from svrmad_local import kernels
from svrmad_local.models.linear import select_linear, weight_bytes
from svrmad_local.models.loader import describe_dtype

from . import graphs, tp
from .attention import Attachment
from .block_manager import BlockManager
from .config import EngineConfig
from .execution import Choice, Execution
from .kv_cache import KVCache
from .decoder import select_decoder
from . import mla
from .memory import (available_memory, empty_cache, fraction, keep_freed_memory, kv_pool, measurable, measure,
                     workload_cap)
from .runner import ModelRunner, StepInput, choose_attention
from .spec import inspect_model
from .threads import StepWatch, threads_choice

log = logging.getLogger("svrmad_local")
SHORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def layer_device(model, layers, i: int) -> torch.device:
    """Where layer i's KV lives: its own device under an accelerate device map."""
    if layers is not None and i < len(layers):
        p = next(layers[i].parameters(), None)
        if p is not None:
            return p.device
    return model.base_model.get_input_embeddings().weight.device


def build(eng, model, cfg: EngineConfig) -> None:
    """The engine's torch state (worker thread): linears, probe, KV-cache, runner; and `eng.execution`,
    the record of every choice made on the way (engine/execution.py)."""
    attached = Attachment(model)
    eng.spec = spec = inspect_model(model, attached)  # raises UnsupportedModel, naming the feature (before any timing)
    sel = select_linear(model, cfg.linear, workload=calibrate.Workload.for_engine(
        cfg.max_num_seqs, cfg.max_num_batched_tokens), cache=cfg.cache_dir)
    eng.linear_calibration = calibrate.recorded(model)  # None where `auto` measured nothing
    linear = Choice("linear", sel.value, sel.line, fell_back=sel.fell_back)
    eng.weight_bytes = weight_bytes(model)
    layers = model.base_model.layers if hasattr(model.base_model, "layers") else None
    devices = [layer_device(model, layers, i) for i in range(len(spec.layers))]
    layer_bytes = [KVCache.bytes_per_block([s], cfg.block_size, spec.dtype) for s in spec.layers]
    block_bytes = sum(layer_bytes)
    mc = model.config.get_text_config()
    eng.max_model_len = getattr(mc, "max_position_embeddings", None) or 1 << 30
    cap = workload_cap(cfg.max_num_seqs, eng.max_model_len, cfg.block_size, block_bytes)
    eng.tp_group = tp.group_of(model)
    eng.sharded = eng.tp_group is not None
    eng.block_bytes = block_bytes
    eng._watch = None
    if devices[0].type == "cpu":
        keep_freed_memory()
        eng._watch = StepWatch(cfg.adapt_threads)  # the team sized to the cores it gets; warns on barrier sleeps
    head = model.get_output_embeddings().weight
    device = model.base_model.get_input_embeddings().weight.device
    paths, attention = choose_attention(cfg.attention, cfg.cascade, cfg.kernel_impl, cfg.mla, device, head.dtype, spec,
                                        cfg.block_size)
    if spec.has_latent:
        mla.install(model)  # absorbed steps hand kv_b_proj nothing to expand (engine/mla.py)
    # Where the pool's size depends on what a forward takes (a GPU; the default or a fraction), the cache
    # starts provisional: a forward at the largest prefill chunk is measured over it, and the decode
    # graphs' memory too; the real cache is sized after both, from the memory free before any of it.
    free = {d: available_memory(d) for d in dict.fromkeys(devices)}
    profiling = any(measurable(d) for d in devices) and (cfg.kv_cache_memory is None
                                                          or fraction(cfg.kv_cache_memory) is not None)
    measure_graphs = cfg.cuda_graphs in ("auto", "on") and graphs.can_capture(devices[0])
    tokens, context = profile_shape(cfg, eng.max_model_len, model if paths.mla_absorbed else None, spec.dtype)
    provisional = 0
    if profiling or measure_graphs:
        provisional = max(graphs.PROVISIONAL_BLOCKS, -(-(tokens + context) // cfg.block_size) if profiling else 0)
    eng.cache = KVCache(provisional, cfg.block_size, spec.layers, devices, spec.dtype, zeroed=True) if provisional \
        else None
    eng.runner = ModelRunner(model, attached, eng.cache, spec, cfg.block_size, paths)
    eng.runner.decoder, decoder = select_decoder(model, spec, cfg.decoder, cfg.kernel_impl)
    held = {}
    if profiling:  # every rank of a tensor-parallel group profiles (the forward's collectives pair up)
        held = measure(devices, lambda: profile_forward(eng.runner, model, tokens, context))
    pool = kv_pool(cfg.kv_cache_memory, devices, layer_bytes, cap, held, free)
    eng.kv_held = {str(d): n for d, n in held.items()}
    eng.kv_budget_bytes, eng.kv_budget_rule = pool.bytes, pool.rule
    num_blocks = pool.blocks()
    if eng.sharded:
        num_blocks = tp.agree_on_blocks(num_blocks, devices[0], eng.tp_group)
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory!r} holds {num_blocks} blocks of {block_bytes} bytes "
                         f"({pool.rule}); need at least 2")
    eng.graph_reserve = 0  # bytes of the KV budget kept for the decode graphs
    unaffordable = None
    if measure_graphs:
        if graphs.why_off(cfg.cuda_graphs, eng.runner, eng.tp_group) is None:
            eng.graph_reserve = graphs.graph_memory(eng.runner, cfg.max_num_seqs, max_blocks(eng, num_blocks))
        short = pool.blocks({devices[0]: eng.graph_reserve}) < 3
        unaffordable = (f"the decode graphs take {eng.graph_reserve} bytes, leaving less than 3 KV blocks of "
                        f"kv_cache_memory={cfg.kv_cache_memory!r}") if short else None
        # every rank keeps the graphs or none (their captures' warm-up steps meet in collectives)
        if eng.sharded and tp.ranks_where([short], devices[0], eng.tp_group)[0] and not short:
            short, unaffordable = True, "the decode graphs leave less than 3 KV blocks on another tensor-parallel rank"
        if short:
            eng.graph_reserve = 0
        num_blocks = min(num_blocks, pool.blocks({devices[0]: eng.graph_reserve}))
        if eng.sharded:  # the ranks' graphs may take different memory: the smallest cache again
            num_blocks = tp.agree_on_blocks(num_blocks, devices[0], eng.tp_group)
    # the provisional cache's memory goes back before the real one is made
    eng.cache = eng.runner.cache = None
    empty_cache(devices)
    eng.cache = eng.runner.cache = KVCache(num_blocks, cfg.block_size, spec.layers, devices, spec.dtype)
    eng.kv_devices = pool.per_device(num_blocks)
    eng.runner.static, graphs_choice = static_decode(eng, cfg, num_blocks, unaffordable)
    # the static path's padding rows write a scratch block that no sequence may own: the last one
    eng.blocks = BlockManager(num_blocks - (eng.runner.static is not None), cfg.block_size)
    eng.rank = 0
    if eng.sharded:  # tensor parallel: the group's leader runs the engine, the others follow its steps
        eng.rank = eng.tp_group.rank
        eng._channel = tp.StepChannel(eng.tp_group, device)
        if eng.rank == 0:
            eng.runner.tp = eng._channel
    dtype = SHORT_DTYPES.get(spec.dtype, str(spec.dtype).removeprefix("torch."))
    note, dtype_why = describe_dtype(spec.dtype, device)  # the default dtype of this machine, or as asked
    eng.execution = Execution(
        device=Choice("device", f"{device.type} {dtype}" + (f" ({note})" if note else ""), dtype_why),
        quantization=quantization_choice(model), linear=linear, decoder=decoder, **attention, graphs=graphs_choice,
        tp=Choice("tp", f"{eng.tp_group.size} ranks" if eng.sharded else "off",
                  "the weights are split over the group (engine/tp.py)" if eng.sharded else "one process holds the model"),
        stats=stats_choice(cfg.kernel_impl, head), threads=threads_choice(eng._watch), attention_paths=paths)
    log.info("svrmad: %s", eng.execution.line())


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


def quantization_choice(model) -> Choice:
    """How the checkpoint's weights are held: decided when it was loaded (models/quant.choose_mode)."""
    q = getattr(model, "svrmad_quantization", None)
    if not q:
        return Choice("quantization", "none", "the checkpoint is not quantized")
    return Choice("quantization", f"{q['method']} {q['mode']}", q.get("summary", ""))


def stats_choice(kernel_impl: str, head) -> Choice:
    """Where the token statistics run; on a GPU without Triton under "auto", a fallback."""
    impl = kernels.select_impl(kernel_impl, head)
    fell = kernel_impl == "auto" and head.device.type == "cuda" and impl == "torch"
    if kernel_impl != "auto":
        why = f"kernel_impl={kernel_impl!r}"
    elif impl == "triton":
        why = "Triton on a GPU"
    else:
        why = "Triton is not available" if fell else "the torch reference off a GPU"
    return Choice("stats", impl, why, fell_back=fell)


def static_decode(eng, cfg: EngineConfig, num_blocks: int, why: str | None = None):
    """engine/graphs.py's StaticDecode where cfg.cuda_graphs and the machine allow it (and `why` gives
    no reason against), and the record's graphs choice ("on", "static (eager)" or "off", and why); off
    under "auto" on a CUDA device is a fallback."""
    why = graphs.why_off(cfg.cuda_graphs, eng.runner, eng.tp_group) or why
    if why is None and num_blocks < 3:
        why = f"the KV budget holds {num_blocks} blocks: none to spare for the padding rows' scratch block"
    static = None
    if why is None:
        static = graphs.StaticDecode(eng.runner, cfg.max_num_seqs, max_blocks(eng, num_blocks), num_blocks - 1,
                                     capture=cfg.cuda_graphs != "static")
        if static.found and cfg.cuda_graphs != "static":
            why, static = "the decode step returns to the host: " + "; ".join(static.found[:3]), None
        elif static.capture:  # every shape at start-up, before any request (engine/graphs.py)
            static.capture_all()
    if why is not None and cfg.cuda_graphs in ("on", "static"):
        raise ValueError(f"cuda_graphs={cfg.cuda_graphs!r} cannot run here: {why}")
    if why is not None:
        return None, Choice("graphs", "off", why, fell_back=cfg.cuda_graphs == "auto" and eng.runner.device.type == "cuda")
    if cfg.cuda_graphs == "static":
        return static, Choice("graphs", "static (eager)", "cuda_graphs='static': the static path, not captured")
    return static, Choice("graphs", "on", "decode-only steps replay graphs captured at start-up")

def max_blocks(eng, num_blocks: int) -> int:
    """The static path's widest block table: the model's context, or the cache less its scratch block."""
    return max(1, min(-(-eng.max_model_len // eng.cfg.block_size), num_blocks - 1))

def graphs_info(eng) -> str:
    """Engine.info["cuda_graphs"]: the record's graphs choice, with what the captured graphs did since."""
    static, choice = eng.runner.static, eng.execution.graphs
    if static is None:
        return f"off: {choice.reason}"
    if static.capture:
        failed = ""
        if static.failed:
            (p, w), why = next(iter(static.failed.items()))
            failed = f"; {len(static.failed)} failed, run eagerly (batch {p}, width {w}: {why})"
        return f"on ({len(static.graphs)} shapes captured, {static.replays} steps replayed{failed})"
    return choice.value
