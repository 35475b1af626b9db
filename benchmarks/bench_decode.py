"""Decode tokens/s of our engine at batch 1, 8 and 32, next to this machine's weight-streaming limit.

    python benchmarks/bench_decode.py [--model PATH [--random-weights]] [--dtype fp32|bf16] [--batches 1,8,32]
        [--prompt-tokens 32] [--new-tokens 128] [--greedy] [--engine decoder=modules,...]
        [--vllm-python PATH [--vllm-dtype D]] [--hf-compile [--hf-compile-mode M]]

Each batch size B runs twice on fresh random prompts (distinct, so no prefix reuse): once with
1 new token (prefill + first sample) and once with 1 + new_tokens; decode tokens/s is
B * new_tokens / (difference of the two wall times), the median of --repeat such pairs (3). Sampling is the paper's (temperature 1.0,
top-p 0.95, top-k 40, a seed per request) unless --greedy; lengths are fixed (ignore_eos).

The limit: a decode step reads every weight once whatever B is (the body's matrices and the LM
head; of the input embedding only B rows), plus each sequence's KV so far. The machine's read
bandwidth is measured with a large tensor sum (best of several) right before and right after each batch
size's timed pairs (a shared machine's bandwidth moves with its neighbours: a figure taken once at the
start can be minutes old), and their mean sets that row's limit:
    limit tokens/s = B * bandwidth / (weight bytes + B * KV bytes at the mean context).
Each row keeps both reads (`bandwidth_gb_s_around`); a row whose two reads differ by over 20% says so.
Beside it, what the step's matmuls alone allow: B / (seconds of every linear of the model, LM head
included, on B rows in its dtype, called as the engine's forward calls them, on its worker thread),
i.e. a step with no attention, no sampling and no overhead; on a
CPU without bf16 instructions this, not the bandwidth, bounds bf16. `host_ms_per_step`: the host's own work
in a decode step that samples inside the static step (`HostShare`; with `--engine cuda_graphs=static` on a
CPU, what `overlap` would run beside the device's step on a GPU). With --vllm-python the same prompts run through vLLM (bench_vs_vllm's worker) too.
With --hf-compile they run through the peer that needs no install (hf_peer.py): transformers' own `generate`
with its static cache and the decode forward under torch.compile, on its own copy of the same weights,
measured the same way after an untimed warm-up (its compile) at each batch size; `engine_over_hf_compile`
is the engine's tok/s over the peer's. A peer that fails says so in one line, its row's `hf_compile_error`.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from bench_engine import engine_overrides, load_bench_model
from bench_mla import best_of
from bench_vs_vllm import VLLM_DTYPES, VllmWorker, vllm_settings, vllm_unavailable
from hf_peer import HfPeer, describe, one_line
from hf_peer import measure as measure_peer
from svrmad_local.engine.engine import Engine, EngineConfig
from svrmad_local.engine.config import SamplingParams
from svrmad_local.engine.families import linear_call
from svrmad_local.models.default import ensure_default_model
from svrmad_local.models.linear import FusedGroup, PackedLinear
from svrmad_local.models.loader import load_model


def read_bandwidth(mib: int = 512, repeat: int = 7, device="cpu") -> float:
    """Bytes/s of a sum over a tensor far larger than any cache (on `device`: the model's)."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()
    return x.numel() * 4 / best_of(lambda: x.sum(), repeat, torch.device(device))


def linears_seconds(engine: Engine, rows: int, repeat: int = 5) -> float:
    """Seconds of one pass of every linear of the model (LM head included) over `rows` tokens, as a step
    runs them: each as the call the engine's forward makes (the panel kernel itself under our
    decoder, engine/families.linear_call; else the module), a fused group of siblings as one GEMM, in the
    model's order, over inputs made once; best of `repeat` whole passes, so each weight comes from memory
    as in a step, not from a cache warmed by a repeat. Timed on the engine's worker thread: timed on
    another, the two threads' OpenMP teams outnumber the cores and sleep at barriers (docs/engine.md),
    which once made this bound slower than the engine it bounds."""
    layers = [m for m in engine.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear, FusedGroup))]
    calls = [linear_call(m) if engine.runner.decoder is not None else m for m in layers]

    def timed():
        with torch.inference_mode():
            xs = [torch.randn(rows, m.in_features).to(m.weight.device, m.weight.dtype) for m in layers]
            once = lambda: [f(x) for x, f in zip(xs, calls)]  # noqa: E731
            once()
            return best_of(once, repeat, layers[0].weight.device)

    return engine.on_worker(timed)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an input embedding that
    is not also the LM head (only B of its rows are read)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if not (p is emb and emb is not head))


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


class HostOps:
    """Counts the torch ops a decode step dispatches (a TorchDispatchMode on the engine's worker thread):
    `engine` outside the model body's forward (the step's views, sampling, statistics), `model` inside
    it (transformers' modules or our decoder, and our attention). On a GPU each is a kernel launch or more of host time."""

    def __init__(self, engine: Engine):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.inside = 0
        self.steps: list[tuple[int, int, int, int]] = []  # (decode runs, all runs, engine ops, model ops)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.counts[1 if counter.inside else 0] += 1
                return func(*args, **(kwargs or {}))

        body = engine.model.base_model
        body.register_forward_pre_hook(lambda *a: setattr(self, "inside", self.inside + 1))
        body.register_forward_hook(lambda *a: setattr(self, "inside", self.inside - 1))
        decoder = engine.runner.decoder
        if decoder is not None:  # our decoder (engine/decoder.py) stands in for the body's

            def counted_decoder(ids, pos):
                self.inside += 1
                try:
                    return decoder(ids, pos)
                finally:
                    self.inside -= 1

            engine.runner.decoder = counted_decoder
        step, schedule = engine._step, engine.scheduler.schedule
        shape = []

        def counted_schedule(*args, **kwargs):  # overlap schedules with admit=False, skip=...
            batch = schedule(*args, **kwargs)
            shape[:] = [len(batch.decode), len(batch.work)]
            return batch

        def counted_step():
            self.counts = [0, 0]
            with Mode():
                out = step()
            if shape:
                self.steps.append((*shape, *self.counts))
            return out

        engine.scheduler.schedule = counted_schedule
        engine._step = counted_step

    def decode_step(self, batch: int) -> dict:
        """The ops of the last step that decoded exactly `batch` sequences and nothing else."""
        for nd, nw, eng, mod in reversed(self.steps):
            if nd == nw == batch:
                return {"batch": batch, "engine_ops": eng, "model_ops": mod}
        raise SystemExit(f"no pure decode step of batch {batch} was seen")


def host_ops(model, tokenizer, batches: list[int], block_size: int = 16, new_tokens: int = 4,
             overrides: dict | None = None) -> list[dict]:
    """engine_ops and model_ops of one decode step at each batch size (sampled at the paper's settings).
    A step replayed from a CUDA graph dispatches no model op: its model_ops read 0."""
    engine = Engine(model, tokenizer, EngineConfig(**{"block_size": block_size, "max_num_seqs": max(batches),
                                                      **(overrides or {})}))
    counter = HostOps(engine)
    vocab = model.get_output_embeddings().out_features
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        prompts = random_prompts(gen, B, 24, vocab)
        engine.generate_sync(prompts, [SamplingParams(**sampling(i, new_tokens, greedy=False)) for i in range(B)])
        rows.append(counter.decode_step(B))
    return rows


def covered(spans) -> float:
    """The length of the union of [start, end) spans: the time some kernel ran. With programmatic dependent
    launch (kernels/pdl.py) a kernel starts, and waits, while the one before it runs, so the kernels' own
    times overlap and their sum overstates the time the device was busy."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class CapturedLinears:
    """The skinny linears each decode graph launches, in launch order: while open, each CUDA graph capture
    begins a new list, and every `skinny_linear` call made during it is noted there as (rows, N, K, config,
    prologue: "silu" for a gated down projection, "norm" for a linear with the add + RMSNorm folded in, else
    ""). A graph replays exactly those launches every step, so the i-th `_skinny_kernel` of a profiled
    decode step is the i-th call its capture noted (`per_linear`)."""

    def __init__(self):
        self.captures: list[list[tuple]] = []

    def __enter__(self):
        from svrmad_local.kernels import skinny

        self._skinny, self._inner, self._begin = skinny, skinny.skinny_linear, torch.cuda.CUDAGraph.capture_begin
        inner, begin = self._inner, self._begin

        def noted(x, weight, bias=None, cfg=skinny.DEFAULT, up=None, **kw):
            if self.captures and torch.cuda.is_current_stream_capturing():
                prologue = "silu" if up is not None else "norm" if kw.get("norm") is not None else ""
                self.captures[-1].append((x.shape[0], *weight.shape, str(cfg), prologue))
            return inner(x, weight, bias, cfg, up, **kw)

        def capture_begin(graph, *args, **kwargs):
            self.captures.append([])
            return begin(graph, *args, **kwargs)

        skinny.skinny_linear, torch.cuda.CUDAGraph.capture_begin = noted, capture_begin
        return self

    def __exit__(self, *exc):
        self._skinny.skinny_linear, torch.cuda.CUDAGraph.capture_begin = self._inner, self._begin

    def sequence(self, rows: int) -> list[tuple]:
        """The (N, K, config, prologue) calls of the graph a step of `rows` rows replays: the last capture (the
        build's probe captures first, then the real runner) of the smallest row count that holds them."""
        sizes = [c[0][0] for c in self.captures if c and c[0][0] >= rows]
        if not sizes:
            return []
        last = [c for c in self.captures if c and c[0][0] == min(sizes)][-1]
        return [call[1:] for call in last]


def per_linear(durations_us: list[float], calls: list[tuple], steps: int, itemsize: int) -> list[dict]:
    """The skinny kernels' device times by linear. `durations_us`: every `_skinny_kernel` of the profiled
    window, in start order; its last `steps` x len(calls) are decode steps replaying `calls` (a prefill before
    them may launch the kernel too: left out). Per (N, K, config, prologue): launches a step, mean us a launch,
    and GB/s (the weight's bytes over that time; with PDL a kernel's time includes its wait for the one before)."""
    n = min(len(durations_us) // len(calls), steps) if calls else 0
    if not n:
        return []
    tail = durations_us[len(durations_us) - n * len(calls):]
    by: dict[tuple, list[float]] = {}
    for i, call in enumerate(calls):
        by.setdefault(call, []).extend(tail[i::len(calls)])
    rows = []
    for (n_out, k, cfg, prologue), times in by.items():
        us = statistics.fmean(times)
        rows.append({"linear": f"{n_out}x{k}{' ' + prologue if prologue else ''}", "config": cfg,
                     "launches_per_step": len(times) // n, "us_per_launch": round(us, 2),
                     "gb_s": round(n_out * k * itemsize / us / 1e3, 1)})
    return rows


def profile_decode(engine: Engine, B: int, args, vocab: int, top: int = 12,
                   captured: CapturedLinears | None = None) -> dict:
    """One generate of B fresh prompts (1 + --new-tokens tokens each) under torch.profiler, after one
    unprofiled generate of the same shape (graph captures, compiles): the wall time a step, the time
    the device was busy a step (some kernel running: `covered`) and the kernels' own times summed, and
    the ops that took the most host time and the kernels that took the most device time. The profiler
    starts on the engine's worker thread:
    it records the host ops of the thread it starts on (the device's kernels come from every thread).
    With `captured` (the engine built inside it), the skinny kernels' times by linear (`per_linear`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = next(engine.model.parameters()).device.type == "cuda"
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(**sampling(i, 1 + args.new_tokens, args.greedy)) for i in range(B)]
    engine.generate_sync(random_prompts(gen, B, args.prompt_tokens, vocab), params)
    prompts = random_prompts(gen, B, args.prompt_tokens, vocab)
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else []))
    steps0 = engine.totals.steps
    engine.on_worker(prof.start)
    t0 = time.perf_counter()
    engine.generate_sync(prompts, params)
    wall = time.perf_counter() - t0
    engine.on_worker(prof.stop)
    steps = engine.totals.steps - steps0
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    host = [e for e in events if e.device_type == DeviceType.CPU]

    def ms(us):
        return round(us / 1e3 / steps, 4)

    skinny_us = [e.time_range.end - e.time_range.start for e in sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA and e.name == "_skinny_kernel"),
        key=lambda e: e.time_range.start)]
    itemsize = next(engine.model.parameters()).element_size()
    linears = per_linear(skinny_us, captured.sequence(B), steps, itemsize) if captured is not None else []

    return {"batch": B, "steps": steps, "wall_ms_per_step": round(wall * 1e3 / steps, 3),
            "device_busy_ms_per_step": ms(covered((e.time_range.start, e.time_range.end) for e in prof.events()
                                                  if e.device_type == DeviceType.CUDA)),
            "kernel_ms_per_step": ms(sum(e.self_device_time_total for e in kernels)),
            "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1),
            "top_kernels_ms_per_step": [(e.key[:90], ms(e.self_device_time_total), round(e.count / steps, 1))
                                        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]],
            "top_host_ms_per_step": [(e.key[:90], ms(e.self_cpu_time_total), round(e.count / steps, 1))
                                     for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:top]],
            "skinny_linears": linears}


class HostShare:
    """The host's own work in the decode steps that sample inside the static step: each such `Step.run`'s
    wall time less its `runner.execute`'s (both on the engine's worker), in ms a step. Where a step is
    computed as it is called (the CPU, `--engine cuda_graphs=static`) that remainder is the scheduling, the
    step's numbers, the sampling's host part, the one read and the stop rules: the work that, on a GPU,
    `overlap` runs while the device computes the step before. Steps that sample after the forward (a
    prefill, a fork) are left out: their LM head and sampling run outside `execute`. Not on a GPU, where
    `execute` only queues the step and the remainder holds the wait for it: there, take() says None."""

    def __init__(self, engine: Engine):
        self.ms, self.steps = 0.0, 0
        stepper, runner = engine.stepper, engine.runner
        if torch.device(runner.device).type != "cpu":
            return
        run, execute = stepper.run, runner.execute
        current = {}

        def timed_execute(step, *rest):
            t = time.perf_counter()
            out = execute(step, *rest)
            current["execute"] = current.get("execute", 0.0) + time.perf_counter() - t
            current["inside"] = current.get("inside", True) and getattr(out, "packed", None) is not None
            return out

        def timed_run():
            current.clear()
            t = time.perf_counter()
            done = run()
            took = time.perf_counter() - t
            if current.get("inside"):
                self.ms += 1e3 * (took - current["execute"])
                self.steps += 1
            return done

        stepper.run, runner.execute = timed_run, timed_execute

    def take(self) -> float | None:
        """ms a step since the last take (None: no such step), and start again."""
        ms = self.ms / self.steps if self.steps else None
        self.ms, self.steps = 0.0, 0
        return ms


def random_prompts(gen: torch.Generator, count: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(100, vocab, (count, length), generator=gen).tolist()


def sampling(i: int, max_tokens: int, greedy: bool) -> dict:
    return dict(n=1, max_tokens=max_tokens, ignore_eos=True, seed=i, temperature=0.0 if greedy else 1.0,
                top_p=0.95, top_k=40)


def load(args):
    """The model of --model (default: the embedded one), or random weights at its config's shape, on
    load_model's default device (CUDA where there is one): the same weights at each call (the peer loads
    its own copy)."""
    if not args.random_weights:
        return load_model(str(args.model or ensure_default_model()), dtype=args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    return load_bench_model(argparse.Namespace(model=args.model, random_weights=True, dtype=args.dtype, device=device))


def timed_pair(generate, gen, B: int, args, vocab: int) -> tuple[float, float]:
    """(prefill-only seconds, full seconds) for B fresh prompts each; checks every output's length."""
    times = []
    for max_tokens in (1, 1 + args.new_tokens):
        prompts = random_prompts(gen, B, args.prompt_tokens, vocab)
        t0 = time.perf_counter()
        lengths = generate(prompts, [sampling(i, max_tokens, args.greedy) for i in range(B)])
        times.append(time.perf_counter() - t0)
        if lengths != [max_tokens] * B:
            raise SystemExit(f"batch {B}: got output lengths {lengths}, expected {max_tokens} each")
    return times[0], times[1]


def batch_sizes(text: str) -> list[int]:
    """An argparse type: "1,8,32" -> [1, 8, 32]; anything but positive ints is refused in argparse's one line."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes are positive integers separated by commas, got {text!r}")
    return sizes


def alternating_args(description: str, argv: list[str] | None) -> tuple[argparse.Namespace, list[int]]:
    """The flags of a benchmark that times two sides of one engine in alternating rounds of bench_decode
    pairs (bench_stack.py, bench_handoff.py), parsed; and the batch sizes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--batches", type=batch_sizes, default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    args.greedy, args.random_weights = False, False
    return args, args.batches


def lengths_of(engine: Engine):
    """generate(prompts, params) -> each output's token count, through `engine` (params: SamplingParams fields)."""
    def generate(prompts, params):
        outs = engine.generate_sync(prompts, [SamplingParams(**p) for p in params])
        return [len(o.completions[0].token_ids) for o in outs]

    return generate


def warm_up(generate, args, vocab: int) -> None:
    """One short untimed pair at batch 2 (first-call costs: kernel builds, graph captures, a worker's start),
    from prompts of its own."""
    timed_pair(generate, torch.Generator().manual_seed(1), 2, argparse.Namespace(**{**vars(args), "new_tokens": 4}),
               vocab)


def free_memory() -> None:
    """What the engine held, back to the device before another side loads its own copy of the model."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_peer(args, rows: list[dict], vocab: int, backend: str = "inductor") -> dict:
    """transformers' generate with its static cache under torch.compile (hf_peer.py) on the engine's prompts,
    its figures added to the engine's `rows`; a failure (loading, compiling, generating) is one line in the
    row it hit, the bench goes on."""
    gen = torch.Generator().manual_seed(0)  # the engine's timed prompts again
    try:
        model = load(args).model
        peer = HfPeer(model, args.prompt_tokens + 1 + args.new_tokens, mode=args.hf_compile_mode, backend=backend)
        info = describe(model.device, args.hf_compile_mode, backend)
    except Exception as e:  # noqa: BLE001 - the engine's figures stand without the peer
        for row in rows:
            row["hf_compile_error"] = one_line(e)
        return {"error": one_line(e)}
    info["sampling"] = "greedy" if args.greedy else "the engine's temperature, top-p and top-k; one seed a batch"
    info["threads"] = torch.get_num_threads()
    if model.device.type == "cuda":  # what the engine left held when the peer started
        info["cuda_allocated_gb_at_start"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    timed = lambda generate, g, B: timed_pair(generate, g, B, args, vocab)  # noqa: E731
    peer_rows = measure_peer(peer, [r["batch"] for r in rows], timed, torch.Generator().manual_seed(2), gen,
                             args.repeat, args.new_tokens)
    for row, more in zip(rows, peer_rows):
        more.pop("batch")
        row.update(more)
        if "hf_compile_tok_s" in row:
            row["engine_over_hf_compile"] = round(row["engine_tok_s"] / row["hf_compile_tok_s"], 2)
    del peer, model
    free_memory()
    return info


def print_table(rows: list[dict]) -> None:
    """The engine beside the peer and the weight-streaming limit, one line a batch size."""
    print(f"{'batch':>5}  {'engine tok/s':>12}  {'hf compile tok/s':>16}  {'engine/hf':>9}  {'limit tok/s':>11}")
    for r in rows:
        peer = (f"{r['hf_compile_tok_s']:16.1f}  {r['engine_over_hf_compile']:8.2f}x" if "hf_compile_tok_s" in r
                else f"{'failed':>16}  {'':>9}")
        print(f"{r['batch']:5d}  {r['engine_tok_s']:12.1f}  {peer}  {r['limit_bandwidth_tok_s']:11.1f}"
              + (f"   transformers generate (static cache, compiled) failed: {r['hf_compile_error']}"
                 if "hf_compile_error" in r else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batches", type=batch_sizes, default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="timed pairs per batch size (their median tok/s)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--engine", help="EngineConfig overrides for our engine, e.g. decoder=modules or linear=onednn")
    ap.add_argument("--vllm-python", help="also run vLLM (see bench_vs_vllm.py)")
    ap.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], help="default: the same as --dtype")
    ap.add_argument("--hf-compile", action="store_true",
                    help="also run transformers' generate with its static cache under torch.compile (hf_peer.py)")
    ap.add_argument("--hf-compile-mode", help="torch.compile's mode for the peer (default: reduce-overhead on CUDA, "
                                              "default elsewhere)")
    ap.add_argument("--host-ops", action="store_true",
                    help="count the torch ops one decode step dispatches at each batch size, and stop")
    ap.add_argument("--json", action="store_true", help="with --host-ops: one JSON object only")
    ap.add_argument("--profile", type=batch_sizes, default=[], metavar="B[,B...]",
                    help="profile one generate of B sequences at each B (torch.profiler: wall and device-busy ms a "
                         "step, the top host ops and kernels), and stop")
    ap.add_argument("--random-weights", action="store_true",
                    help="random weights from --model's config.json (a checkpoint's shape: timing only)")
    args = ap.parse_args()
    batches, profiled = args.batches, args.profile
    if args.host_ops:
        lm = load(args)
        rows = host_ops(lm.model, lm.tokenizer, batches, args.block_size, overrides=engine_overrides(args.engine))
        if not args.json:
            for r in rows:
                print(f"batch {r['batch']:3d}: engine_ops {r['engine_ops']:5d}   model_ops {r['model_ops']:6d}")
        print(json.dumps({"host_ops": rows}))
        return 0

    why_not = vllm_unavailable(args.vllm_python) if args.vllm_python else "no --vllm-python given"
    if why_not:
        print(f"vLLM skipped: {why_not}")
    model_path = str(args.model or ensure_default_model())
    lm = load(args)
    dtype = next(lm.model.parameters()).dtype
    vocab = lm.model.get_output_embeddings().out_features
    captured = CapturedLinears()
    with captured if profiled else contextlib.nullcontext():  # the decode graphs' skinny launches, in order
        engine = Engine(lm.model, lm.tokenizer, EngineConfig(**{"block_size": args.block_size,
                                                                "max_num_seqs": max(batches + profiled),
                                                                **engine_overrides(args.engine)}))
    print(f"engine: {engine.info['decoder']}; linear {engine.info['linear']}; {engine.info['attention']} attention; "
          f"cuda graphs {engine.info['cuda_graphs']}; overlap {engine.execution.overlap}; pdl {engine.execution.pdl}; "
          f"gemv {engine.execution.gemv.value}")

    engine_generate = lengths_of(engine)

    device = lm.model.get_input_embeddings().weight.device
    bw = read_bandwidth(device=device)
    w_bytes = weight_bytes_per_step(lm.model)
    kv_tok = kv_bytes_per_token(lm.model.config, dtype)
    mean_ctx = args.prompt_tokens + args.new_tokens / 2
    print(f"machine: read bandwidth {bw / 1e9:.1f} GB/s; model: {w_bytes / 1e6:.0f} MB of {str(dtype)[6:]} weights "
          f"read per step, {kv_tok} KV bytes per token")

    if profiled:
        profiles = []
        for B in profiled:
            prof = profile_decode(engine, B, args, vocab, captured=captured)
            profiles.append(prof)
            print(f"batch {prof['batch']}: {prof['wall_ms_per_step']} ms a step, the device busy "
                  f"{prof['device_busy_ms_per_step']} ms of it ({prof['kernels_per_step']} kernels a step, their own "
                  f"times {prof['kernel_ms_per_step']} ms)")
            for title, key in (("host ops (self time)", "top_host_ms_per_step"),
                               ("kernels", "top_kernels_ms_per_step")):
                print(f"  {title}, ms a step and calls a step:")
                for name, t, calls in prof[key]:
                    print(f"    {t:8.4f}  {calls:7.1f}  {name}")
            if prof["skinny_linears"]:
                print("  skinny linears in the decode graph, by linear: launches a step, us a launch, GB/s, config:")
                for row in prof["skinny_linears"]:
                    print(f"    {row['launches_per_step']:4d}  {row['us_per_launch']:8.2f}  {row['gb_s']:8.1f}  "
                          f"{row['linear']} {row['config']}")
        print(json.dumps({"profiles": profiles, "engine": args.engine, "dtype": args.dtype}))
        return 0
    gen = torch.Generator().manual_seed(0)  # the timed prompts: the same for every side
    warm_up(engine_generate, args, vocab)
    host = HostShare(engine)
    rows = []
    for B in batches:
        steps0, overlapped0 = engine.totals.steps, engine.totals.overlapped_steps
        host.take()
        bw_before = read_bandwidth(device=device)
        pairs = [timed_pair(engine_generate, gen, B, args, vocab) for _ in range(args.repeat)]
        host_ms = host.take()
        bw_after = read_bandwidth(device=device)
        bw_row = (bw_before + bw_after) / 2
        tps = statistics.median(B * args.new_tokens / (t_full - t_pre) for t_pre, t_full in pairs)
        t_pre = statistics.median(t for t, _ in pairs)
        limit = B * bw_row / (w_bytes + B * mean_ctx * kv_tok)
        gemm = B / linears_seconds(engine, B)
        row = {"batch": B, "engine_tok_s": round(tps, 1), "engine_steps": (engine.totals.steps - steps0) // args.repeat,
               # steps launched before the previous one's tokens were read (EngineConfig.overlap)
               "overlapped_steps": (engine.totals.overlapped_steps - overlapped0) // args.repeat,
               "limit_bandwidth_tok_s": round(limit, 1), "fraction_of_limit": round(tps / limit, 3),
               "bandwidth_gb_s_around": [round(bw_before / 1e9, 2), round(bw_after / 1e9, 2)],
               "linears_only_tok_s": round(gemm, 1), "fraction_of_linears_only": round(tps / gemm, 3),
               "prefill_s": round(t_pre, 3), "threads": (engine.info["threads"] or {}).get("now"),
               # the host's own ms a decode step that samples inside the static step (HostShare)
               "host_ms_per_step": None if host_ms is None else round(host_ms, 3)}
        rows.append(row)
        print(f"batch {B:3d}: engine {tps:7.1f} tok/s   weight-streaming limit {limit:7.1f} tok/s ({tps / limit:.0%} of it)"
              f"   the step's matmuls alone {gemm:7.1f} tok/s ({tps / gemm:.0%} of it)   threads {row['threads']}"
              + (f"   the host's own {host_ms:.2f} ms a step" if host_ms is not None else "")
              + f"   read {bw_before / 1e9:.1f} / {bw_after / 1e9:.1f} GB/s before / after"
              + ("  (the bandwidth moved over 20% meanwhile: this row's limit is uncertain)"
                 if abs(bw_after - bw_before) > 0.2 * min(bw_before, bw_after) else ""))
    result = {"dtype": args.dtype, "engine": args.engine or "", "decoder": engine.info["decoder"],
              "overlap": engine.execution.overlap.value, "pdl": engine.execution.pdl.value,
              "gemv": engine.execution.gemv.value, "gemv_picks": engine.execution.gemv.reason,
              "sampling": engine.execution.sampling.value, "sampling_timed": engine.execution.sampling.reason,
              "linear": engine.info["linear"],
              "linear_run": (engine.info.get("linear_calibration") or {}).get("run"),
              "bandwidth_gb_s": round(bw / 1e9, 2), "weight_bytes_per_step": w_bytes,
              "kv_bytes_per_token": kv_tok, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "greedy": args.greedy, "rows": rows}
    if args.hf_compile or not why_not:
        engine.close()
        del lm, engine
        free_memory()
    if args.hf_compile:
        result["hf_peer"] = run_peer(args, rows, vocab)
        print_table(rows)
    if not why_not:
        vdtype = args.vllm_dtype or VLLM_DTYPES[args.dtype]
        worker = VllmWorker(args.vllm_python, vllm_settings(model_path, vdtype))

        def vllm_generate(prompts, params):
            return [len(o["token_ids"][0]) for o in worker.generate(prompts, params)["outputs"]]

        gen = torch.Generator().manual_seed(0)  # the engine's prompts again
        try:
            warm_up(vllm_generate, args, vocab)
            for row in rows:
                pairs = [timed_pair(vllm_generate, gen, row["batch"], args, vocab) for _ in range(args.repeat)]
                row["vllm_tok_s"] = round(statistics.median(row["batch"] * args.new_tokens / (t_full - t_pre)
                                                            for t_pre, t_full in pairs), 1)
                print(f"batch {row['batch']:3d}: vLLM {row['vllm_tok_s']:7.1f} tok/s ({vdtype})")
        finally:
            worker.close()
        result.update(vllm_version=worker.ready["vllm"], vllm_dtype=vdtype)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
