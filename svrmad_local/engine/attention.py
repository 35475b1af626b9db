"""The attention call the engine plugs into any transformers decoder, through AttentionInterface.

The model runs one flattened batch per step: every scheduled sequence contributes a run of new
tokens (a prefill chunk or one decode token), and this function, called by each layer, writes the
new K/V into the paged cache and attends each run to its own sequence's cached tokens. The model's
own modules do everything else (projections, RoPE from our position ids, norms, MLPs), which is why
Llama, Qwen2/3, Mistral... work without per-architecture code.

Paths: flash-attn varlen (GPU, fp16/bf16, when installed), else SDPA: decode tokens batched in one
call over a padded gather of their blocks, prefill chunks one call each with a causal mask offset
by the cached length. With cascade on, decode tokens that share prefix blocks (the N samples of a
question, the S debates of a receiver) attend to the shared blocks once, stacked, and to their own
suffix separately, merged exactly by log-sum-exp (kernels.cascade_attention, Triton on a GPU).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kv_cache import KVCache

ATTN_NAME = "svrmad_paged"

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func  # type: ignore

    HAS_FLASH_ATTN = True
except Exception:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None
    HAS_FLASH_ATTN = False


@dataclass
class Run:
    """One sequence's new tokens in the flattened batch: rows [row0, row1) of it, which attend to
    the slots `kv_slots` of its sequence (cached tokens first, the new ones last)."""

    row0: int
    row1: int
    kv_slots: torch.Tensor  # [ctx_len] flat slot ids


@dataclass
class StepContext:
    cache: KVCache
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: int  # rows [0, decode_rows) are single-token decode runs
    decode_slots: torch.Tensor | None  # [nd, Lmax] padded slot ids
    decode_mask: torch.Tensor | None  # [nd, 1, 1, Lmax] True = attend
    prefills: list[Run]
    decode_levels: list | None = None  # cascade: shared-prefix levels of the decode rows (kernels.Level)
    kernel_impl: str = "auto"
    use_flash: bool = False
    cu_q: torch.Tensor | None = None  # flash-attn: cumulative query/key lengths
    cu_k: torch.Tensor | None = None
    all_slots: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    _per_device: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> "StepContext":
        """The context's index tensors on `device` (layers may sit on several GPUs)."""
        if self.slot_mapping.device == device:
            return self
        if device not in self._per_device:
            mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
            levels = None if self.decode_levels is None else [
                type(lv)(mv(lv.query_idx), mv(lv.block_table), lv.kv_len) for lv in self.decode_levels]
            self._per_device[device] = StepContext(
                self.cache, mv(self.slot_mapping), self.decode_rows, mv(self.decode_slots), mv(self.decode_mask),
                [Run(r.row0, r.row1, mv(r.kv_slots)) for r in self.prefills], levels, self.kernel_impl,
                self.use_flash, mv(self.cu_q), mv(self.cu_k), mv(self.all_slots), self.max_q, self.max_k,
            )
        return self._per_device[device]


_local = threading.local()


def set_context(ctx: StepContext | None) -> None:
    _local.ctx = ctx


def get_context() -> StepContext | None:
    return getattr(_local, "ctx", None)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx = get_context()
    if ctx is None:  # the model is used outside the engine: behave like plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    ctx = ctx.on(query.device)
    layer = module.layer_idx
    kc, vc = ctx.cache.k[layer], ctx.cache.v[layer]
    q = query[0].transpose(0, 1)  # [T, H, D]
    kc[ctx.slot_mapping] = key[0].transpose(0, 1).to(kc.dtype)
    vc[ctx.slot_mapping] = value[0].transpose(0, 1).to(vc.dtype)
    if ctx.use_flash:
        out = flash_attn_varlen_func(
            q, kc[ctx.all_slots], vc[ctx.all_slots], ctx.cu_q, ctx.cu_k, ctx.max_q, ctx.max_k,
            softmax_scale=scaling, causal=True,
        )
        return out.unsqueeze(0), None
    out = torch.empty_like(q)
    gqa = q.shape[1] != kc.shape[1]
    if ctx.decode_levels is not None:  # shared prefixes attended once for all their queries
        from svrmad_local.kernels import cascade_attention

        bs = ctx.cache.block_size
        paged = (kc.view(-1, bs, *kc.shape[1:]), vc.view(-1, bs, *vc.shape[1:]))
        out[: ctx.decode_rows] = cascade_attention(q[: ctx.decode_rows], *paged, ctx.decode_levels, scaling,
                                                   impl=ctx.kernel_impl)
    elif ctx.decode_rows:
        k, v = ctx.cache.gather(layer, ctx.decode_slots)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [nd, KVH, L, D]
        qd = q[: ctx.decode_rows].unsqueeze(2)  # [nd, H, 1, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=ctx.decode_mask, scale=scaling, enable_gqa=gqa)
        out[: ctx.decode_rows] = o.squeeze(2)
    for run in ctx.prefills:
        qn = run.row1 - run.row0
        k, v = ctx.cache.gather(layer, run.kv_slots)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        qp = q[run.row0 : run.row1].transpose(0, 1).unsqueeze(0)  # [1, H, qn, D]
        L = run.kv_slots.shape[0]
        if L == qn:  # nothing cached before the run: plain causal, no mask tensor
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:  # query i sits at position L - qn + i and sees keys 0..L - qn + i (bottom-right causal)
            mask = torch.ones(qn, L, dtype=torch.bool, device=q.device).tril(diagonal=L - qn)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[run.row0 : run.row1] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention)
