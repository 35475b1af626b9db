"""`svrmad run`'s command line: its flags, the paper's presets, and the one `RunConfig` they make.

A flag left at None is filled from --paper-settings, then from the defaults of the dataclasses and
the methods' signatures (analysis/run_config.py), so no default is repeated here. The method options
are the group `svrmad replay` shares (analysis/options.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from svrmad_local.analysis.options import METHODS, add_method_arguments, method_options, parse_methods
from svrmad_local.analysis.run_config import RUN_MAX_TOKENS, RunConfig
from svrmad_local.engine.config import EngineConfig, SamplingParams, SettingsError
from svrmad_local.methods import accepted_params
from svrmad_local.models.reasoning import EFFORTS

# The paper's Appendix A ("LLM settings") and Section 5's S/C per model: any checkpoint may use them.
_PAPER_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "max_tokens": 16384,
                   "reasoning_effort": "medium"}
PAPER_SETTINGS: dict[str, dict[str, Any]] = {
    "gpt-oss": {**_PAPER_SAMPLING, "S": 2, "C": 2},
    "deepseek": {**_PAPER_SAMPLING, "S": 3, "C": 3},
}


# The flag that sets each engine and sampling field (how a refused setting is named on the command line).
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
         "block_size": "--block-size", "max_num_seqs": "--max-num-seqs", "kv_cache_memory": "--kv-cache-memory",
         "seed": "--seed"}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options left at None are filled from --paper-settings, then from the dataclass defaults."""
    rc, ec, sp = RunConfig(), EngineConfig(), SamplingParams()
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=rc.dataset,
                   help="gsm8k | commonsenseqa | imo-answerbench | mmlu-pro | math | hle | PATH")
    g.add_argument("--data-dir", help="folder with the full datasets (default: $SVRMAD_DATA_DIR, else bundled samples)")
    g.add_argument("--limit", type=int, default=rc.limit, help=f"number of questions (default {rc.limit}; 0 = all)")
    g.add_argument("--category", help="category filter (IMO-AnswerBench, MMLU-Pro, HLE)")
    g.add_argument("--shard", help="K/N: run every N-th question starting at K (schedulers without "
                                   "torch.distributed; join the folders with `svrmad merge`)")
    g.add_argument("--on-error", choices=["skip", "fail"], default=rc.on_error, help="malformed dataset rows")
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", help="local checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--cache-dir", help="where the embedded default is converted and the linear calibration kept "
                                       "(default $SVRMAD_CACHE, else ~/.cache/svrmad-local)")
    g.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available; under torchrun cuda:LOCAL_RANK)")
    g.add_argument("--device-map", help="accelerate device map, e.g. auto (a model larger than one GPU)")
    g.add_argument("--dtype", help="auto | fp32 | bf16 | fp16 (default auto: bf16 on a GPU and on a CPU with bf16 "
                                   "arithmetic, avx512_bf16 or AMX; fp32 on other CPUs. --dtype fp32 --linear panels "
                                   "computes the same tokens on every machine; docs/engine.md)")
    g.add_argument("--tp", type=int, default=rc.tp, help="tensor-parallel ranks (launch with torchrun)")
    g.add_argument("--quantization", choices=["auto", "native", "dequantize"], default=rc.quantization,
                   help="MXFP4 / FP8 checkpoints: keep the weights packed (native) or expand them into --dtype; "
                        "auto is native where a packed path exists (docs/quantization.md)")
    g.add_argument("--kv-cache-memory", help="KV-cache budget: bytes, a fraction (0.9) or e.g. 4GiB")
    g.add_argument("--block-size", type=int, default=ec.block_size)
    g.add_argument("--max-num-seqs", type=int, default=ec.max_num_seqs)
    g.add_argument("--cascade", choices=["auto", "on", "off"], default=ec.cascade,
                   help="decode attention over shared prefix blocks once (kernels.cascade_attention); auto is off, "
                        "as measured (docs/engine.md); exact either way")
    g.add_argument("--linear", choices=["auto", "panels", "onednn", "aten"], default=ec.linear,
                   help="how linears run on the CPU: auto takes the backend measured fastest on this machine "
                        "(a few seconds once, cached under --cache-dir; the run's own steps weigh it again; "
                        "SVRMAD_CALIBRATE=0: the panels); panels in fp32 computes the same tokens on every "
                        "machine; docs/engine.md")
    g.add_argument("--decoder", choices=["auto", "ours", "modules", "lean"], default=ec.decoder,
                   help="how layers run: ours is the engine's own forward (engine/decoder.py: fused norms, RoPE and "
                        "cache writes) for every family it claims, modules transformers' own; auto takes ours where "
                        "the family is ported; lean is the old name of ours (docs/engine.md)")
    g.add_argument("--cuda-graphs", choices=["auto", "on", "static", "off"], default=ec.cuda_graphs,
                   help="decode steps at fixed batch sizes replayed from CUDA graphs: auto takes them on a GPU "
                        "where nothing rules them out, and the run's engine info says why not (docs/engine.md)")
    g.add_argument("--overlap", choices=["auto", "on", "off"], default=ec.overlap,
                   help="schedule and launch each decode step before reading the previous one's tokens, which "
                        "it takes on the device: auto where decode steps replay CUDA graphs (docs/engine.md)")
    g.add_argument("--pdl", choices=["auto", "on", "off"], default=ec.pdl,
                   help="programmatic dependent launch: each kernel may start while the one before it runs "
                        "(sm_90 and later GPUs): auto where a probe at start-up finds it runs (docs/kernels.md)")
    g.add_argument("--gemv", choices=["auto", "skinny", "torch"], default=ec.gemv,
                   help="decode's linears of up to 32 rows: auto takes our skinny Triton kernel per shape where it "
                        "timed faster than F.linear on the GPU; torch keeps cuBLAS (docs/kernels.md)")
    g = p.add_argument_group(
        "sampling (the paper's Appendix A values, except --max-tokens: the paper uses 16,384, "
        "see --paper-settings)")
    g.add_argument("--paper-settings", choices=sorted(PAPER_SETTINGS),
                   help="the paper's settings for that model (max tokens 16384, reasoning effort medium, "
                        "S/C 2/2 for gpt-oss or 3/3 for deepseek, temperature 1.0, top-p 0.95, top-k 40); "
                        "explicit flags override it")
    g.add_argument("--max-tokens", type=int,
                   help=f"per response (default {RUN_MAX_TOKENS}: practical for the embedded 135M model on a CPU)")
    g.add_argument("--temperature", type=float, help=f"(default {sp.temperature})")
    g.add_argument("--top-p", type=float, help=f"(default {sp.top_p})")
    g.add_argument("--top-k", type=int, help=f"(default {sp.top_k})")
    g.add_argument("--seed", type=int, default=rc.seed, help="sampling and GroupDebate grouping seed")
    g.add_argument("--reasoning-effort", choices=EFFORTS,
                   help="for chat templates that take one (default: the template's own)")
    g.add_argument("--no-confidence", action="store_true", help="do not ask agents for a self-reported confidence")
    g = p.add_argument_group("methods")
    g.add_argument("--methods", default=",".join(rc.methods), help=f"comma list of {', '.join(METHODS)}; or 'all'")
    g.add_argument("--agents", type=int, default=rc.agents)
    g.add_argument("--ablations", action="store_true",
                   help="also debate every pair (N(N-1) per question) and sweep Appendix B's posterior ablations")
    add_method_arguments(p)
    g = p.add_argument_group("the run")
    g.add_argument("--out", help="run folder (default runs/<dataset>); rerun with the same folder to resume")
    g.add_argument("--concurrency", type=int, default=rc.concurrency, help="questions in flight at once (per rank)")
    g.add_argument("--run-ahead", action="store_true",
                   help="start the debates SVR-MAD may ask for next while the batch has room; results, NComm and "
                        "billed tokens are those of the sequential run, the unused ones are reported (docs/engine.md)")
    g.add_argument("--save-token-stats", action="store_true",
                   help="keep every response's per-token log-prob and entropy in RUN_DIR/token_stats/ "
                        "(one compressed .npz per debated question, about 8 bytes a token; docs/signals.md)")


def from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig of a `svrmad run` command line: explicit flags, then --paper-settings, then defaults.
    Raises ValueError for an unknown method."""
    preset = dict(PAPER_SETTINGS.get(args.paper_settings or "", {}))

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else preset.get(name, fallback)

    sp = SamplingParams()
    try:  # the engine's own checks (engine/config.py), said with the flags' names
        sampling = dataclasses.replace(sp, max_tokens=pick("max_tokens", RUN_MAX_TOKENS),
                                       temperature=pick("temperature", sp.temperature),
                                       top_p=pick("top_p", sp.top_p), top_k=pick("top_k", sp.top_k))
        engine = EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                              max_num_seqs=args.max_num_seqs, seed=args.seed, cascade=args.cascade,
                              linear=args.linear, decoder=args.decoder, cuda_graphs=args.cuda_graphs,
                              overlap=args.overlap, pdl=args.pdl, gemv=args.gemv,
                              cache_dir=args.cache_dir)
    except SettingsError as exc:
        raise ValueError(exc.line(FLAGS)) from None
    params = method_options(args)
    methods = parse_methods(args.methods)
    for k in ("S", "C"):  # the preset's S/C go to the methods that take them, explicit flags win
        if k in preset and k not in params and any(k in accepted_params(m) for m in methods):
            params[k] = preset[k]
    return RunConfig(
        dataset=args.dataset, data_dir=args.data_dir, limit=args.limit, category=args.category, shard=args.shard,
        on_error=args.on_error, model=args.model, cache_dir=args.cache_dir, device=args.device,
        device_map=args.device_map, dtype=args.dtype, tp=args.tp, quantization=args.quantization, engine=engine, sampling=sampling, seed=args.seed,
        reasoning_effort=pick("reasoning_effort", None), elicit_confidence=not args.no_confidence,
        paper_settings=args.paper_settings, methods=methods, agents=args.agents, method_params=params,
        skip_rate=args.skip_rate, grader=args.grader or "ours", ablations=args.ablations, out=args.out,
        concurrency=args.concurrency, run_ahead=args.run_ahead,
        save_token_stats=getattr(args, "save_token_stats", False))
