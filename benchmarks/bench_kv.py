"""KV-cache bytes per token on the paper's architectures: what the engine keeps against naive caching.

1. The paper's models at full size, from their configs on the meta device (no weights, seconds):
   - DeepSeek-V3 (MLA): the engine caches the compressed latent (kv_lora_rank + qk_rope_head_dim per
     token per layer) against per-head K and V, which a cache that sees only the attention call keeps.
   - GPT-OSS-120B (sliding windows on half the layers): the engine keeps every layer's KV for every
     token (the blocks serve all layers, so prefix reuse stays exact at any branch point); a
     window-aware cache would keep only the last `window` tokens of the sliding layers.
2. Tiny random GPT-OSS and DeepSeek-V3 configs through the engine on a long generation: the measured
   peak KV bytes against the same two accountings.

    python benchmarks/bench_kv.py [--tokens 1024]
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from svrmad_local.engine.attention import Attachment  # noqa: E402
from svrmad_local.engine.engine import Engine, EngineConfig  # noqa: E402
from svrmad_local.engine.config import SamplingParams  # noqa: E402
from svrmad_local.engine.spec import ModelSpec, inspect_model  # noqa: E402


def paper_configs():
    from transformers import CONFIG_MAPPING as C

    return {
        "GPT-OSS-120B": C["gpt_oss"](num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                                      intermediate_size=2880, head_dim=64, num_attention_heads=64,
                                      num_key_value_heads=8, sliding_window=128),
        "DeepSeek-V3": C["deepseek_v3"](),  # the config class defaults are DeepSeek-V3's
    }


def naive_bytes_per_token(spec: ModelSpec, config) -> int:
    """Per-head K and V of every layer, as the attention call receives them."""
    size = torch.empty((), dtype=spec.dtype).element_size()
    if not spec.has_latent:
        return spec.bytes_per_token()
    heads = config.num_attention_heads
    per_layer = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return len(spec.layers) * per_layer * size


def window_aware_bytes(spec: ModelSpec, context: int) -> int:
    """Bytes one sequence of `context` tokens needs if sliding layers keep only their window."""
    return sum(s.bytes_per_token(spec.dtype) * (min(context, s.window) if s.window else context) for s in spec.layers)


def measure(name: str, config, tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    eng = Engine(model, None, EngineConfig(block_size=16, kv_cache_memory=64 * 2**20))
    prompt = list(range(3, 35))
    out = eng.generate_sync([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0]
    ctx = len(prompt) + len(out.completions[0].token_ids)
    spec = eng.spec
    return {"model": name, "context": ctx, "peak_kv_bytes": out.usage.peak_kv_bytes,
            "bytes_per_token": spec.bytes_per_token(), "naive_bytes": naive_bytes_per_token(spec, config) * ctx,
            "window_aware_bytes": window_aware_bytes(spec, ctx)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="generated tokens in the measured runs")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers import CONFIG_MAPPING as C

    result: dict = {"paper": {}, "measured": []}
    print("Paper-scale configs (bf16, from the config on the meta device, no weights):")
    for name, cfg in paper_configs().items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        spec = inspect_model(model, Attachment(model))
        ours, naive = spec.bytes_per_token(), naive_bytes_per_token(spec, cfg)
        row = {"bytes_per_token": ours, "naive_bytes_per_token": naive, "spec": spec.describe()}
        print(f"  {spec.describe()}")
        print(f"    engine: {ours:,} B/token   per-head K/V: {naive:,} B/token   ({naive / ours:.1f}x)")
        if any(s.window for s in spec.layers):
            for ctx in (4096, 16384):
                wa = window_aware_bytes(spec, ctx)
                row[f"window_aware_{ctx}"] = wa
                print(f"    one {ctx}-token sequence: engine {ours * ctx / 2**20:,.0f} MiB, window-aware "
                      f"{wa / 2**20:,.0f} MiB ({ours * ctx / wa:.2f}x more kept)")
        result["paper"][name] = row
    print(f"\nTiny random configs through the engine, one greedy generation of {args.tokens} tokens (fp32):")
    tiny = {
        "gpt-oss (window 32)": C["gpt_oss"](vocab_size=400, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                                            max_position_embeddings=4096),
        "deepseek-v3": C["deepseek_v3"](vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                        qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                                        rope_scaling=None, max_position_embeddings=4096),
    }
    for name, cfg in tiny.items():
        m = measure(name, cfg, args.tokens)
        print(f"  {name}: {m['context']} tokens, peak KV {m['peak_kv_bytes']:,} B "
              f"({m['peak_kv_bytes'] / m['context']:.0f} B/token incl. the partial last block); "
              f"per-head K/V would be {m['naive_bytes']:,} B; window-aware {m['window_aware_bytes']:,} B")
        result["measured"].append(m)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
