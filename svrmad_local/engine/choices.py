"""Every execution choice of an engine, made once, at build: the one room that decides how it runs.

engine/build.py calls these in the order the build needs their answers (the linears before anything
is timed, the attention paths before the decoder and the cache, the graphs once the KV budget is
known) and `record` gathers the outcomes into the frozen `Execution` (engine/execution.py). After
build nothing chooses again: the runner, the attention hooks and the static decode path read the
record's `AttentionPaths`, a step reads what the runner was built with, and `Engine.info` reads the
record. What a module alone knows stays there and is called from here: the decoder
(`decoder.select_decoder`), the linears (`models/linear.select_linear`), the threads policy
(`threads.threads_choice`), why the static path cannot run (`graphs.why_off`), and each kernel's
implementation (`kernels.select_impl`).

What may still change after build is a reaction, not a choice: a Triton kernel that fails at run time
under kernel_impl="auto" is served from its torch reference from then on (`kernels._backend.fall_back`,
reported in `Engine.info["fallbacks"]`), each kernel call resolving its implementation against that;
and `--linear auto` may repack the linears when the run's own steps want another layout
(engine/relinear.py).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from svrmad_local import kernels
from svrmad_local.kernels._backend import FORCE_ENV, choose
from svrmad_local.kernels import cpu_decode, pdl, sample_pack, skinny
from svrmad_local.models import calibrate
from svrmad_local.models.linear import select_linear, weight_bytes
from svrmad_local.models.loader import describe_dtype

from . import gemv, graphs, kept, mla, sampler
from .attention import FLASH_PAGE, HAS_FLASH_ATTN, flash_attn_varlen_func
from .config import GEMV, EngineConfig
from .decoder import ALIASES, select_decoder, why_not
from .execution import AttentionPaths, Choice, Execution
from .families import gated_key, normed_key
from .spec import ModelSpec
from .stats import STATS_TOP_K
from .threads import StepWatch, threads_choice

SHORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class ForForward:
    """The choices a forward needs (`forward_choices`): the linears' record choice and the calibration
    it measured (None where `auto` measured nothing), the few-row linears' record choice, the attention
    switches and their record choices, our decoder (None: the model's own modules) and its record choice,
    the row counts a step's sampling takes the Triton kernels at (sampler.FusedRows) and its record choice."""

    linear: Choice
    calibration: Any
    gemv: Choice
    paths: AttentionPaths
    attention: dict[str, Choice]
    decoder: Any
    decoder_choice: Choice
    sampling: Any
    sampling_choice: Choice


def forward_choices(model, spec: ModelSpec, cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> ForForward:
    """How a forward runs, in the order the choices depend on each other: the linears first (repacked in
    place by models/linear.select_linear, before anything is timed), which of them take the skinny kernel
    at decode's few rows (`gemv_choice`, timed over the linears as they will run), the attention paths
    (`choose_attention`), then our decoder (decoder.select_decoder) over what they made; MLA's absorbed
    weights are installed before it, where the model has latent layers (engine/mla.py). Last, where a
    step's sampling runs (`sampling_choice`): timed, like the linears, before the KV budget is measured."""
    sel = select_linear(model, cfg.linear, workload=calibrate.Workload.for_engine(
        cfg.max_num_seqs, cfg.max_num_batched_tokens), cache=cfg.cache_dir)
    linear = Choice("linear", sel.value, sel.line, fell_back=sel.fell_back)
    ours = ALIASES.get(cfg.decoder, cfg.decoder) != "modules" and why_not(model, spec) is None
    picks, few_rows = gemv_choice(model, cfg.gemv, cfg.kernel_impl, device, cache=cfg.cache_dir, ours=ours)
    paths, attention = choose_attention(cfg.attention, cfg.cascade, cfg.kernel_impl, cfg.mla, device, dtype, spec,
                                        cfg.block_size)
    if spec.has_latent:
        mla.install(model)  # absorbed steps hand kv_b_proj nothing to expand (engine/mla.py)
    decoder, decoder_choice = select_decoder(model, spec, cfg.decoder, cfg.kernel_impl, picks)
    fused_rows, sampling = sampling_choice(model.get_output_embeddings().weight, cfg.kernel_impl, cfg.max_num_seqs,
                                           cache=cfg.cache_dir)
    return ForForward(linear, calibrate.recorded(model), few_rows, paths, attention, decoder, decoder_choice,
                      fused_rows, sampling)


def gemv_choice(model, mode: str, kernel_impl: str, device: torch.device, timer_for: Callable | None = None,
                cache: str | None = None, ours: bool = True) -> tuple[dict, Choice]:
    """Which decode linears take the skinny kernel (kernels/skinny.py) instead of F.linear, at which row
    counts, and the record's gemv choice. "torch": none. "skinny": every plain linear at every row count
    up to skinny.MAX_ROWS, with the default configs (tests, A/B runs; its Triton must run here). "auto": on a
    CUDA device through Triton, timed against F.linear (engine/gemv.py; the figures kept per machine under
    `cache`, the --cache-dir, so later engines pick the same configs), or through `timer_for`, which a test
    injects; taken per shape and row count where faster by gemv.MARGIN; none elsewhere. Rows above
    skinny.MAX_ROWS (32) always take F.linear. `ours`: our decoder will run the layers (only its calls look
    the picks up; the model's own modules call F.linear). Made once at build, before any graph is captured."""
    if mode not in GEMV:
        raise ValueError(f"gemv must be one of {', '.join(GEMV)}, got {mode!r}")
    if mode == "torch":
        return {}, Choice("gemv", "torch", "as asked")
    if not ours:
        if mode == "skinny":
            raise ValueError("gemv='skinny' needs our decoder (engine/decoder.py): the model's own modules call F.linear")
        return {}, Choice("gemv", "torch", "the model's own modules run the layers: F.linear")
    linears = gemv.decode_linears(model)
    if mode == "skinny":
        try:
            choose("triton", device, "skinny_linear")
        except RuntimeError as exc:
            raise ValueError(f"gemv='skinny' cannot run here: {exc}") from None
        picks = {shape: {r: skinny.default(r) for r in skinny.ROWS} for shape in linears}
        picks.update({gated_key(shape): picks[shape] for shape in gemv.gated_downs(model) if shape in picks})
        picks.update({normed_key(shape): picks[shape] for shape in gemv.normed_linears(model) if shape in picks})
        said = f"as asked, config {skinny.DEFAULT} (above {skinny.BROADCAST_ROWS} rows {skinny.DEFAULT_DOT})"
        return picks, Choice("gemv", gemv.line(picks, len(linears)), said)
    impl = kernels.select_impl(kernel_impl, device, "skinny_linear")
    gpu = device.type == "cuda" and impl == "triton"
    if timer_for is None and not gpu:
        why = f"kernel_impl={kernel_impl!r}" if kernel_impl != "auto" else \
            f"F.linear off a GPU ({device.type})" if device.type != "cuda" else \
            choose(kernel_impl, device, "skinny_linear").why
        return {}, Choice("gemv", "torch", why, fell_back=device.type == "cuda" and kernel_impl == "auto")
    weights = weight_bytes(model)
    if timer_for is None and weights < gemv.MIN_BYTES:
        return {}, Choice("gemv", "torch", f"{weights / 2**20:.1f} MiB of weights: a step this small is bound by its "
                                           f"launches, not its reads (timed from {gemv.MIN_BYTES // 2**20} MiB)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    figures, kept = gemv.measured(linears, name, cache,
                                  timer_for or (lambda m, *args, **kw: skinny.cuda_timer(m.weight, m.bias, *args, **kw)),
                                  gated=gemv.gated_downs(model), normed=gemv.normed_linears(model),
                                  unsummed=gemv.unsummed_shapes(model))
    if gpu:
        torch.cuda.empty_cache()  # the timing's copies of the weights go back before the KV pool is sized
    picks = gemv.pick(figures)
    said = gemv.detail(picks)
    why = (f"timed against F.linear{' (kept from an earlier build)' if kept else ' at build'}, taken where "
           f"{gemv.MARGIN:.0%} faster; rows above {skinny.MAX_ROWS} take F.linear"
           + (f"; {said}" if said else f": F.linear as fast at every shape ({len(linears)})"))
    return picks, Choice("gemv", gemv.line(picks, len(linears)), why)


def sampling_choice(head: torch.Tensor, kernel_impl: str, max_num_seqs: int, cache=None,
                    timer: Callable | None = None) -> tuple[sampler.FusedRows | None, Choice]:
    """(the row counts a step samples at in kernels/sample_pack.py's Triton kernels, the record's sampling
    choice). Where both can run (a GPU with Triton under kernel_impl="auto", the default widths within the
    kernels'), each is timed at powers of two up to max_num_seqs, in a CUDA graph as the static step runs
    it, and the kernels taken where faster; the figures kept per machine (engine/kept.py: the same choice,
    so the same log-prob bits, at every later build). Why time: on an H200 (measurements.md) the kernels'
    running top-k took 0.22 ms of a batch-1 step and 0.68 ms of a batch-32 one, where torch's top-k was
    ~0.07 ms at batch 1 on an H100. `timer` (rows, side) -> seconds stands in for the GPU in tests.
    Elsewhere: None (the kernels wherever they run) and "none" off a GPU, where the CPU's compiled ops
    (kernels/cpu_ops.py) sample."""
    vocab, device = head.shape[0], head.device
    K, topk = min(sampler.SAMPLE_TOP_K, vocab), min(STATS_TOP_K, vocab)
    if timer is None and device.type != "cuda":
        return None, Choice("sampling", "none", f"tensors on {device.type}")
    impl = kernels.select_impl(kernel_impl, device, "sample_pack")
    if impl != "triton" or not sample_pack.fits(K, topk, vocab):
        why = f"kernel_impl={kernel_impl!r}" if impl != "triton" else \
            f"widths {K} and {topk} over the kernels' {sample_pack.MAX_WIDTH}"
        return None, Choice("sampling", "torch", why)
    if kernel_impl != "auto":
        return None, Choice("sampling", "triton", f"kernel_impl={kernel_impl!r}")
    rows = [r for r in (1 << i for i in range(max_num_seqs.bit_length())) if r < max_num_seqs] + [max_num_seqs]
    timer = timer or sampler.cuda_timer(vocab, device, K, topk)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    def time() -> dict:
        figures = {}
        for r in rows:
            times = figures[str(r)] = {"torch": timer(r, "torch")}
            try:
                times["triton"] = timer(r, "triton")
            except Exception:  # noqa: BLE001 - the kernels cannot compile here: torch's ops at this count
                pass
        return {str(vocab): figures}

    source = Path(sample_pack.__file__)
    key = {"device": name, "torch": torch.__version__, "triton": getattr(kernels._backend.triton, "__version__", None),
           "vocab": vocab, "widths": [K, topk], "rows": rows,
           "kernels": kept.source_digest(source, source.with_name("token_stats.py"))}  # its top-k lives there
    figures, was_kept = kept.measured("sampling", key, cache, time)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the timing's logits go back before the KV pool is sized
    per_rows = figures[str(vocab)]
    fused_rows = sampler.FusedRows(tuple((r, per_rows[str(r)].get("triton", float("inf")) < per_rows[str(r)]["torch"])
                                         for r in rows))
    said = "; ".join(f"{r}: {t['triton'] * 1e6:.0f} / {t['torch'] * 1e6:.0f} us" if "triton" in t else
                     f"{r}: the kernels did not run" for r, t in ((r, per_rows[str(r)]) for r in rows))
    return fused_rows, Choice("sampling", str(fused_rows),
                              f"timed in a CUDA graph{' (kept from an earlier build)' if was_kept else ' at build'}, "
                              f"rows: Triton / torch {said}")


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
                  else "as asked" if cascade == "off" else "auto is off: measured slower (choices._cascade_enabled)")
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


def graphs_choice(mode: str, why: str | None, num_blocks: int, found: list[str], device: torch.device,
                  max_num_seqs: int, max_blocks: int) -> tuple[graphs.Plan | None, Choice]:
    """The static decode path's plan where `mode` (EngineConfig.cuda_graphs) and the machine allow it,
    and the record's graphs choice ("on", "static (eager)" or "off", and why). `why`: a reason against
    it already known (graphs.why_off, or the graphs' memory leaving too few blocks); `found`: what the
    probe step over the provisional cache saw return to the host (graphs.graph_memory), which keeps a
    capture off. Off under "auto" on a CUDA device is a fallback; asked for ("on", "static"), an error."""
    if why is None and num_blocks < 3:
        why = f"the KV budget holds {num_blocks} blocks: none to spare for the padding rows' scratch block"
    capture = mode != "static"
    if why is None and found and capture:
        why = "the decode step returns to the host: " + "; ".join(found[:3])
    if why is not None and mode in ("on", "static"):
        raise ValueError(f"cuda_graphs={mode!r} cannot run here: {why}")
    if why is not None:
        return None, Choice("graphs", "off", why, fell_back=mode == "auto" and device.type == "cuda")
    # the padding rows write a scratch block that no sequence may own: the cache's last one
    plan = graphs.Plan(max_num_seqs, max_blocks, num_blocks - 1, capture)
    if not capture:
        return plan, Choice("graphs", "static (eager)", "cuda_graphs='static': the static path, not captured")
    return plan, Choice("graphs", "on", "decode-only steps replay graphs captured at start-up")


def overlap_choice(mode: str, plan: graphs.Plan | None) -> Choice:
    """Whether the host launches decode step N+1 before reading step N's tokens (EngineConfig.overlap,
    engine/step.py): it needs the static path (step N+1 reads its ids from step N's packed rows on the
    device; under tensor parallel the followers take them from the leader's device); "auto" takes it where
    the decode steps replay graphs, the steps whose host work it hides. "on" where it cannot run is an
    error."""
    why = None
    if plan is None:
        why = "decode steps run the dynamic path (cuda_graphs off): their ids are read on the host"
    elif mode == "auto" and not plan.capture:
        why = "the static path runs eagerly here: nothing runs while the host prepares a step"
    if mode == "off":
        return Choice("overlap", "off", "as asked")
    if why is not None and mode == "on":
        raise ValueError(f"overlap='on' cannot run here: {why}")
    if why is not None:
        return Choice("overlap", "off", why)
    return Choice("overlap", "on", "the host schedules and launches each decode step while the device runs the one before")


def pdl_choice(mode: str, device: torch.device) -> Choice:
    """Whether the Triton kernels launch with programmatic dependent launch (EngineConfig.pdl, kernels/pdl.py),
    set for the process before anything is timed or captured. Off a GPU it does not apply ("none": left out of
    the start line); "on" where it cannot run is an error; a probe that fails on a GPU meant to run it is a
    fallback, said."""
    if device.type != "cuda":  # the process's setting stays as it is (another engine may run on a GPU)
        if mode == "on":
            raise ValueError(f"pdl='on' cannot run here: tensors on {device.type}")
        return Choice("pdl", "none", f"tensors on {device.type}")
    why = pdl.why_not(device) if mode != "off" else None
    if mode == "on" and why is not None:
        raise ValueError(f"pdl='on' cannot run here: {why}")
    pdl.use(mode != "off")  # where why_not answers, launch() keeps it off all the same
    if mode == "off":
        return Choice("pdl", "off", "as asked")
    if why is not None:
        return Choice("pdl", "off", why, fell_back=why.startswith(pdl.PROBE_FAILED))
    return Choice("pdl", "on", "each Triton kernel may start while the one before it runs, and waits before it reads")


def record(model, spec: ModelSpec, cfg: EngineConfig, device: torch.device, head, group, watch: StepWatch | None,
           made: dict[str, Choice], paths: AttentionPaths) -> Execution:
    """The frozen record of every choice: those `made` on the way (linear, decoder, the attention's,
    graphs) and the ones that need nothing built (device, quantization, tensor parallel, statistics,
    threads)."""
    dtype = SHORT_DTYPES.get(spec.dtype, str(spec.dtype).removeprefix("torch."))
    note, dtype_why = describe_dtype(spec.dtype, device)  # the default dtype of this machine, or as asked
    return Execution(
        device=Choice("device", f"{device.type} {dtype}" + (f" ({note})" if note else ""), dtype_why),
        quantization=quantization_choice(model), **made,
        tp=Choice("tp", f"{group.size} ranks" if group is not None else "off",
                  "the weights are split over the group (engine/tp.py)" if group is not None
                  else "one process holds the model"),
        stats=stats_choice(cfg.kernel_impl, head), threads=threads_choice(watch), attention_paths=paths)
