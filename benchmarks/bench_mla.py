"""Decode attention of one DeepSeek-V3.1-shaped MLA layer: the absorbed form against the expanded one.

    python benchmarks/bench_mla.py [--contexts 1024,4096,16384] [--batch 1] [--heads 16 (128 on a GPU)]
        [--dtype fp32|bf16] [--device cpu|cuda] [--kernel-impl auto|torch|triton] [--repeat 5] [--json]
        [--skip-expanded] [--sweep]

One layer of transformers' DeepseekV3Attention with V3.1's shapes (kv_lora_rank 512, qk_rope_head_dim
64, qk_nope_head_dim 128, v_head_dim 128; the head count is a flag: 128 as in V3.1 where it fits, 16 by
default on the CPU), `--batch` decode queries, each over its own context of N cached tokens in a paged
latent cache (16-token blocks, shuffled). Per context length, the seconds of one layer's decode
attention, best of `--repeat`:
- expanded: what the engine does with EngineConfig(mla="expanded"): gather the context's latents, expand
  them through the module's own `expand_kv` (kv_b_proj), SDPA against the new query;
- absorbed: engine.mla.decode_attention (W_UK folded into the query, attention over the cached latent,
  W_UV after; kernels.mla_decode, Triton on CUDA under "auto").
Both outputs are checked against each other before timing. Beside them, the latent's read rate: the
bytes of every query's cached latent and RoPE key over the absorbed time (GB/s), and its fraction of the
device's read bandwidth (a large tensor's sum). `--skip-expanded`: the absorbed form only (the expanded
one at 128 heads and 16k tokens needs GBs). `--sweep`: the absorbed kernel also under other heads a
program and split counts (kernels/mla_decode.py `plan`), the fastest named. Last line: one JSON object
with --json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from svrmad_local.engine import mla
from svrmad_local.engine.kv_cache import BlockTables
from svrmad_local.kernels.mla_decode import mla_decode

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


def absorbed(layer, q, c, kr, tables, kernel_impl, **kernel):
    if not kernel:
        return mla.decode_attention(layer, q, c, kr, tables, BLOCK, layer.scaling, kernel_impl)
    w_uk, w_uv_t = mla.absorbed_weights(layer, q.shape[1])  # the same steps, the kernel's tiling given
    nope = layer.qk_nope_head_dim
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)
    out = mla_decode(q_lat, q[..., nope:], c, kr, tables.block_table, tables.lens, BLOCK, layer.scaling,
                     kernel_impl=kernel_impl, **kernel)
    return torch.bmm(out.transpose(0, 1).to(w_uv_t.dtype), w_uv_t).transpose(0, 1).to(q.dtype)


def read_bandwidth(device, mib: int = 1024) -> float:
    """Bytes/s of a sum over a tensor far larger than any cache: the device's read rate."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()
    return x.numel() * 4 / best_of(lambda: x.sum(), 5, device)


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
def run(contexts, batch: int, heads: int, dtype, device, kernel_impl: str = "auto", repeat: int = 5,
        skip_expanded: bool = False, sweep: bool = False, bandwidth: float | None = None) -> list[dict]:
    layer = make_layer(heads, dtype, device)
    rows = []
    for ctx in contexts:
        q, c, kr, tables, ctx_slots = make_case(layer, batch, ctx, dtype, device)
        got = absorbed(layer, q, c, kr, tables, kernel_impl)
        row = {"context": ctx, "batch": batch, "heads": heads}
        if not skip_expanded:
            ref = expanded(layer, q, c, kr, ctx_slots)
            row["max_abs_diff"] = (got.float() - ref.float()).abs().max().item()
            row["expanded_ms"] = 1e3 * best_of(lambda: expanded(layer, q, c, kr, ctx_slots), repeat, device)
        t_abs = best_of(lambda: absorbed(layer, q, c, kr, tables, kernel_impl), repeat, device)
        row["absorbed_ms"] = 1e3 * t_abs
        if not skip_expanded:
            row["speedup"] = row["expanded_ms"] / row["absorbed_ms"]
        latent = batch * ctx * (c.shape[-1] + kr.shape[-1]) * c.element_size()  # what each query reads
        row["latent_gb_s"] = latent / t_abs / 1e9
        row["of_bandwidth"] = latent / t_abs / bandwidth if bandwidth else None
        if sweep:
            times = {}
            for block_h in (16, 32, 64):
                for splits in (None, 8, 32, 128):
                    label = f"block_h{block_h}-splits{splits or 'plan'}"
                    try:
                        times[label] = 1e3 * best_of(lambda: absorbed(layer, q, c, kr, tables, kernel_impl,
                                                                      block_h=block_h, splits=splits), repeat, device)
                    except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a finding, not a stop
                        times[label] = f"{type(e).__name__}: {str(e)[:80]}"
            ok = {k: v for k, v in times.items() if isinstance(v, float)}
            row["sweep_ms"], row["sweep_best"] = times, min(ok, key=ok.get) if ok else None
        rows.append(row)
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
    ap.add_argument("--skip-expanded", action="store_true", help="time the absorbed form only")
    ap.add_argument("--sweep", action="store_true", help="also other heads a program and split counts")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    heads = a.heads or (128 if device.type == "cuda" else 16)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    contexts = [int(x) for x in a.contexts.split(",")]
    bandwidth = read_bandwidth(device, 1024 if device.type == "cuda" else 64)
    rows = run(contexts, a.batch, heads, dtype, device, a.kernel_impl, a.repeat, a.skip_expanded, a.sweep, bandwidth)
    print(f"MLA decode attention, one layer, {heads} heads, batch {a.batch}, {a.dtype} on {device} "
          f"(kernel_impl={a.kernel_impl}); read bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'context':>8} {'expanded ms':>12} {'absorbed ms':>12} {'speedup':>8} {'max |diff|':>11} {'latent GB/s':>12}"
          f" {'of bw':>6}")
    for r in rows:
        exp = f"{r['expanded_ms']:>12.3f} {r['absorbed_ms']:>12.3f} {r['speedup']:>7.1f}x {r['max_abs_diff']:>11.2e}" \
            if "expanded_ms" in r else f"{'-':>12} {r['absorbed_ms']:>12.3f} {'-':>8} {'-':>11}"
        frac = "-" if r["of_bandwidth"] is None else f"{r['of_bandwidth']:.0%}"
        print(f"{r['context']:>8} {exp} {r['latent_gb_s']:>12.1f} {frac:>6}"
              + (f"   best tiling {r['sweep_best']}" if r.get("sweep_best") else ""))
    if a.json:
        print(json.dumps({"device": str(device), "dtype": a.dtype, "bandwidth_gb_s": bandwidth / 1e9, "rows": rows}))


if __name__ == "__main__":
    main()
