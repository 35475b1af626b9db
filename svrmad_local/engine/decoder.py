"""Our own decoder forward: one layer loop for every family the engine claims (the parts that differ:
engine/families.py), over the weights the loader holds (packed where they are packed), calling the fused
ops of kernels/fused.py around the linears and the engine's paged attention.

A layer is about nine calls: residual add + RMSNorm; the q/k/v GEMM; q/k norm + RoPE + the K/V cache
write; attention over the paged cache (in place for decode rows); o_proj; add + RMSNorm; the gate/up GEMM;
act(gate) * up; down. On a GPU, where the build timed them faster, the skinny kernel folds in what precedes
its linear: each add + RMSNorm into the q/k/v and gate/up linears, act(gate) * up into down; and a split-K
o_proj's or down's partials are summed by the norm after them (six launches a layer where attention is one).
A mixture-of-experts layer routes its rows (the family's router, ported) and calls the model's experts
module, one call. DeepSeek-V3's latent attention writes the compressed KV and attends with engine/mla.py
(absorbed for decode rows, expanded through kv_b for prefill runs). Under tensor parallelism the two
all-reduces of a layer are written here, after o_proj and after the MLP (models/shard.py split the
weights by heads, columns and experts).

Exactness: the model's norm modules are swapped for `families.FastRMSNorm` when this decoder runs, so the
modules and this loop call the same norm; every other value is transformers' own operation in its order
(the same linears, the model's rotary module's cos/sin, RoPE and adds elementwise), so the two forwards
agree bit for bit (tests/test_decoder.py holds every zoo architecture to it).

Why own the forward: a batch-1 decode step of the default spent more time around its linears than in
them (~2,100 small torch ops a step, and transformers' per-layer plumbing: docs/engine.md, "Our decoder
forward"), and fused kernels, tensor-parallel layers and graphs want a forward whose calls we choose.
"""

from __future__ import annotations

import torch
from torch import nn

from svrmad_local.kernels import cpu_ops
from svrmad_local.kernels.cpu_decode import paged_decode_cpu
from svrmad_local.kernels.fused import Ops

from . import stack, tp
from .attention import StepContext, paged_attention
from .context import get_context
from .execution import Choice
from .families import (ACT_CLASSES, DENSE_MLPS, LAYERS, MOE_BLOCKS, NORMS, Dense, FastRMSNorm, Layer, Rotary, linear_call,
                       norm_in, norm_parts, rope_latent, swap_norms)
from .spec import ModelSpec

CHOICES = ("auto", "ours", "modules")
ALIASES = {"lean": "ours"}  # the forward's name before it covered every family
# devices whose steps read RoPE rows from tables filled at build (families.Rotary.prepare: a GPU step cannot grow
# one); the CPU grows its tables as positions come
ROPE_AT_BUILD = ("cuda",)


class Decoder:
    """The model body's forward for one engine step: ids [1, T], positions [1, T] -> final hidden [T, H].
    Runs inside the runner's step (its StepContext holds the slots and the cache)."""

    def __init__(self, model: nn.Module, spec: ModelSpec, ops: Ops, gemv: dict | None = None):
        body = model.base_model
        self.family = LAYERS[type(body.layers[0]).__name__]
        self.ops, self.group, self.gemv = ops, tp.group_of(model), gemv
        self.embed, self.norm = body.embed_tokens, norm_parts(body.norm)
        self.layers = [Layer(layer, self.family, spec.layers[i], gemv, sharded=self.group is not None)
                       for i, layer in enumerate(body.layers[: body.config.num_hidden_layers])]
        # the LM head through the skinny kernel where `gemv` picked its shape (the runner's logits call it), else None
        head = model.get_output_embeddings()
        self.head = linear_call(head, gemv) if gemv and type(head) is nn.Linear and tuple(head.weight.shape) in gemv \
            else None
        self.rotary = Rotary(body, self.family, {L.rope for L in self.layers})
        if ops.device.type in ROPE_AT_BUILD:
            self.rotary.prepare(spec.dtype, ops.device, getattr(body.config, "max_position_embeddings", 0) or 0)
        # decode steps as one compiled call on the CPU where every layer is a dense Llama-shaped one (engine/stack.py)
        self.stack, self.stack_note = stack.build(model, self)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ops, ctx = self.ops, get_context()
        h = self.embed(ids)  # Gemma 3's embedding scales itself
        tables = self.rotary(h, pos)
        x, res = h[0].contiguous(), None
        direct = _decode_in_place(ctx, x.shape[0])
        if direct is not None and self.stack is not None:
            out = self.stack(x, tables[None], ctx, direct)
            if out is not None:
                return out
        for L in self.layers:
            if L.latent is None:
                a, res = self.attention(L, x, res, ctx, tables[L.rope], direct)
            else:
                y, res = norm_in(ops, x, res, L.in_norm)
                a = self.latent_attention(L, y, ctx, tables[L.rope])
            if self.group is not None:
                tp.all_reduce(a, self.group)
            if L.attn_out is not None:
                a = ops.rms_norm(a, *L.attn_out)
            x, res = self.mlp(L, a, res)
            if self.group is not None:
                tp.all_reduce(x, self.group)
            if L.mlp_out is not None:
                x = ops.rms_norm(x, *L.mlp_out)
        return ops.add_rms_norm(x, res, *self.norm)[0]

    def attention(self, L: Layer, x, res, ctx: StepContext, rope, direct):
        """Per-head K/V attention: (add +) RMSNorm and q/k/v (one launch where the skinny kernel takes the norm:
        families.normed_columns), (q/k norm +) RoPE + cache write, paged attention, o_proj; and the new
        residual."""
        (q, k, v), res = L.qkv(x, res, self.ops)
        T = q.shape[0]
        q, k, v = (t.view(T, -1, L.head_dim) for t in (q, k, v))
        kc, vc = ctx.cache.k[L.index], ctx.cache.v[L.index]
        q = self.ops.rope_store(q, k, v, *rope, kc, vc, ctx.slot_mapping, L.q_norm, L.k_norm)
        if direct is not None:  # decode rows only, the compiled CPU kernel: called without the dispatch
            out = paged_decode_cpu(q, kc, vc, *direct, L.scaling, L.window, L.sinks)
        else:
            out = paged_attention(L.attn, q.transpose(0, 1).unsqueeze(0), None, None, None, scaling=L.scaling,
                                  s_aux=L.sinks)[0][0]
        return L.o_proj(out.reshape(T, -1)), res

    def latent_attention(self, L: Layer, y: torch.Tensor, ctx: StepContext, rope) -> torch.Tensor:
        """DeepSeek-V3's MLA: the query and the compressed KV (latent + shared RoPE key), their norms and
        RoPE; the latent and the key written to the cache; decode rows attend to it in place
        (engine/mla.py, absorbed), prefill runs to their context expanded through kv_b."""
        m, ops, T = L.latent, self.ops, y.shape[0]
        if m.q_a_kv_a is not None:
            q_a, kv_a = m.q_a_kv_a(y)
            q = m.q_b(ops.rms_norm(q_a, *m.q_a_norm))
        else:
            q, kv_a = m.q_proj(y), m.kv_a(y)
        q = q.view(T, -1, m.nope + m.rope)
        latent, k_rot = kv_a.split([m.rank, m.rope], dim=-1)
        latent = ops.rms_norm(latent, *m.kv_a_norm)
        q_rot = rope_latent(q[..., m.nope:], *rope, m.interleave)
        k_rot = rope_latent(k_rot.view(T, 1, m.rope), *rope, m.interleave)
        ctx.cache.k[L.index][ctx.slot_mapping] = latent.view(T, 1, m.rank).to(ctx.cache.k[L.index].dtype)
        ctx.cache.v[L.index][ctx.slot_mapping] = k_rot.to(ctx.cache.v[L.index].dtype)
        query = torch.cat((q[..., : m.nope], q_rot), dim=-1)
        heads = query.shape[1]
        if ctx.latent_slots is not None:  # the prefill runs' context (every run's, with MLA expanded)
            c, kr = ctx.cache.gather(L.index, ctx.latent_slots)  # [S, 1, rank], [S, 1, rope]
            kv = m.kv_b(c[:, 0].to(y.dtype)).view(c.shape[0], heads, m.nope + m.v_dim)
            key = torch.cat((kv[..., : m.nope], kr.to(y.dtype).expand(-1, heads, -1)), dim=-1)
            value = kv[..., m.nope:]
        else:  # decode rows only, absorbed: nothing to expand
            key, value = query.new_empty(0, heads, m.nope + m.rope), query.new_empty(0, heads, m.v_dim)
        out = paged_attention(m.module, query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0),
                              value.transpose(0, 1).unsqueeze(0), None, scaling=L.scaling)[0][0]
        return L.o_proj(out.reshape(T, -1))

    def mlp(self, L: Layer, a, res):
        """(add +) RMSNorm, then gate/up GEMM (one launch where the skinny kernel takes the norm), act(gate) * up,
        down; or, after the norm, the experts: the ported router, the model's experts module (one call),
        DeepSeek-V3's shared expert added. And the new residual."""
        if L.moe is None:
            (gate, up), res = L.dense.norm_gate_up(a, res, self.ops)
            return L.dense.act_down(gate, up, self.ops.act_mul), res
        y, res = self.ops.add_rms_norm(a, res, *L.mlp_in)
        m = L.moe
        weights, index = m.route(m.router, y)
        out = m.experts(y, index, weights)
        return (out if m.shared is None else out + self.dense(m.shared, y)), res

    def dense(self, d: Dense, y: torch.Tensor) -> torch.Tensor:
        gate, up = d.gate_up(y)
        return d.act_down(gate, up, self.ops.act_mul)


def _decode_in_place(ctx, T: int):
    """For a step of T decode rows and nothing else whose decode rows take the compiled CPU kernel
    (StepContext.decode_path, which paged_attention follows too): the kernel's block-table arguments, so
    the loop calls it itself, skipping the general dispatch (prefills, cascades, flash, other devices)."""
    if isinstance(ctx, StepContext) and ctx.decode_rows == T and ctx.decode_path("kv") == "cpu":
        return (*ctx.decode_tables.as_long(), ctx.cache.block_size)
    return None


def why_not(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why our decoder cannot run this model (None where it can): an architecture not ported, or
    something around its modules the loop would skip (hooks, sharded DTensors)."""
    body = model.base_model
    layers = getattr(body, "layers", None)
    if layers is None or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return f"{type(body).__name__} is not a decoder body (embed_tokens, layers, rotary_emb, norm)"
    names = {type(layer).__name__ for layer in layers}
    if len(names) != 1 or not names <= set(LAYERS):
        return (f"{', '.join(sorted(names - set(LAYERS)) or sorted(names))} layers, not ported "
                f"(ported: {', '.join(dict.fromkeys(LAYERS.values()))})")
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "DTensor (transformers' tensor-parallel) weights"
    sharded = tp.group_of(model) is not None
    for i, layer in enumerate(layers):
        mlp = type(layer.mlp).__name__
        if mlp not in DENSE_MLPS | MOE_BLOCKS:
            return f"layer {i}'s MLP is a {mlp}"
        dense = layer.mlp if mlp in DENSE_MLPS else getattr(layer.mlp, "shared_experts", None)
        if dense is not None:
            act = type(getattr(dense, "act_fn", None) or getattr(dense, "activation_fn", None)).__name__
            if act not in ACT_CLASSES:
                return f"activation {act} (ported: {', '.join(sorted(ACT_CLASSES))})"
        moe = set(layer.mlp.experts.modules()) if mlp in MOE_BLOCKS else set()
        for m in layer.modules():
            reduced = sharded and m in (layer.self_attn, layer.mlp) and not m._forward_pre_hooks  # written in the loop
            if m not in moe and not reduced and (hasattr(m, "_hf_hook") or m._forward_hooks or m._forward_pre_hooks):
                return f"hooks on {type(m).__name__} of layer {i} (an accelerate device map?), which the loop would skip"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "modules with hooks (an accelerate device map?)"
    if body._forward_hooks or body._forward_pre_hooks:
        return f"hooks on the model body ({type(body).__name__}), which our forward would skip"
    norms = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    if not norms <= set(NORMS) | {FastRMSNorm.__name__}:
        return f"{', '.join(sorted(norms - set(NORMS)))} norms"
    return None


def select_decoder(model: nn.Module, spec: ModelSpec, choice: str = "auto",
                   kernel_impl: str = "auto", gemv: dict | None = None) -> tuple[Decoder | None, Choice]:
    """Our decoder where it applies (swapping the model's RMSNorms for FastRMSNorm, in place), else None;
    and the record's decoder choice, saying which and why. "auto" takes ours for every ported architecture,
    over the compiled ops on the CPU (where they take the dtype) and Triton on CUDA, else the torch
    references. `gemv`: the linears' shapes and row counts that take the skinny kernel
    (engine/choices.py `gemv_choice`; the model's modules, where our decoder does not run, call F.linear)."""
    choice = ALIASES.get(choice, choice)
    if choice not in CHOICES:
        raise ValueError(f"decoder must be one of {', '.join(CHOICES)} (or 'lean', the old name of 'ours'), "
                         f"got {choice!r}")
    if choice == "modules":
        return None, Choice("decoder", "the model's modules", "as asked")
    device = model.base_model.get_input_embeddings().weight.device
    why = why_not(model, spec)
    if why is not None:
        if choice == "ours":
            raise ValueError(f"decoder='ours' cannot run this model: {why}")
        return None, Choice("decoder", "the model's modules", why, fell_back=device.type in ("cpu", "cuda"))
    ops = Ops(device, spec.dtype, kernel_impl)
    swap_norms(model, ops)
    decoder = Decoder(model, spec, ops, gemv)
    # a fallback where a faster implementation was meant to run: the compiled CPU ops for their dtypes, Triton on CUDA
    wanted = kernel_impl == "auto" and ops.impl == "torch" and (
        (device.type == "cpu" and spec.dtype in cpu_ops.DTYPES) or device.type == "cuda")
    steps = "" if decoder.stack_note is None else f"; {decoder.stack_note}"
    return decoder, Choice("decoder", "ours", f"{decoder.family}, engine/decoder.py; fused ops: {ops.describe()}{steps}",
                           fell_back=wanted and choice == "auto")
