"""Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, for the decode rows of a step.

The cache holds, per token and layer, the normalised KV latent c [kv_lora_rank] and the roped shared key
k_rot. transformers' DeepseekV3Attention expands the whole context through kv_b_proj before attention:
per head k_nope = W_UK c and v = W_UV c. Since q_nope . (W_UK c) = (q_nope W_UK) . c, a decode query can
instead be folded into latent space once (q_lat [H, kv_lora_rank]), attend to the cached latents
directly, and apply W_UV to the [H, kv_lora_rank] result: the cost is one read of the latent per step
instead of a [context, heads x 256] expansion in every layer (about 100x less work at a 16k context).

How a step uses it (EngineConfig.mla = "absorbed", the default): the runner builds the decode rows'
block table (`BlockTables`); the cache hook then returns the context of the prefill runs only (or, in a
decode-only step, just the new tokens, which the model expands for nothing); `paged_attention` computes
the decode rows here, straight from the cache (kernels.mla_decode), and the prefill runs from the
expansion as before. "expanded" keeps transformers' computation for every row (the reference).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from svrmad_local.kernels._backend import staged
from svrmad_local.kernels.mla_decode import mla_decode
from svrmad_local.models.linear import dense_weight

MODES = ("absorbed", "expanded")


@dataclass
class BlockTables:
    """Runs' view of the cache for the kernels that read it in place (decode rows; prefill runs on the
    Triton path): block ids [R, W] (padded with block 0) and context lengths [R] (the run's new tokens
    included), int32 on the step's device; `host_lens` the same lengths as host ints where the step built
    them (paged prefill lays out its tiles from them, so no layer reads the device's copy back)."""

    block_table: torch.Tensor
    lens: torch.Tensor
    host_lens: list[int] | None = None

    @classmethod
    def build(cls, tables: list[list[int]], lens: list[int], device) -> "BlockTables":
        width = max(len(t) for t in tables)
        return cls(staged([t + [0] * (width - len(t)) for t in tables], torch.int32, device),
                   staged(lens, torch.int32, device), list(lens))  # pinned: the copies never block the host

    @classmethod
    def of_runs(cls, runs, device) -> "BlockTables":
        """From a step's runs (start, end, block ids covering [0, end)): each run's table, its end as length."""
        return cls.build([b for _, _, b in runs], [e for _, e, _ in runs], device)

    def to(self, device) -> "BlockTables":
        return BlockTables(self.block_table.to(device, non_blocking=True), self.lens.to(device, non_blocking=True),
                           self.host_lens)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mla must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _version_key(linear) -> tuple:
    """What identifies the current contents of a layer's weights without reading them: the storage
    and version counter of its first tensor (a weight reloaded or changed in place gets a new key)."""
    t = getattr(linear, "weight", None)
    if not torch.is_tensor(t):
        t = next(iter(list(linear.parameters()) + list(linear.buffers())), None)
    if t is None:
        return (id(linear),)
    try:
        version = t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = None
    try:
        where = t.data_ptr()
    except RuntimeError:  # a oneDNN-packed weight (models/linear.py) has no plain storage; packing is one-way
        where = id(t)
    return (where, version, t.device, t.dtype)


_absorbed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def absorbed_weights(module, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, C], W_UV^T [H, C, v]) split from `module.kv_b_proj`, computed once per weight
    version and kept beside the module (not in its state)."""
    proj = module.kv_b_proj
    key = (_version_key(proj), heads)
    hit = _absorbed.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    nope, vd = module.qk_nope_head_dim, module.v_head_dim
    w = dense_weight(proj)
    if w.shape[0] != heads * (nope + vd):
        raise ValueError(f"layer {module.layer_idx}: kv_b_proj has {w.shape[0]} output rows, expected "
                         f"{heads} heads x ({nope} + {vd})")
    w = w.detach().view(heads, nope + vd, w.shape[1])
    pair = (w[:, :nope].contiguous(), w[:, nope:].transpose(1, 2).contiguous())
    _absorbed[module] = (key, pair)
    return pair


def decode_attention(module, q: torch.Tensor, c_cache: torch.Tensor, kr_cache: torch.Tensor, tables: BlockTables,
                     block_size: int, scaling: float, kernel_impl: str = "auto") -> torch.Tensor:
    """Attention output [nd, H, v_head_dim] of the decode queries `q` [nd, H, nope + rope] (as the
    model hands them to the attention: cat(q_nope, q_rot)) against the latent cache of their layer."""
    heads, nope = q.shape[1], module.qk_nope_head_dim
    w_uk, w_uv_t = absorbed_weights(module, heads)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    q_lat = torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)  # [nd, H, C]
    out_lat = mla_decode(q_lat, q_rot, c_cache, kr_cache, tables.block_table, tables.lens, block_size, scaling,
                         kernel_impl=kernel_impl)  # [nd, H, C] fp32
    out = torch.bmm(out_lat.transpose(0, 1).to(w_uv_t.dtype), w_uv_t).transpose(0, 1)  # [nd, H, v]
    return out.to(q.dtype)
