"""Modules that keep weights packed (MXFP4 blocks, FP8 e4m3) in memory and compute through kernels/.

They stand in for transformers' own modules with the same forward signatures: ``Mxfp4Experts`` for
GptOssExperts, ``Fp8Linear`` for an nn.Linear, ``Fp8Experts`` for DeepseekV3Experts (and other
fused experts with ``act(gate) * up``). They are not nn.Linear subclasses on purpose: their
``weight`` is not a plain matrix. Code that needs one (MLA weight absorption) calls ``dense_weight()``;
memory accounting calls ``packed_bytes()``.

Packed tensors are buffers: ``model.to(device)`` moves them, but a dtype cast (``model.to(bf16)``)
leaves them alone, since casting e4m3 codes or fp32 block scales would silently change the weights.
"""
from __future__ import annotations

import torch
from torch import nn

from svrmad_local.kernels._quant_common import run_triton, triton_fn
from svrmad_local.kernels.fp8 import dequantize_fp8, fp8_matmul
from svrmad_local.kernels.mxfp4 import dequantize_mxfp4, mxfp4_matmul


class PackedModule(nn.Module):
    """Shared by the packed modules: real bytes, and device moves that never cast packed tensors."""

    kernel_impl = "auto"

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._buffers.values(), *self._parameters.values())
                   if t is not None)

    def _apply(self, fn, recurse=True):
        packed = {k: b for k, b in self._buffers.items() if b is not None}
        for k in packed:
            self._buffers[k] = None
        super()._apply(fn, recurse)
        for k, b in packed.items():
            moved = fn(b)
            self._buffers[k] = moved if moved.dtype == b.dtype else b.to(moved.device)
        return self


def _empty(shape, dtype, device="meta"):
    return torch.empty(shape, dtype=dtype, device=device)


def _looped_experts(hidden, index, weights, num_experts: int, expert) -> torch.Tensor:
    """transformers' experts loop: for each expert some token chose (a host read), its tokens' rows through
    `expert(rows, e)`, weighted and added into the output in expert order; a padding index (outside
    [0, E)) is skipped. hidden [T, H], index and weights [T, k]."""
    out = torch.zeros_like(hidden)
    for e in torch.unique(index).tolist():
        if not 0 <= e < num_experts:
            continue
        top_k_pos, token_idx = torch.where((index == e).T)
        y = expert(hidden[token_idx], e) * weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _grouped_experts(hidden, index, weights, num_experts: int, experts) -> torch.Tensor:
    """The experts' output for every token without a host sync (CUDA-graph safe), where Triton runs:
    token-expert pairs sorted by expert on the device (a padding index, one outside [0, E), sorts last
    and gets weight 0), one grouped GEMM per projection over all experts (`experts(rows, offsets)`),
    then back to pair order and summed over each token's k choices in fp32, in slot order.
    hidden [T, H], index and weights [T, k]."""
    T, k = index.shape
    flat = index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    order = torch.argsort(key, stable=True)
    offsets = torch.searchsorted(key[order], torch.arange(num_experts + 1, device=flat.device))
    y = experts(hidden[order // k], offsets)  # rows past offsets[E] (padding pairs) are never written
    y = torch.empty_like(y).index_copy_(0, order, y)
    y = torch.where(valid[:, None], y.float() * weights.reshape(-1, 1).float(), 0.0)
    return y.view(T, k, -1).sum(1).to(hidden.dtype)


class Mxfp4Experts(PackedModule):
    """GPT-OSS experts from MXFP4 blocks: transformers' GptOssExperts forward, step for step
    (interleaved gate/up columns, gate clamped above at `limit`, up clamped to +-limit,
    gate * sigmoid(alpha * gate) * (up + 1), biases added after each matmul)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float,
                 dtype: torch.dtype, device="meta"):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, intermediate
        self.alpha, self.limit, self.dtype = alpha, limit, dtype
        e, h, i = num_experts, hidden, intermediate
        self.register_buffer("gate_up_proj_blocks", _empty((e, 2 * i, h // 32, 16), torch.uint8, device))
        self.register_buffer("gate_up_proj_scales", _empty((e, 2 * i, h // 32), torch.uint8, device))
        self.register_buffer("down_proj_blocks", _empty((e, h, i // 32, 16), torch.uint8, device))
        self.register_buffer("down_proj_scales", _empty((e, h, i // 32), torch.uint8, device))
        self.gate_up_proj_bias = nn.Parameter(_empty((e, 2 * i), dtype, device), requires_grad=False)
        self.down_proj_bias = nn.Parameter(_empty((e, h), dtype, device), requires_grad=False)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _ffn(self, x: torch.Tensor, mm) -> torch.Tensor:
        """gate/up, the clamped gate, down: `mm(rows, name)` multiplies by projection `name` plus its bias."""
        return mm(self._apply_gate(mm(x, "gate_up_proj")), "down_proj")

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        fn = triton_fn("mxfp4_grouped_matmul", self.kernel_impl, hidden_states.device)
        if fn is not None:  # a GPU: one grouped GEMM per projection, no host sync

            def experts(x, offsets):
                return self._ffn(x, lambda t, name: fn(t, offsets, getattr(self, name + "_blocks"),
                                                       getattr(self, name + "_scales"), getattr(self, name + "_bias")))

            out = run_triton("mxfp4_grouped_matmul", self.kernel_impl, _grouped_experts, hidden_states, router_indices,
                             routing_weights, self.num_experts, experts)
            if out is not None:
                return out

        def expert(x, e):  # only the experts some token routed to, as GptOssExperts does
            return self._ffn(x, lambda t, name: mxfp4_matmul(t, getattr(self, name + "_blocks")[e],
                                                             getattr(self, name + "_scales")[e],
                                                             getattr(self, name + "_bias")[e], self.kernel_impl))

        return _looped_experts(hidden_states, router_indices, routing_weights, self.num_experts, expert)

    def dense_weight(self, name: str = "gate_up_proj", expert: int | None = None, dtype=None) -> torch.Tensor:
        """Projection `name` ("gate_up_proj" | "down_proj") dequantized, [E, out, in] or one expert's [out, in]."""
        blocks, scales = getattr(self, name + "_blocks"), getattr(self, name + "_scales")
        if expert is not None:
            blocks, scales = blocks[expert], scales[expert]
        return dequantize_mxfp4(blocks, scales, dtype or self.dtype)


class Fp8Linear(PackedModule):
    """y = x @ W.T (+ b) with W in e4m3 and one scale per block; `weight` and `weight_scale_inv`
    keep the published names."""

    def __init__(self, in_features: int, out_features: int, block, bias: bool, dtype: torch.dtype,
                 scale_dtype=torch.float32, device="meta"):
        super().__init__()
        self.in_features, self.out_features, self.block, self.dtype = in_features, out_features, tuple(block), dtype
        grid = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.register_buffer("weight", _empty((out_features, in_features), torch.float8_e4m3fn, device))
        self.register_buffer("weight_scale_inv", _empty(grid, scale_dtype, device))
        self.bias = nn.Parameter(_empty((out_features,), dtype, device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_matmul(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, self.block,
                       self.bias, self.kernel_impl)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dense_weight(self, dtype=None) -> torch.Tensor:
        """W dequantized, [out, in]."""
        return dequantize_fp8(self.weight, self.weight_scale_inv, self.block, dtype or self.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={list(self.block)}, fp8 e4m3"


class Fp8Experts(PackedModule):
    """Fused experts (DeepseekV3Experts' forward: gate, up = x @ W_gate_up.T split in two halves,
    act(gate) * up, then down) from e4m3 weights. `fused=False` holds the published per-expert
    ``experts.{i}.gate_proj/up_proj/down_proj`` (each its own block grid), `fused=True` transformers'
    ``experts.gate_up_proj`` / ``down_proj`` with ``*_scale_inv``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block, act_fn, dtype: torch.dtype,
                 fused: bool, scale_dtype=torch.float32, device="meta"):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, intermediate
        self.block, self.act_fn, self.dtype, self.fused = tuple(block), act_fn, dtype, fused
        shapes = {"down_proj": (hidden, intermediate)}
        shapes.update({"gate_up_proj": (2 * intermediate, hidden)} if fused else
                      {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden)})
        for name, (o, i) in shapes.items():
            self.register_buffer(name, _empty((num_experts, o, i), torch.float8_e4m3fn, device))
            grid = (-(-o // block[0]), -(-i // block[1]))
            self.register_buffer(name + "_scale_inv", _empty((num_experts, *grid), scale_dtype, device))
        self.projections = tuple(shapes)

    def _ffn(self, x: torch.Tensor, mm) -> torch.Tensor:
        """act(gate) * up, then down: `mm(rows, name)` multiplies by projection `name`."""
        if self.fused:
            gate, up = mm(x, "gate_up_proj").chunk(2, dim=-1)
        else:
            gate, up = mm(x, "gate_proj"), mm(x, "up_proj")
        return mm(self.act_fn(gate) * up, "down_proj")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        fn = triton_fn("fp8_grouped_matmul", self.kernel_impl, hidden_states.device)
        if fn is not None:  # a GPU: one grouped GEMM per projection, no host sync

            def experts(x, offsets):
                return self._ffn(x, lambda t, name: fn(t, offsets, getattr(self, name),
                                                       getattr(self, name + "_scale_inv"), self.block))

            out = run_triton("fp8_grouped_matmul", self.kernel_impl, _grouped_experts, hidden_states, top_k_index,
                             top_k_weights, self.num_experts, experts)
            if out is not None:
                return out

        def expert(x, e):
            return self._ffn(x, lambda t, name: fp8_matmul(t, getattr(self, name)[e], getattr(self, name + "_scale_inv")[e],
                                                           self.block, None, self.kernel_impl))

        return _looped_experts(hidden_states, top_k_index, top_k_weights, self.num_experts, expert)

    def dense_weight(self, name: str = "down_proj", expert: int | None = None, dtype=None) -> torch.Tensor:
        """Projection `name` dequantized, [E, out, in] or one expert's [out, in]; "gate_up_proj" of a
        per-expert module is gate and up stacked, as transformers fuses them."""
        if name == "gate_up_proj" and not self.fused:
            return torch.cat([self.dense_weight("gate_proj", expert, dtype),
                              self.dense_weight("up_proj", expert, dtype)], dim=-2)
        w, s = getattr(self, name), getattr(self, name + "_scale_inv")
        if expert is not None:
            return dequantize_fp8(w[expert], s[expert], self.block, dtype or self.dtype)
        return torch.stack([dequantize_fp8(w[e], s[e], self.block, dtype or self.dtype) for e in range(len(w))])


def packed_modules(model: nn.Module) -> dict[str, PackedModule]:
    return {name: m for name, m in model.named_modules() if isinstance(m, PackedModule)}


def set_kernel_impl(model: nn.Module, kernel_impl: str) -> None:
    """Route every packed module's matmuls through `kernel_impl` ("auto" | "torch" | "triton")."""
    for m in packed_modules(model).values():
        m.kernel_impl = kernel_impl
