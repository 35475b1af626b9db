"""A lean forward for Llama-shaped decoders on the CPU: the same computation as transformers' modules,
without their per-call Python.

Why: with the linears at the machine's bandwidth (models/linear.py), a batch-1 decode step of the
default (30 layers) spent more time around the linears than in them: ~2,100 small torch ops and
transformers' per-layer plumbing (decorators, kwargs, config lookups; the measured split is in
docs/engine.md, "The lean decoder forward"). Here a layer is nine calls: fused residual-add + RMSNorm, the fused q/k/v GEMM, RoPE with
the K/V cache write (kernels/cpu_ops.py), the engine's attention, o_proj, add + norm, the fused
gate/up GEMM, SiLU-and-multiply, down.

Exactness: every value is what the model's own modules compute, bit for bit, once the model's
RMSNorms run our kernel (`FastRMSNorm`, swapped in when the lean forward is chosen, so a reference
that runs the same model computes the same norms): RoPE and the adds are elementwise IEEE operations
in the same order as transformers', the linears and the attention are the very same calls. A test
runs every supported architecture through both forwards and compares the logprobs bitwise.

Taken for Llama, Mistral, Qwen2 and Qwen3 decoders, fp32, on one CPU device, without hooks (an
accelerate device map) or sharded weights; anything else runs the model's modules, and the engine's
info says which and why.
"""

from __future__ import annotations

import torch
from torch import nn

from svrmad_local.kernels import cpu_linear, cpu_ops
from svrmad_local.kernels.cpu_decode import paged_decode_cpu
from svrmad_local.models.layouts import PANELS

from .attention import StepContext, paged_attention
from .context import get_context
from .execution import Choice
from .spec import ModelSpec

CHOICES = ("auto", "lean", "modules")
LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}  # weight * (x * rsqrt(mean(x^2) + eps))


class FastRMSNorm(nn.Module):
    """One of NORMS, computed by kernels/cpu_ops (one call instead of eight ops); keeps its weight
    under the same name, so the model saves and reloads as before."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon} (kernels/cpu_ops)"


def linear_call(m: nn.Module):
    """y [T, K] -> m(y): the panel kernel called directly where m holds panels (the same call its forward
    makes, without the module's and the layout's Python around it), else the module."""
    if getattr(m, "layout", None) is PANELS and getattr(m, "packed", True):
        return cpu_linear.bound(m.weight, m.out_features, m.bias)
    return m


def _columns(linears: list[nn.Module]):
    """A function y -> the outputs of `linears` (siblings reading y): one GEMM when they are the parts of
    one fused group in order (models/linear.FusedGroup), else one call each."""
    group = getattr(linears[0], "group", None)
    if group is not None and [getattr(m, "group", None) for m in linears] == [group] * len(linears) \
            and [m.i for m in linears] == list(range(len(group.bounds))):
        cuts, mm = [slice(lo, hi) for lo, hi in group.bounds], linear_call(group)
        return lambda y: [out[:, c] for out in (mm(y),) for c in cuts]
    return lambda y: [m(y) for m in linears]


def _decode_in_place(ctx, T: int) -> bool:
    """A step of T decode rows and nothing else whose decode rows take the compiled CPU kernel
    (StepContext.decode_path, which paged_attention follows too): the lean loop calls that kernel
    itself, skipping the general dispatch (prefills, cascades, flash, other devices) around it."""
    return isinstance(ctx, StepContext) and ctx.decode_rows == T and ctx.decode_path("kv") == "cpu"


class _Layer:
    __slots__ = ("attn", "layer_idx", "eps", "w_in", "w_post", "qkv", "q_norm", "k_norm", "head_dim", "scaling",
                 "o_proj", "gate_up", "down")

    def __init__(self, layer: nn.Module):
        a, m = layer.self_attn, layer.mlp
        self.attn, self.layer_idx = a, a.layer_idx
        self.eps = layer.input_layernorm.variance_epsilon
        self.w_in, self.w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.qkv = _columns([a.q_proj, a.k_proj, a.v_proj])
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.head_dim, self.scaling, self.o_proj = a.head_dim, a.scaling, linear_call(a.o_proj)
        self.gate_up, self.down = _columns([m.gate_proj, m.up_proj]), linear_call(m.down_proj)


class LeanDecoder:
    """The model body's forward for one engine step: ids [1, T], positions [1, T] -> final hidden [T, H].
    Runs inside the runner's step (its StepContext holds the slots and the cache)."""

    def __init__(self, body: nn.Module):
        self.embed, self.rotary, self.norm = body.embed_tokens, body.rotary_emb, body.norm
        self.layers = [_Layer(layer) for layer in body.layers[: body.config.num_hidden_layers]]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        k_cache, v_cache, slots = ctx.cache.k, ctx.cache.v, ctx.slot_mapping
        h = self.embed(ids)
        cos, sin = self.rotary(h, position_ids=pos)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        x, res = h[0].contiguous(), None
        T = x.shape[0]
        direct = _decode_in_place(ctx, T)
        if direct:
            (table, lens), bs = ctx.decode_tables.as_long(), ctx.cache.block_size
        for L in self.layers:
            if res is None:
                y, res = cpu_ops.rms_norm(x, L.w_in, L.eps), x
            else:
                y, res = cpu_ops.add_rms_norm(x, res, L.w_in, L.eps)
            q, k, v = (t.view(T, -1, L.head_dim) for t in L.qkv(y))
            if L.q_norm is not None:
                q, k = L.q_norm(q), L.k_norm(k)
            q = cpu_ops.rope_store(q, k, v, cos, sin, k_cache[L.layer_idx], v_cache[L.layer_idx], slots)
            if direct:
                out = paged_decode_cpu(q, k_cache[L.layer_idx], v_cache[L.layer_idx], table, lens, bs, L.scaling,
                                       ctx.specs[L.layer_idx].window)
            else:
                out = paged_attention(L.attn, q.transpose(0, 1).unsqueeze(0), None, None, None, scaling=L.scaling)[0][0]
            x = L.o_proj(out.reshape(T, -1))
            y, res = cpu_ops.add_rms_norm(x, res, L.w_post, L.eps)
            gate, up = L.gate_up(y)
            x = L.down(cpu_ops.silu_mul(gate, up))
        return cpu_ops.add_rms_norm(x, res, self.norm.weight, self.norm.variance_epsilon)[0]


def _why_not(model: nn.Module, spec: ModelSpec) -> str | None:
    body = model.base_model
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return f"{type(body).__name__} is not a Llama-shaped body"
    names = {type(layer).__name__ for layer in layers}
    if not names <= LAYERS:
        return f"{', '.join(sorted(names - LAYERS))} layers (lean: {', '.join(sorted(LAYERS))})"
    w = body.embed_tokens.weight
    if w.device.type != "cpu" or spec.dtype not in cpu_ops.DTYPES:
        return f"{spec.dtype} on {w.device.type} (lean: {', '.join(str(t)[6:] for t in cpu_ops.DTYPES)} on the CPU)"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "sharded (tensor-parallel) weights"
    if any(hasattr(m, "_hf_hook") or m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "modules with hooks (an accelerate device map?)"
    if any(s.kind != "kv" or s.sinks for s in spec.layers):
        return "latent or sink attention layers"
    for layer in layers:
        if type(layer.mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            return f"activation {type(layer.mlp.act_fn).__name__} (lean: SiLU)"
        if body.rotary_emb.inv_freq.numel() * 2 != layer.self_attn.head_dim:
            return "a partial rotary embedding"
    norms = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    if not norms <= NORMS | {"FastRMSNorm"}:
        return f"{', '.join(sorted(norms - NORMS))} norms"
    if not cpu_ops.available():
        return f"the fused CPU ops are unavailable: {cpu_ops.unavailable_reason()}"
    return None


def select_decoder(model: nn.Module, spec: ModelSpec, choice: str = "auto") -> tuple[LeanDecoder | None, Choice]:
    """The lean forward where it applies (swapping the model's RMSNorms for FastRMSNorm, in place), else
    None; and the record's decoder choice, saying which and why (a fallback where "auto" on the CPU
    could not take the lean forward)."""
    if choice not in CHOICES:
        raise ValueError(f"decoder must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "modules":
        return None, Choice("decoder", "the model's modules", "as asked")
    why = _why_not(model, spec)
    if why is not None:
        if choice == "lean":
            raise ValueError(f"decoder='lean' cannot run this model: {why}")
        device = model.base_model.get_input_embeddings().weight.device.type
        if device != "cpu":  # not a fallback: the lean forward is the CPU's, a GPU runs the modules (and graphs)
            why = f"on {device} (the lean forward is the CPU's)"
        return None, Choice("decoder", "the model's modules", why, fell_back=device == "cpu")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in NORMS:
                setattr(parent, name, FastRMSNorm(child))
    return LeanDecoder(model.base_model), Choice("decoder", "lean", "fused norms, RoPE and cache writes: engine/lean.py")
