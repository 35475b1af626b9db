"""The attention call and the cache hook the engine plugs into any transformers decoder.

The model runs one flattened batch per step: every scheduled sequence contributes a run of new
tokens (a prefill chunk or one decode token). Two hooks of transformers carry the engine:
- `PagedKV`, passed as `cache`, receives from every layer what that layer caches
  (`Cache.update`): per-head K/V, or DeepSeek's compressed latent. It writes them into the paged
  cache and, for latent layers, hands back the whole context of every run to be expanded by the
  model's own code.
- `paged_attention`, registered through `AttentionInterface`, attends each run to its sequence's
  context, with the layer's sliding window and attention sinks (`spec.LayerSpec`).
The model's own modules do everything else (projections, RoPE from our position ids, norms, MoE),
which is why Llama, Qwen, Mistral, Gemma 3, Phi-3, GPT-OSS and DeepSeek-V3 need no code of their own.

Paths: in place through the block tables where a kernel can (decode rows: Triton on a GPU, the compiled
kernel on the CPU; per-head K/V prefill runs: Triton on a GPU); flash-attn varlen (GPU, fp16/bf16, when
installed and chosen, `choices.choose_flash`); else SDPA: decode tokens batched in one call over a padded
gather of their context, prefill chunks one call each with a bottom-right causal mask. A sliding-window layer gathers only the keys its queries can see. Sinks are applied from the
log-sum-exp after attention (`kernels.apply_sinks`). With cascade on, decode tokens that share prefix blocks
attend to the shared blocks once (kernels.cascade_attention).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from svrmad_local.kernels import apply_sinks, cascade_attention, cascade_plan, paged_decode
from svrmad_local.kernels._backend import staged
from svrmad_local.kernels.cpu_decode import paged_decode_cpu
from svrmad_local.kernels.paged_prefill import paged_prefill
from svrmad_local.models import hf

from . import mla
from .context import get_context
from .execution import AttentionPaths
from .kv_cache import BlockTables, KVCache
from .spec import LayerSpec, Probe

ATTN_NAME = "svrmad_paged"
FLASH_PAGE = 256  # flash-attn 2 reads a paged cache only in pages of a multiple of 256 tokens

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func  # type: ignore

    HAS_FLASH_ATTN = True
except Exception:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None
    HAS_FLASH_ATTN = False


class Span:
    """One sequence's new tokens in the flattened batch: rows [row0, row1) of it, which attend to
    the context `index` (slot ids of its sequence, or for latent layers positions in the expanded
    context; the new tokens last). Given a block table instead, the index is built on first use
    only: the in-place decode path never needs it, so a decode step dispatches no op per sequence."""

    __slots__ = ("row0", "row1", "_index", "_table")

    def __init__(self, row0: int, row1: int, index: torch.Tensor | None = None, table: tuple | None = None):
        self.row0, self.row1, self._index, self._table = row0, row1, index, table

    @property
    def index(self) -> torch.Tensor:  # [ctx_len]
        if self._index is None:
            self._index = staged(self.host_index(), torch.long, self._table[3])
        return self._index

    def host_index(self) -> np.ndarray:
        """The index built on the host, in numpy (no torch op a step's checks would count), from the
        block table (a run given an index: that index, read back)."""
        if self._table is None:
            return self._index.cpu().numpy()
        blocks, end, bs, _ = self._table
        return (np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)[:end]


@dataclass
class Padded:
    """Runs of one attention call, padded to one shape: query rows `q_rows` [R, Q] of the flat
    batch (padding repeats a real row), keys `index` [R, L] into the cache (or the expanded latent
    context), `mask` [R, 1, Q, L] True = attend (a padding row sees its first key only, so no row is
    empty), and `valid` [R, Q] the real query rows, whose outputs go back to `dest` (flat rows);
    `picked` are the positions of the valid rows in the flattened [R * Q] output (found once per step:
    a boolean index would wait for the GPU in every layer)."""

    q_rows: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    dest: torch.Tensor
    picked: torch.Tensor


@dataclass
class View:
    """The keys the runs of a step see under one window: the decode rows in one padded call; the
    prefill runs in one padded call when padding wastes little, else one call each
    (`prefills`: (row0, row1, index, mask [qn, L] or None for plain causal))."""

    decode: Padded | None
    prefill: Padded | None
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


def _keys(r: Span, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys run `r` can see and its mask [qn, L] (None: plain causal from position 0). Query i sits
    at position L - qn + i and sees keys p with p <= its position and p > its position - window."""
    qn, L = r.row1 - r.row0, r.index.shape[0]
    start = 0 if window is None else max(0, L - qn - window + 1)
    if start == 0 and L == qn and (window is None or window >= qn):
        return r.index, None
    pos_q = torch.arange(L - qn, L, device=r.index.device).unsqueeze(1)
    pos_k = torch.arange(start, L, device=r.index.device).unsqueeze(0)
    mask = pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    return r.index[start:], mask


def _pad(runs: list[Span], window: int | None) -> Padded:
    keys = [_keys(r, window) for r in runs]
    qmax = max(r.row1 - r.row0 for r in runs)
    lmax = max(k.shape[0] for k, _ in keys)
    dev = runs[0].index.device
    R = len(runs)
    q_rows = torch.zeros(R, qmax, dtype=torch.long, device=dev)
    index = torch.zeros(R, lmax, dtype=torch.long, device=dev)
    mask = torch.zeros(R, 1, qmax, lmax, dtype=torch.bool, device=dev)
    valid = torch.zeros(R, qmax, dtype=torch.bool, device=dev)
    for i, (r, (k, m)) in enumerate(zip(runs, keys)):
        qn, L = r.row1 - r.row0, k.shape[0]
        q_rows[i] = r.row0
        q_rows[i, :qn] = torch.arange(r.row0, r.row1, device=dev)
        index[i, :L] = k
        if m is None:
            m = torch.ones(qn, L, dtype=torch.bool, device=dev).tril(L - qn)
        mask[i, 0, :qn, :L] = m
        mask[i, 0, qn:, 0] = True
        valid[i, :qn] = True
    picked = staged([i * qmax + j for i, r in enumerate(runs) for j in range(r.row1 - r.row0)], torch.long, dev)
    return Padded(q_rows, index, mask, valid, q_rows.flatten()[picked], picked)


def _view(runs: list[Span], nd: int, window: int | None, pad_decode: bool = True, latent: bool = False) -> View:
    """Keys under `window` for every run of the step (the decode rows' only if `pad_decode`). On the
    CPU, per-head K/V prefill runs that continue a cached context are never padded together: each is
    attended as its prefix plus a causal square (`_prefix_causal`), which a padded masked call cannot do."""
    decode = _pad(runs[:nd], window) if nd and pad_decode else None
    rest = runs[nd:]
    split = window is None and not latent and any(r.index.shape[0] > r.row1 - r.row0 for r in rest) \
        and rest[0].index.device.type == "cpu"
    if len(rest) > 1 and not split:  # one call for all prefill runs, unless padding would more than double the work
        qmax = max(r.row1 - r.row0 for r in rest)
        lmax = max(r.index.shape[0] for r in rest)
        real = sum((r.row1 - r.row0) * r.index.shape[0] for r in rest)
        if len(rest) * qmax * lmax <= 2 * real:
            return View(decode, _pad(rest, window), [])
    return View(decode, None, [(r.row0, r.row1, *_keys(r, window)) for r in rest])


_IN_PLACE = View(None, None, [])  # a step whose per-head K/V rows all read the cache in place: nothing to gather


@dataclass
class StepContext:
    cache: KVCache
    specs: list[LayerSpec]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    runs: list[Span]  # decode runs first, then prefill runs, in row order
    decode_rows: int  # rows [0, decode_rows) are single-token decode runs
    paths: AttentionPaths  # how the steps attend, chosen once at build (engine/execution.py): read, not recomputed
    latent_slots: torch.Tensor | None = None  # latent layers: every run's context slots, concatenated
    latent_runs: list[Span] | None = None  # the same runs indexing into that concatenation
    decode_levels: list | None = None  # cascade: shared-prefix levels of the decode rows (kernels.Level)
    decode_pos: torch.Tensor | None = None  # cascade: each decode query's position
    flash: dict | None = None  # flash-attn: cu_q, cu_k, max_q, max_k, and block_table or slots
    decode_tables: BlockTables | None = None  # the decode rows' block tables and lengths (in-place paths)
    prefill_tables: BlockTables | None = None  # per-head K/V prefill runs read in place: their tables
    prefill_cu: list[int] | None = None  # ... and their row offsets within the prefill rows (host values)
    _views: dict = field(default_factory=dict)
    _plans: dict = field(default_factory=dict)
    _per_device: dict = field(default_factory=dict)

    def cascade_plan(self, window: int | None, q: torch.Tensor, k_paged: torch.Tensor):
        """The cascade kernel's bookkeeping for the decode rows, built once per step and window
        (the same for every layer); None where the cascade runs its torch reference (the record's choice,
        `paths.cascade`: read here, not made again)."""
        if self.paths.cascade != "triton":
            return None
        key = (window, q.shape[1], k_paged.shape[2])
        if key not in self._plans:
            self._plans[key] = cascade_plan(q, k_paged, self.decode_levels, q_pos=self.decode_pos, window=window)
        return self._plans[key]

    def decode_path(self, kind: str) -> str | None:
        """How this step's decode rows attend in a layer of `kind` ("kv" or "latent"), decided here only
        (paged_attention follows it; our decoder loop calls the CPU kernel itself where it says "cpu"):
        "flash" (flash-attn over the whole step), "cascade" (shared prefixes once), "cpu" / "triton" (the
        paged kernel through the block tables), "absorbed" (MLA from the latent cache), "padded" (SDPA
        over a gather); None where the step has no decode rows."""
        if kind == "kv" and self.flash is not None:
            return "flash"
        if not self.decode_rows:
            return None
        if kind == "kv":
            return "cascade" if self.decode_levels is not None else self.paths.decode or "padded"
        return "absorbed" if self.paths.mla_absorbed else "padded"

    def view(self, window: int | None, latent: bool = False) -> View:
        key = (window, latent)
        if key not in self._views:
            self._views[key] = _view(self.latent_runs if latent else self.runs, self.decode_rows, window,
                                     pad_decode=latent or self.paths.decode is None, latent=latent)
        return self._views[key]

    def on(self, device: torch.device) -> "StepContext":
        """The context's index tensors on `device` (layers may sit on several GPUs)."""
        if self.slot_mapping.device == device:
            return self
        if device not in self._per_device:
            mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
            runs = lambda rs: None if rs is None else [Span(r.row0, r.row1, mv(r.index)) for r in rs]  # noqa: E731
            levels = None if self.decode_levels is None else [
                lv._replace(query_idx=mv(lv.query_idx), block_table=mv(lv.block_table)) for lv in self.decode_levels]
            flash = None if self.flash is None else {k: mv(v) if torch.is_tensor(v) else v for k, v in self.flash.items()}
            self._per_device[device] = StepContext(
                self.cache, self.specs, mv(self.slot_mapping), runs(self.runs), self.decode_rows, self.paths,
                mv(self.latent_slots), runs(self.latent_runs), levels, mv(self.decode_pos), flash,
                None if self.decode_tables is None else self.decode_tables.to(device),
                None if self.prefill_tables is None else self.prefill_tables.to(device), self.prefill_cu)
        return self._per_device[device]


class PagedKV:
    """Passed to the model as `cache`: every layer hands it what it caches for the step's new
    tokens. It writes them to their slots; a latent layer gets back its whole context (every run's,
    concatenated) to expand, the way transformers' own cache returns it (`latent_slots`), or with MLA
    absorbed the new tokens, which it does not expand (engine/mla.py attends from the cache)."""

    def update(self, key, value, layer_idx, *args, **kwargs):
        ctx = get_context()
        if isinstance(ctx, Probe) or ctx is None:
            return key, value
        ctx = ctx.on(key.device)
        kc, vc = ctx.cache.k[layer_idx], ctx.cache.v[layer_idx]
        kc[ctx.slot_mapping] = key[0].transpose(0, 1).to(kc.dtype)
        vc[ctx.slot_mapping] = value[0].transpose(0, 1).to(vc.dtype)
        if ctx.specs[layer_idx].kind != "latent" or ctx.latent_slots is None:
            return key, value  # (latent, absorbed: every row reads the cache, engine/mla.py)
        k, v = ctx.cache.gather(layer_idx, ctx.latent_slots)  # [L, 1, d]
        return k.transpose(0, 1).unsqueeze(0).to(key.dtype), v.transpose(0, 1).unsqueeze(0).to(value.dtype)


# On a GPU, SDPA's cuDNN backend builds a graph for each new shape: with a context that grows every
# step, that host time dominated a decode step (docs/engine.md, "On a GPU").
# The memory-efficient kernel takes a mask and any shape, but not enable_gqa (SDPA then falls back to
# its many-op math path): the KV heads are expanded for it instead.
_GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(q, k, v, mask, scale, sinks, causal=False):
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask bool [.., Q, L] or None; sinks [H] or None.
    Returns [B, H, Q, Dv]."""
    if sinks is None:
        if not q.is_cuda:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        with sdpa_kernel(_GPU_SDPA):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=scale)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if q.device.type == "cpu":  # the CPU flash kernel returns the log-sum-exp (float mask, GQA native)
        fmask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=fmask,
                                                                             scale=scale)
    else:
        g = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
        s = (q.float() @ kk.transpose(-1, -2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)
        out = (torch.softmax(s, -1) @ vv).to(q.dtype)
    return apply_sinks(out.transpose(1, 2), lse.transpose(1, 2), sinks)[0].transpose(1, 2)


def _prefix_causal(q, k, v, prefix: int, scale, sinks=None):
    """A prefill run over `prefix` cached keys and then its own, on the CPU: the queries see every cached
    key and their own causally, so two unmasked flash calls (the second causal) merged by their
    log-sum-exps compute what one call with a [qn, L] mask does, without building that mask or
    computing the masked half of the square; sinks join the merged log-sum-exp as in `_sdpa`.
    q [1, H, qn, D], k/v [1, KVH, prefix + qn, D]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, l1 = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
    o2, l2 = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
    w = torch.sigmoid(l1 - l2).unsqueeze(-1)  # the prefix's share of each query's softmax mass
    out = (o2.float() + (o1.float() - o2.float()) * w).to(q.dtype)
    if sinks is None:
        return out
    return apply_sinks(out.transpose(1, 2), torch.logaddexp(l1, l2).transpose(1, 2), sinks)[0].transpose(1, 2)


class Attachment:
    """Switches a model's attention to `paged_attention` for the engine's own forwards only: outside
    them the model keeps its own implementation (eager for GPT-OSS, SDPA with its sliding-window
    masks...), so `model.generate` next to an engine stays correct."""

    def __init__(self, model):
        self.configs = list({id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values())
        saved = [hf.attn_implementation(c) for c in self.configs]
        model.set_attn_implementation(ATTN_NAME)  # transformers' own checks, once
        self.ours = [hf.attn_implementation(c) for c in self.configs]
        self.saved = saved
        self._set(self.saved)

    def _set(self, values) -> None:
        for c, v in zip(self.configs, values):
            hf.set_attn_implementation(c, v)

    @contextlib.contextmanager
    def __call__(self):
        self._set(self.ours)
        try:
            yield
        finally:
            self._set(self.saved)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx = get_context()
    if ctx is None:
        raise RuntimeError("svrmad's paged attention ran outside an engine step; the engine switches it on only "
                           "for its own forwards (engine.runner.attached)")
    if isinstance(ctx, Probe):
        return ctx.record(module, query, key, value, kwargs), None
    ctx = ctx.on(query.device)
    layer = module.layer_idx
    spec = ctx.specs[layer]
    sinks = kwargs.get("s_aux") if spec.sinks else None
    q = query[0].transpose(0, 1)  # [T, H, D]
    how = ctx.decode_path(spec.kind)
    if how == "flash":
        return _flash(ctx, layer, q, scaling, spec.window, sinks).unsqueeze(0), None
    if spec.kind == "latent" and ctx.paths.mla_absorbed:  # every row from the latent cache (engine/mla.py)
        out = q.new_empty(q.shape[0], q.shape[1], module.v_head_dim)
        nd, c, kr, bs = ctx.decode_rows, ctx.cache.k[layer], ctx.cache.v[layer], ctx.cache.block_size
        if nd:
            out[:nd] = mla.decode_attention(module, q[:nd], c, kr, ctx.decode_tables, bs, scaling, ctx.paths.kernel_impl)
        if q.shape[0] > nd:
            mla.prefill_attention(module, q, c, kr, ctx.runs[nd:], bs, scaling, out)
        return out.unsqueeze(0), None
    if spec.kind == "latent":  # key/value: the expanded context of every run, concatenated
        kc, vc = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [L, H, D]
        view = ctx.view(None, latent=True)
    else:
        kc, vc = ctx.cache.k[layer], ctx.cache.v[layer]
        view = _IN_PLACE if ctx.prefill_tables is not None else ctx.view(spec.window)
    out = q.new_empty(q.shape[0], q.shape[1], vc.shape[-1])
    nd = ctx.decode_rows
    if how == "cascade":  # shared prefixes attended once
        bs = ctx.cache.block_size
        paged = (kc.view(-1, bs, *kc.shape[1:]), vc.view(-1, bs, *vc.shape[1:]))
        out[:nd] = cascade_attention(q[:nd], *paged, ctx.decode_levels, scaling, q_pos=ctx.decode_pos,
                                     window=spec.window, sinks=sinks, kernel_impl=ctx.paths.kernel_impl,
                                     plan=ctx.cascade_plan(spec.window, q[:nd], paged[0]))
    elif how in ("cpu", "triton"):  # in place, through the block tables
        t = ctx.decode_tables
        if how == "cpu":
            out[:nd] = paged_decode_cpu(q[:nd], kc, vc, *t.as_long(), ctx.cache.block_size, scaling, spec.window, sinks)
        else:
            paged_decode(q[:nd], kc, vc, t.block_table, t.lens, ctx.cache.block_size, scaling, window=spec.window,
                         sinks=sinks, kernel_impl=ctx.paths.kernel_impl, out=out[:nd])  # written in place: no copy
    elif how == "padded":
        _attend_padded(ctx, q, kc, vc, layer, view.decode, spec.kind, scaling, sinks, out)
    if view is _IN_PLACE:  # prefill runs, in place through their block tables (Triton)
        t = ctx.prefill_tables
        out[nd:] = paged_prefill(q[nd:], kc, vc, t.block_table, ctx.prefill_cu, t.host_lens, ctx.cache.block_size,
                                 scaling, window=spec.window, sinks=sinks, kernel_impl=ctx.paths.kernel_impl)
    if view.prefill is not None:
        _attend_padded(ctx, q, kc, vc, layer, view.prefill, spec.kind, scaling, sinks, out)
    for row0, row1, index, mask in view.prefills:
        k, v = _gather(ctx, kc, vc, layer, index, spec.kind)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        qp = q[row0:row1].transpose(0, 1).unsqueeze(0)  # [1, H, qn, D]
        if mask is not None and spec.window is None and spec.kind == "kv" and not q.is_cuda:  # a cached prefix
            o = _prefix_causal(qp, k, v, k.shape[2] - (row1 - row0), scaling, sinks)
        else:
            o = _sdpa(qp, k, v, mask, scaling, sinks, causal=True)
        out[row0:row1] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _attend_padded(ctx: StepContext, q, kc, vc, layer: int, p: Padded, kind: str, scaling, sinks, out) -> None:
    k, v = _gather(ctx, kc, vc, layer, p.index, kind)  # [R, L, KVH, D]
    qp = q[p.q_rows].transpose(1, 2)  # [R, H, Q, D]
    o = _sdpa(qp, k.transpose(1, 2), v.transpose(1, 2), p.mask, scaling, sinks).transpose(1, 2)  # [R, Q, H, Dv]
    out[p.dest] = o.reshape(-1, *o.shape[2:])[p.picked]


def _gather(ctx: StepContext, kc, vc, layer: int, index: torch.Tensor, kind: str):
    if kind == "latent":  # already gathered and expanded by the model: index into it
        return kc[index], vc[index]
    return ctx.cache.gather(layer, index)


def _flash(ctx: StepContext, layer: int, q, scaling, window, sinks):
    """flash-attn varlen over the step: in place through the block table when the blocks are whole
    flash-attn pages, else over a gather of each run's context."""
    f = ctx.flash
    kc, vc = ctx.cache.k[layer], ctx.cache.v[layer]
    if "block_table" in f:
        bs = ctx.cache.block_size
        k, v, extra = kc.view(-1, bs, *kc.shape[1:]), vc.view(-1, bs, *vc.shape[1:]), {"block_table": f["block_table"]}
    else:
        k, v, extra = kc[f["slots"]], vc[f["slots"]], {}
    res = flash_attn_varlen_func(
        q, k, v, f["cu_q"], f["cu_k"], f["max_q"], f["max_k"], softmax_scale=scaling, causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0), return_attn_probs=sinks is not None, **extra,
    )
    if sinks is None:
        return res
    out, lse = res[0], res[1]  # lse [H, T]
    return apply_sinks(out, lse.transpose(0, 1), sinks)[0]


hf.register_attention(ATTN_NAME, paged_attention)
