"""Memory at the paper's lengths: the engine at its default KV budget over long prompts, and why it holds.

    python benchmarks/bench_memory.py --model FOLDER [--random-weights] [--dtype bf16] [--sequences 8]
        [--prompt-tokens 16384] [--new-tokens 32]

Builds the engine with its defaults (the KV pool sized from each GPU's free memory after a profiled
forward, engine/memory.py), then generates `--sequences` distinct prompts of `--prompt-tokens` tokens at
once (their prefill chunks and the decode steps after them) and reports, per device: its total memory,
what was free before the engine, the weights, the engine's KV budget and the rule that made it, what the
profiled forward took (`kv_held`) next to `svrmad plan`'s estimate of it for the same config
(models.plan.forward_bytes), the pool, and torch's peak allocated and reserved bytes over the run against
the total. Pass: no out-of-memory error, and the peak reserved plus what is held outside torch at the end
(the CUDA context, NCCL's and cuBLAS's buffers, compiled kernels) stays within the total. Last line: one
JSON object.

On a CPU it runs (the pool is then a share of the RAM) but its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from svrmad_local.engine.config import EngineConfig, SamplingParams  # noqa: E402
from svrmad_local.engine.engine import Engine  # noqa: E402
from svrmad_local.models import plan  # noqa: E402


def _config_dict(model) -> dict:
    return model.config.get_text_config().to_dict()


def measure(model, tokenizer, sequences: int, prompt_tokens: int, new_tokens: int, **engine) -> dict:
    """The engine at its defaults (plus `engine` overrides) over `sequences` prompts of `prompt_tokens`
    tokens, generating `new_tokens` each: the figures of the module doc."""
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        free0, total = torch.cuda.mem_get_info(dev)
    else:
        free0 = total = None
    eng = Engine(model, tokenizer, EngineConfig(max_num_seqs=sequences, **engine))
    info = eng.info
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    vocab = model.get_output_embeddings().out_features
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab, (sequences, prompt_tokens), generator=gen).tolist()
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=i) for i in range(sequences)]
    t0, error = time.perf_counter(), None
    try:
        outs = eng.generate_sync(prompts, params)
        done = [len(o.completions[0].token_ids) for o in outs]
    except torch.OutOfMemoryError as e:  # the failure this step is here to catch
        error, done = f"OutOfMemoryError: {str(e).splitlines()[0]}", []
    seconds = time.perf_counter() - t0
    info = eng.info  # after the run: its peak KV in use
    cfg = _config_dict(model)
    estimate = plan.forward_bytes(cfg) if cfg.get("model_type") in ("gpt_oss", "deepseek_v3", *plan.DENSE) else None
    row = {"device": str(dev), "sequences": sequences, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
           "generated": done, "seconds": round(seconds, 1), "error": error,
           "weight_bytes": info["weight_bytes"], "kv_budget_bytes": info["kv_budget_bytes"],
           "kv_budget": info["kv_budget"], "kv_devices": info["kv_devices"], "kv_held": info["kv_held"],
           "plan_forward_bytes": estimate, "kv_blocks": info["kv_blocks"], "peak_kv_bytes": info["peak_kv_bytes"],
           "graph_bytes": info["graph_bytes"], "cuda_graphs": info["cuda_graphs"]}
    if cuda:
        torch.cuda.synchronize(dev)
        free_end, _ = torch.cuda.mem_get_info(dev)
        outside = (total - free_end) - torch.cuda.memory_reserved(dev)  # the CUDA context, NCCL, cuBLAS, kernels
        row.update(total_bytes=total, free_before_bytes=free0, free_after_bytes=free_end,
                   peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved(dev), outside_torch_bytes=outside,
                   used_at_end_bytes=total - free_end)
    failures = [error] if error else []
    if not error and done != [new_tokens] * sequences:
        failures.append(f"generated {done}, expected {new_tokens} each")
    if cuda and row["peak_reserved_bytes"] + row["outside_torch_bytes"] > total:
        failures.append(f"peak reserved {row['peak_reserved_bytes']} and {row['outside_torch_bytes']} outside torch "
                        f"pass the total {total}")
    row["failures"] = failures
    eng.close()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json; weights unless --random-weights)")
    ap.add_argument("--random-weights", action="store_true", help="random weights at the config's shape")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16_384)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_engine import load_bench_model

    torch.manual_seed(0)
    lm = load_bench_model(argparse.Namespace(model=a.model, random_weights=a.random_weights, dtype=a.dtype,
                                             device=a.device))
    row = measure(lm.model, lm.tokenizer, a.sequences, a.prompt_tokens, a.new_tokens)
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    print(f"bench_memory on {row['device']}: {a.sequences} x {a.prompt_tokens} prompt tokens + {a.new_tokens} new, "
          f"{row['seconds']} s")
    print(f"  weights {gib(row['weight_bytes'])}; KV budget {gib(row['kv_budget_bytes'])} ({row['kv_budget']})")
    print(f"  profiled forward took {row['kv_held']} (plan's estimate {gib(row['plan_forward_bytes'])}); "
          f"peak KV in use {gib(row['peak_kv_bytes'])}")
    if "total_bytes" in row:
        print(f"  total {gib(row['total_bytes'])}, free before {gib(row['free_before_bytes'])}; peak allocated "
              f"{gib(row['peak_allocated_bytes'])}, peak reserved {gib(row['peak_reserved_bytes'])}, in use at the end "
              f"{gib(row['used_at_end_bytes'])}")
    print("  " + ("; ".join(row["failures"]) if row["failures"] else "no out-of-memory error"))
    print(json.dumps(row))
    return 1 if row["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
