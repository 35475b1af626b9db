"""Decode attention of one DeepSeek-V3.1-shaped MLA layer: the absorbed form against the expanded one.

    python benchmarks/bench_mla.py [--contexts 1024,4096,16384] [--batch 1] [--heads 16 (128 on a GPU)]
        [--dtype fp32|bf16] [--device cpu|cuda] [--kernel-impl auto|torch|triton] [--repeat 5] [--json]

One layer of transformers' DeepseekV3Attention with V3.1's shapes (kv_lora_rank 512, qk_rope_head_dim
64, qk_nope_head_dim 128, v_head_dim 128; the head count is a flag: 128 as in V3.1 where it fits, 16 by
default on the CPU), `--batch` decode queries, each over its own context of N cached tokens in a paged
latent cache (16-token blocks, shuffled). Per context length, the seconds of one layer's decode
attention, best of `--repeat`:
- expanded: what the engine does with EngineConfig(mla="expanded"): gather the context's latents, expand
  them through the module's own `expand_kv` (kv_b_proj), SDPA against the new query;
- absorbed: engine.mla.decode_attention (W_UK folded into the query, attention over the cached latent,
  W_UV after; kernels.mla_decode, Triton on CUDA under "auto").
Both outputs are checked against each other before timing. Last line: one JSON object with --json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from svrmad_local.engine import mla
from svrmad_local.engine.kv_cache import BlockTables

BLOCK = 16


def make_layer(heads: int, dtype, device):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = DeepseekV3Config(hidden_size=1024, num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=512,
                           q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           rope_scaling=None)
    torch.manual_seed(0)
    layer = DeepseekV3Attention(cfg, layer_idx=0).to(device=device, dtype=dtype).eval()
    return layer


def make_case(layer, batch: int, ctx: int, dtype, device):
    """Random decode queries and a paged latent cache holding `batch` contexts of `ctx` tokens."""
    g = torch.Generator().manual_seed(ctx)
    per = -(-ctx // BLOCK)
    blocks = torch.randperm(batch * per, generator=g).view(batch, per)
    slots = batch * per * BLOCK
    c = (torch.randn(slots, 1, layer.kv_lora_rank, generator=g) / 4).to(device=device, dtype=dtype)
    kr = torch.randn(slots, 1, layer.qk_rope_head_dim, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(batch, layer.num_heads, layer.qk_head_dim, generator=g).to(device=device, dtype=dtype)
    tables = BlockTables(blocks.to(device=device, dtype=torch.int32),
                              torch.full((batch,), ctx, dtype=torch.int32, device=device))
    ctx_slots = ((blocks.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).flatten(1)[:, :ctx]).to(device)
    return q, c, kr, tables, ctx_slots


def expanded(layer, q, c, kr, ctx_slots):
    """The expanded path: gather, expand through kv_b_proj, SDPA (one call, every query's own context)."""
    kv_nope = c[ctx_slots.flatten(), 0].view(1, 1, -1, c.shape[-1])
    k_rot = kr[ctx_slots.flatten(), 0].view(1, 1, -1, kr.shape[-1])
    k, v = layer.expand_kv(kv_nope, k_rot)  # [1, H, B * L, D]
    b, L = ctx_slots.shape
    k = k.view(layer.num_heads, b, L, -1).transpose(0, 1)
    v = v.view(layer.num_heads, b, L, -1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=layer.scaling)  # [B, H, 1, Dv]
    return out[:, :, 0]


def absorbed(layer, q, c, kr, tables, kernel_impl):
    return mla.decode_attention(layer, q, c, kr, tables, BLOCK, layer.scaling, kernel_impl)


def best_of(fn, repeat: int, device) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def run(contexts, batch: int, heads: int, dtype, device, kernel_impl: str = "auto", repeat: int = 5) -> list[dict]:
    layer = make_layer(heads, dtype, device)
    rows = []
    for ctx in contexts:
        q, c, kr, tables, ctx_slots = make_case(layer, batch, ctx, dtype, device)
        ref, got = expanded(layer, q, c, kr, ctx_slots), absorbed(layer, q, c, kr, tables, kernel_impl)
        err = (got.float() - ref.float()).abs().max().item()
        t_exp = best_of(lambda: expanded(layer, q, c, kr, ctx_slots), repeat, device)
        t_abs = best_of(lambda: absorbed(layer, q, c, kr, tables, kernel_impl), repeat, device)
        rows.append({"context": ctx, "batch": batch, "heads": heads, "expanded_ms": 1e3 * t_exp,
                     "absorbed_ms": 1e3 * t_abs, "speedup": t_exp / t_abs, "max_abs_diff": err})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, help="default: 128 on a GPU, 16 on the CPU")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kernel-impl", choices=["auto", "torch", "triton"], default="auto")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    heads = a.heads or (128 if device.type == "cuda" else 16)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = run(contexts, a.batch, heads, dtype, device, a.kernel_impl, a.repeat)
    print(f"MLA decode attention, one layer, {heads} heads, batch {a.batch}, {a.dtype} on {device} "
          f"(kernel_impl={a.kernel_impl})")
    print(f"{'context':>8} {'expanded ms':>12} {'absorbed ms':>12} {'speedup':>8} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['context']:>8} {r['expanded_ms']:>12.3f} {r['absorbed_ms']:>12.3f} {r['speedup']:>7.1f}x "
              f"{r['max_abs_diff']:>11.2e}")
    if a.json:
        print(json.dumps({"device": str(device), "dtype": a.dtype, "rows": rows}))


if __name__ == "__main__":
    main()
