"""Our decoder's decode steps on the CPU as one compiled call (kernels/cpu_stack.py) where every layer is a
dense Llama-shaped one: the loop of engine/decoder.py, the same kernels in the same order, without a
Python call per kernel. The record's decoder choice says whether it runs, and why not where it does not.

What it takes, read once from the decoder's layers (`build`): per-head K/V attention with full RoPE from
one table, PLAIN RMSNorms (Qwen3's q/k norms included), q/k/v and gate/up each one panel GEMM, o_proj and
down panel linears, SiLU, no sinks, no sandwich norms, no experts, no tensor parallelism; the compiled
fused ops, decode kernel and panel kernel all built. Llama, Mistral, Qwen2, Qwen3 and Phi-3 checkpoints
held as panels are such models. A step takes it (`Stack.__call__`) where the loop would call the decode
kernel directly (decode rows only), the caches hold the activations' dtype, cos/sin span the head and
`silu_mul` computes torch's bits at the step's size; any other step runs the loop.
"""

from __future__ import annotations

import torch

from svrmad_local.kernels import cpu_ops, cpu_stack
from svrmad_local.kernels.fused import PLAIN

from .families import gate_up_linears, gemm_module, holds_panels, qkv_linears


def panel_parts(linears: list) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """(panels, out_features, bias) where `linears` (siblings reading one input, in order) are one panel
    GEMM: a fused group's parts in order, or a single linear; else None."""
    m = gemm_module(linears)
    return (m.weight, m.out_features, m.bias) if m is not None and holds_panels(m) else None


def _why_not_layer(L) -> str | None:
    if L.latent is not None or L.moe is not None:
        return "latent attention" if L.latent is not None else "experts"
    if L.attn_out is not None or L.sinks is not None or L.rope is not None or L.dense.act != "silu":
        return "sandwich norms, sinks, per-type RoPE or an activation other than SiLU"
    if any(n is not None and n[2] != PLAIN for n in (L.in_norm, L.mlp_in, L.q_norm, L.k_norm)):
        return "norms other than plain RMSNorm"
    return None


def _linears(layer) -> dict | None:
    a, m = layer.self_attn, layer.mlp
    parts = {"qkv": panel_parts(qkv_linears(a)), "o": panel_parts([a.o_proj]),
             "gate_up": panel_parts(gate_up_linears(m)), "down": panel_parts([m.down_proj])}
    return parts if all(parts.values()) else None


class Stack:
    """The compiled stack over a decoder's layers, and the per-step conditions it runs under."""

    def __init__(self, compiled, dtype: torch.dtype, head_dim: int, inter: int):
        self.compiled, self.dtype, self.head_dim, self.inter = compiled, dtype, head_dim, inter

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx, direct) -> torch.Tensor | None:
        """The final hidden states of a decode-only step (`direct`: the decode kernel's table, lengths and
        block size), or None where this step must run the loop."""
        cos, sin = rope
        caches = ctx.cache
        if x.dtype != self.dtype or cos.shape[-1] != self.head_dim or caches.k[0].dtype != x.dtype \
                or not cpu_ops.silu_mul_fits(x.shape[0], self.inter, 2 * self.inter, x.dtype):
            return None
        return self.compiled.run(x, cos, sin, ctx.slot_mapping, *direct, caches.k, caches.v)


def build(model, decoder) -> tuple[Stack | None, str | None]:
    """The stack for `decoder` (engine/decoder.Decoder) and a phrase for the record: where it runs, or why
    not; (None, None) off the CPU."""
    if decoder.ops.device.type != "cpu":
        return None, None
    if decoder.ops.impl != "cpp":
        return None, "layer by layer (the compiled CPU ops do not run)"
    if decoder.group is not None:
        return None, "layer by layer (tensor parallel)"
    body = model.base_model
    parts = []
    for i, (layer, L) in enumerate(zip(body.layers, decoder.layers)):
        why = _why_not_layer(L) or (None if L.index == i else "layers out of order")
        linears = None if why else _linears(layer)
        if why or linears is None:
            return None, f"layer by layer (layer {i}: {why or 'linears not held as panels'})"
        parts.append((L, linears))
    why = cpu_stack.unavailable_reason()
    if why is not None:
        return None, f"layer by layer ({why})"
    w, eps, style = decoder.norm
    if style != PLAIN:
        return None, "layer by layer (a final norm other than plain RMSNorm)"
    head_dim, inter, qkv = parts[0][0].head_dim, parts[0][1]["gate_up"][1] // 2, parts[0][1]["qkv"][1]
    if any(L.head_dim != head_dim or lin["gate_up"][1] // 2 != inter or lin["qkv"][1] != qkv for L, lin in parts):
        return None, "layer by layer (layers of different widths)"
    compiled = cpu_stack.new_stack(decoder.ops.dtype, (w, eps))
    for L, lin in parts:
        q_width = L.attn.config.num_attention_heads * head_dim
        qn, kn = L.q_norm or (None, 0.0, None), L.k_norm or (None, 0.0, None)
        compiled.add_layer(*L.in_norm[:2], *L.mlp_in[:2], *lin["qkv"], *lin["o"], *lin["gate_up"], *lin["down"],
                           qn[0], qn[1], kn[0], kn[1], q_width, (lin["qkv"][1] - q_width) // 2, head_dim,
                           float(L.scaling), -1 if L.window is None else int(L.window))
    return Stack(compiled, decoder.ops.dtype, head_dim, inter), "decode steps in one compiled call"
