"""What benchmarks/gpu_check.py asks of a GPU, one mode per call; each prints one JSON object last, with
its figures and a list of `failures` (each a plain sentence naming the model and what went wrong).

    gpu_probe.py models DIR     build the model folders the check needs (no GPU needed)
    gpu_probe.py graphs DIR     every model captures every decode shape at start-up, replays, no Triton
                                kernel fell back to its reference, no blocking copy from the host, no read
                                back in paged prefill or sampling (other host syncs of a step are listed),
                                the graphs took no more memory than the KV budget kept for them
    gpu_probe.py bf16 DIR       bf16 is checked, not only timed: greedy tokens against a cache-free
                                transformers reference in the same dtype, log-probs within TOL
    gpu_probe.py flash DIR      flash-attn (where installed) against our own attention, in bf16
    gpu_probe.py run DIR        the main job, `svrmad run` with every method, on the device (random weights)

`--device cpu` runs graphs/bf16 on the CPU (static path, eager) to check this script itself.

The bf16 criterion: two references, each one forward of the model (transformers' own attention, no
cache) over the prompt and the engine's tokens: the bf16 model, and the truth, the same weights upcast
to fp32. At every generated position the engine's token must be the argmax of one of them, except at a
near tie (the best log-prob within TOL of the engine token's), and the engine's log-prob must be no
further from the truth than the bf16 reference's is, plus TOL. TOL = 0.05 nats: a bf16 logit carries
~3 significant digits, and the two paths order their sums differently (docs/gpu-check.md, "The bf16
criterion"; figures in docs/measurements.md). The truth, not the bf16 reference, is the yardstick because the
reference can be the less exact of the two: GPT-OSS's eager attention takes its softmax in bf16, 0.126
nats from fp32 on the zoo model, where our Triton kernels (fp32 softmax) stay within 0.026.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # tests/ (the zoo and quant_zoo builders)

TOL = 0.05
KV = 1 << 30
# real shapes: the embedded default (SmolLM2-135M) and Qwen3-1.7B, random weights from config.json
SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                                 rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)),
}
QUANT = ["gpt-oss-mxfp4", "deepseek-fp8"]


def build_models(root: Path) -> dict:
    """Config folders at real shapes (config.json and a tokenizer trained here) and the tiny packed
    checkpoints of tests/quant_zoo.py in their published layouts."""
    from transformers import CONFIG_MAPPING

    from tests.conftest import build_tokenizer
    from tests.quant_zoo import deepseek_config, write_deepseek, write_gpt_oss

    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer("chatml")
    made = {}
    for name, (arch, shape) in SHAPES.items():
        folder = root / name
        CONFIG_MAPPING[arch](eos_token_id=2, bos_token_id=0, pad_token_id=0, **shape).save_pretrained(folder)
        tok.save_pretrained(folder)
        made[name] = str(folder)
    q, _ = write_gpt_oss(root / "zoo")
    build_tokenizer("harmony").save_pretrained(q)
    ds_tok = build_tokenizer("deepseek_v3.1")  # its think tags are added tokens: the vocabulary must hold them
    d, _ = write_deepseek(root / "zoo", config=deepseek_config(vocab_size=len(ds_tok)))
    ds_tok.save_pretrained(d)
    for name, src in (("gpt-oss-mxfp4", q), ("deepseek-fp8", d)):
        if (root / name).exists() or (root / name).is_symlink():
            (root / name).unlink()
        (root / name).symlink_to(src)
        made[name] = str(root / name)
    return {"models": made}


def load(root: Path, name: str, device: str, dtype=torch.bfloat16):
    """(model, tokenizer) of a folder built above: random weights for the real shapes, the packed
    checkpoint (kept packed: quantization native) for the quantized ones."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from svrmad_local.models.loader import load_model, load_tokenizer

    folder = root / name
    if name in SHAPES:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
        return model.eval(), load_tokenizer(folder)
    lm = load_model(folder, dtype=dtype, device=device)
    return lm.model, lm.tokenizer


def prompts(vocab: int, n: int = 3) -> list[list[int]]:
    import random

    r = random.Random(0)
    return [[r.randrange(3, min(vocab, 400)) for _ in range(40 + 9 * i)] for i in range(n)]


def probe_graphs(root: Path, device: str, models: list[str] | None = None) -> dict:
    from svrmad_local.engine import graphs
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.engine.params import SamplingParams
    from svrmad_local.kernels import _backend

    figures, failures = {}, []
    for name in models or ["smollm2-135m", *QUANT, "qwen3-1.7b"]:
        _backend._disabled.clear()
        mode = "on" if device == "cuda" else "static"
        try:
            model, tok = load(root, name, device)
            from svrmad_local.models.quant import set_kernel_impl

            set_kernel_impl(model, "auto")
            eng = Engine(model, tok, EngineConfig(kv_cache_memory=KV, max_num_seqs=8, cuda_graphs=mode))
        except Exception as e:  # noqa: BLE001 - e.g. cuda_graphs="on" refused: the probe found a host sync
            failures.append(f"{name}: no engine with cuda_graphs={mode!r}: {type(e).__name__}: {str(e)[:300]}")
            continue
        checks = graphs.watch_steps(eng)
        vocab = eng.runner.lm_head.out_features
        eng.generate_sync(prompts(vocab), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        eng.generate_sync(prompts(vocab), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True))
        static = eng.runner.static
        syncs = sorted({s for c in checks for s in graphs.waits(c)})
        info = eng.info
        figures[name] = {"cuda_graphs": info["cuda_graphs"], "graph_bytes": info["graph_bytes"],
                         "attention": info["attention"], "shapes": len(static.shapes) if static else 0,
                         "failed_shapes": {f"{p}x{w}": why for (p, w), why in (static.failed.items() if static else [])},
                         "kernels_fell_back": dict(_backend._disabled), "host_syncs": syncs}
        if static is None:
            failures.append(f"{name}: no static decode path: {info['cuda_graphs']}")
        elif static.capture:
            if static.failed:
                (p, w), why = next(iter(static.failed.items()))
                failures.append(f"{name}: {len(static.failed)} of {len(static.shapes)} decode shapes failed to capture "
                                f"(batch {p}, width {w}: {why})")
            if static.replays == 0:
                failures.append(f"{name}: no decode step replayed a graph")
            taken, kept = info["graph_bytes"]["taken"], info["graph_bytes"]["reserved"]
            if taken > kept:
                failures.append(f"{name}: the graphs took {taken} bytes, {kept} were kept out of the KV budget")
        for kernel, why in _backend._disabled.items():
            failures.append(f"{name}: Triton kernel {kernel} failed and fell back to its reference: {why[:300]}")
        # what fails the probe: a blocking copy from the host, paged prefill or sampling reading back;
        # other syncs of prefill steps (e.g. MLA's unique over the prefill slots) are listed, not failed
        bad = [x for x in syncs if "from the host, blocking" in x or "paged_prefill.py" in x or "in sample" in x]
        if bad:
            failures.append(f"{name}: a step waits for the device: {'; '.join(bad[:3])}")
        del eng, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return {**figures, "failures": failures}


def _greedy_vs_reference(model, truth, eng, ps, new: int):
    """(positions, mismatches off near ties, max |log-prob - bf16 reference|, max |log-prob - fp32 truth|,
    max |bf16 reference - fp32 truth|, positions where the engine strays from the truth by more than the
    bf16 reference does, plus TOL) of the engine's greedy tokens against one cache-free forward of the
    model over prompt + those tokens, in its own dtype and in `truth`, an fp32 copy of the model taken
    before the engine was built over it (the engine may repack its linears for this CPU, or fuse them on a GPU)."""
    from svrmad_local.engine.params import SamplingParams

    outs = eng.generate_sync(ps, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    n = bad = strays = 0
    worst = worst32 = ref32 = 0.0
    for p, o in zip(ps, outs):
        toks, lps = o.completions[0].token_ids, o.completions[0].logprobs
        ids = torch.tensor([p + toks], device=model.device)
        rows = slice(len(p) - 1, len(p) - 1 + len(toks))
        with torch.no_grad():
            ref = torch.log_softmax(model(ids, use_cache=False).logits[0].float()[rows], -1).cpu()
            r32 = torch.log_softmax(truth(ids, use_cache=False).logits[0].float()[rows], -1).cpu()
        for i, t in enumerate(toks):
            n += 1
            if min(float(ref[i].max() - ref[i, t]), float(r32[i].max() - r32[i, t])) > TOL:
                bad += 1
            worst = max(worst, abs(lps[i] - float(ref[i, t])))
            err, ref_err = abs(lps[i] - float(r32[i, t])), abs(float(ref[i, t] - r32[i, t]))
            worst32, ref32 = max(worst32, err), max(ref32, ref_err)
            strays += err > ref_err + TOL
    return n, bad, worst, worst32, ref32, strays


def probe_bf16(root: Path, device: str, models: list[str] | None = None) -> dict:
    from svrmad_local.engine.engine import Engine, EngineConfig
    from tests.model_zoo import EXACT, make_zoo_model

    figures, failures = {"tolerance_nats": TOL}, []
    makers = [(z, lambda z=z: (make_zoo_model(z).to(device=device, dtype=torch.bfloat16), None)) for z in EXACT]
    makers.append(("smollm2-135m", lambda: load(root, "smollm2-135m", device)))
    for name, make in makers:
        if models and name not in models:
            continue
        model, tok = make()
        truth = copy.deepcopy(model).float()  # the same weights, upcast, before the engine repacks them
        eng = Engine(model, tok, EngineConfig(kv_cache_memory=KV, max_num_seqs=8))
        n, bad, worst, worst32, ref32, strays = _greedy_vs_reference(
            model, truth, eng, prompts(eng.runner.lm_head.out_features, 4), 16)
        figures[name] = {"positions": n, "off_tie_mismatches": bad, "max_logprob_diff": round(worst, 4),
                         "max_diff_vs_fp32": round(worst32, 4), "reference_diff_vs_fp32": round(ref32, 4),
                         "cuda_graphs": eng.info["cuda_graphs"], "attention": eng.info["attention"]}
        if bad:
            failures.append(f"{name}: {bad} of {n} greedy tokens differ from both references away from a near tie")
        if strays:
            failures.append(f"{name}: at {strays} of {n} positions the log-prob is further from fp32 than the bf16 "
                            f"reference's by over {TOL} (up to {worst32:.3f} against the reference's {ref32:.3f})")
        del eng, model
    return {**figures, "failures": failures}


def probe_flash(root: Path, device: str, models: list[str] | None = None) -> dict:
    from svrmad_local.engine import attention
    from svrmad_local.engine.engine import Engine, EngineConfig
    from svrmad_local.engine.choices import flash_takes_block_table
    from tests.model_zoo import make_zoo_model

    if not attention.HAS_FLASH_ATTN:
        return {"skipped": "flash-attn is not installed (pip install flash-attn: not carried, it is a large "
                           "compiled package)", "failures": []}
    import flash_attn

    figures = {"flash_attn": flash_attn.__version__, "varlen_block_table": flash_takes_block_table()}
    failures = []
    for name in models or ("llama", "gpt-oss", "mistral-sliding"):  # plain, sinks (its LSE layout), a window
        model = make_zoo_model(name).to(device=device, dtype=torch.bfloat16)
        truth = copy.deepcopy(model).float()
        for block in (16, 256):  # 256: the paged call (block_table); 16: over a gather
            try:
                eng = Engine(model, None, EngineConfig(kv_cache_memory=KV // 4, block_size=block, attention="flash"))
            except Exception as e:  # noqa: BLE001
                failures.append(f"{name}: attention='flash', block {block}: {type(e).__name__}: {e}")
                continue
            try:
                n, bad, worst, *_ = _greedy_vs_reference(model, truth, eng, prompts(400, 4), 12)
            except Exception as e:  # noqa: BLE001 - e.g. a flash-attn without block_table: the call fails
                failures.append(f"{name}: flash-attn, block {block}: {type(e).__name__}: {str(e)[:300]}")
                continue
            figures[f"{name}-block{block}"] = {"attention": eng.info["attention"], "positions": n,
                                               "off_tie_mismatches": bad, "max_logprob_diff": round(worst, 4)}
            if bad or worst > TOL:
                failures.append(f"{name}: flash-attn (block {block}) differs from the bf16 reference: {bad} tokens "
                                f"off a near tie, log-probs by up to {worst:.3f}")
            del eng
    return {**figures, "failures": failures}


def probe_run(root: Path, device: str, models: list[str] | None = None, limit: int = 2,
              methods: str = "all") -> dict:
    """The main job on the device: `svrmad run` (the CLI, in its own process) over GSM8K's bundled
    sample with every method, on the embedded default's shape with random weights written here (the
    real checkpoint is larger than a call may carry): its text is noise, so accuracy means nothing;
    what is checked is that every method finishes every question and the run folder records it."""
    import subprocess

    name = (models or ["smollm2-135m"])[0]
    folder = root / f"{name}-weights"
    if not any(folder.glob("*.safetensors")):
        model, tok = load(root, name, "cpu")
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    out = root.parent / "run"
    cmd = [sys.executable, "-m", "svrmad_local", "run", "--model", str(folder), "--device", device,
           "--dataset", "gsm8k", "--limit", str(limit), "--methods", methods, "--max-tokens", "48",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("svrmad") or "Error" in ln]  # no progress bars
    figures = {"command": " ".join(cmd[1:]), "exit": proc.returncode, "stderr_tail": "\n".join(said)[-1500:],
               "stdout_tail": proc.stdout[-2500:]}
    failures = [] if proc.returncode == 0 else [f"svrmad run exited {proc.returncode}: "
                                                f"{(proc.stderr.strip().splitlines() or [''])[-1][:300]}"]
    run = out / "run.json"
    if run.exists():
        totals = json.loads(run.read_text()).get("totals", {})
        figures["totals"] = {k: v for k, v in totals.items() if k != "engine"}
        figures["execution"] = (totals.get("engine") or {}).get("execution")
    elif not failures:
        failures.append(f"svrmad run wrote no {run}")
    return {**figures, "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["models", "graphs", "bf16", "flash", "run"])
    ap.add_argument("dir", type=Path, help="the model folders (built by the mode models)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", help="comma-separated: only these (default: all of the mode's)")
    args = ap.parse_args()
    if args.mode == "models":
        result = build_models(args.dir)
    else:
        result = {"graphs": probe_graphs, "bf16": probe_bf16, "flash": probe_flash, "run": probe_run}[args.mode](
            args.dir, args.device, args.models.split(",") if args.models else None)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
