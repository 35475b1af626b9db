"""The engine's settings: what a caller chooses, and nothing that runs.

`EngineConfig` (how the engine is built), `SamplingParams` (what one request asks for) and
`SignalConfig` (the confidence windows of the per-sequence signals) are plain dataclasses with no
torch in sight, so that analysis/run_config.py, job/flags.py and the commands that never load a model
(`svrmad replay`, `svrmad merge`, `svrmad report`) can read and write them without importing the engine.

SamplingParams' defaults follow the paper's Appendix A (temperature 1.0, top-p 0.95, top-k 40). A
request with a seed draws from its own random stream, so its tokens do not depend on what else
shares the batch.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field

from svrmad_local.errors import UserError
from svrmad_local.sizes import parse_memory


class SettingsError(UserError, ValueError):
    """Settings of an EngineConfig, SamplingParams or SignalConfig that cannot work, refused when the
    object is built (so the Python API refuses what the command line refuses, in the same words).
    `problems` keeps (field, what is wrong) pairs so a caller that knows its own names for the
    fields (the command line's flags) can say them instead: `line(names)`."""

    def __init__(self, owner: str, problems: list[tuple[str, str]]):
        self.owner, self.problems = owner, problems
        super().__init__(f"invalid {owner}: {self.line()}")

    def line(self, names: dict[str, str] | None = None) -> str:
        return "; ".join(f"{(names or {}).get(f, f)} {what}" for f, what in self.problems)


def _integer(value, low: int | None = None) -> str | None:
    """What is wrong with `value` as a count (bools and 2.5 are not integers), or None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return f"must be an integer, got {value!r}"
    if low is not None and value < low:
        return f"must be >= {low}, got {value}"
    return None


def _number(value, low: float, high: float | None = None, open_low: bool = False) -> str | None:
    """What is wrong with `value` as a finite number in [low, high] ((low, high] with `open_low`):
    NaN compares false, so it would pass every bound and surface later as a sampler error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"must be a number, got {value!r}"
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if (value <= low if open_low else value < low) or (high is not None and value > high):
        if high is None:
            return f"must be >= {low}, got {value}"
        return f"must be in {'(' if open_low else '['}{low}, {high}], got {value}"
    return None


def _refuse(obj, checks: dict[str, str | None]) -> None:
    problems = [(name, what) for name, what in checks.items() if what]
    if problems:
        raise SettingsError(type(obj).__name__, problems)


@dataclass
class SignalConfig:
    """DeepConf-style confidence windows (Fu et al., 2025 use 2048 for both); a researcher with short
    answers will want smaller ones, so both are parameters of the engine."""

    group_window: int = 2048
    tail_tokens: int = 2048
    bottom_fraction: float = 0.10

    def __post_init__(self) -> None:
        _refuse(self, {"group_window": _integer(self.group_window, 1), "tail_tokens": _integer(self.tail_tokens, 1),
                       "bottom_fraction": _number(self.bottom_fraction, 0, 1, open_low=True)})


@dataclass
class EngineConfig:
    """block_size: tokens per KV block. kv_cache_memory: the KV budget, as bytes (int), a fraction
    of the memory available after loading (float <= 1), or a string such as "2GiB"; None means
    90% of free GPU memory, or half the RAM available after loading capped at what max_num_seqs x
    max_model_len can use (engine/memory.py). kernel_impl: "auto" | "torch" | "triton", the path of
    kernels/ (fused token statistics for scoring, cascade attention): "auto" takes Triton on a GPU,
    "torch" forces the references. cascade: "auto" (off: measured slower, see choices._cascade_enabled) | "on" | "off".
    linear: "auto" | "panels" | "onednn" | "aten", how the model's linears run (models/linear.py): "auto"
    takes, on the CPU, the backend measured fastest here for the workload (models/calibrate.py, cached per
    machine; weighed again by the run's own steps, engine/relinear.py; SVRMAD_CALIBRATE=0: the panels,
    else oneDNN's layout, else F.linear) and says why; the packing is done in place. cache_dir: where the
    linear calibration's figures are kept (the run's --cache-dir; None: $SVRMAD_CACHE, else
    ~/.cache/svrmad-local).

    decoder: "auto" | "ours" | "modules", how the layers run: "ours" is the engine's own forward
    (engine/decoder.py: fused norms, RoPE and cache writes; bitwise the modules' computation with those
    norms) for every family it claims, "modules" transformers' own; "auto" takes ours (the compiled ops on
    the CPU, Triton on a GPU) and the modules for an architecture not ported, saying why. "lean" is the old name of "ours", still accepted.

    mla: "absorbed" (decode rows of multi-head latent attention read the cached latent, engine/mla.py) |
    "expanded" (transformers' own expansion of the whole context at every step, the reference).

    cuda_graphs: "auto" | "on" | "static" | "off" (engine/graphs.py): decode-only steps at fixed batch
    sizes over static buffers, captured in CUDA graphs and replayed; "auto" takes them on a CUDA device
    when nothing rules them out and says why not in `info["cuda_graphs"]`, "on" makes a reason an
    error, "static" runs the same fixed-shape path eagerly on any device (what a graph would record).

    overlap: "auto" | "on" | "off" (engine/step.py): the host schedules and launches decode step N+1
    before it reads step N's tokens, which step N+1 takes on the device, so the host's work for a step
    (scheduling, its inputs, the graph's launch) hides behind the device's previous step; a sequence that
    step N ends computes one row in step N+1 for nothing. "auto" takes it where decode steps replay CUDA
    graphs (under tensor parallel too: the followers take the ids from the leader's device), "on"
    wherever the static path runs (cuda_graphs="static" too: the same tokens, checkable on the CPU),
    "off" reads each step's tokens before the next.

    pdl: "auto" | "on" | "off" (kernels/pdl.py): programmatic dependent launch on an sm_90+ GPU: each
    Triton kernel may start while the one before it runs, and waits only before it reads, so the GPU does
    not idle at the few hundred kernel boundaries of a decode step. "auto" takes it where the GPU and its
    driver run it (a probe at build), "on" makes a reason an error, "off" launches every kernel after the
    one before ends (the same tokens either way).

    gemv: "auto" | "skinny" | "torch", how decode's linears of up to 32 rows run (kernels/skinny.py):
    "auto" times, at build on a GPU, F.linear against the skinny Triton kernel for each linear's shape at
    1, 2, 4, 8, 16 and 32 rows and takes the kernel where it is 5% faster (F.linear off a GPU, and for a
    model of less than 64 MiB of weights, whose steps are bound by launches); "skinny" takes it
    at every shape (its Triton must run: a GPU, or the interpreter); "torch" never. More rows: F.linear.

    adapt_threads: on the CPU, run the steps on fewer of torch's threads while other processes take
    cores, and take them back when the cores are free (engine/threads.py); False keeps torch's count, so
    the log-probs' last bits never depend on the machine's load (default: SVRMAD_ADAPT_THREADS, else on)."""

    block_size: int = 16  # 256 (a flash-attn page) lets flash-attn read the cache in place
    kv_cache_memory: int | float | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    attention: str = "auto"
    kernel_impl: str = "auto"
    cascade: str = "auto"
    linear: str = "auto"
    decoder: str = "auto"
    mla: str = "absorbed"
    cuda_graphs: str = "auto"
    overlap: str = "auto"
    pdl: str = "auto"
    gemv: str = "auto"
    adapt_threads: bool = field(default_factory=lambda: os.environ.get("SVRMAD_ADAPT_THREADS", "1") != "0")
    score_chunk: int = 1024
    signals: SignalConfig = field(default_factory=SignalConfig)
    seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        checks = {name: _integer(getattr(self, name), 1)
                  for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "score_chunk")}
        checks["seed"] = _integer(self.seed)
        if self.overlap not in OVERLAP:
            checks["overlap"] = f"must be one of {', '.join(OVERLAP)}, got {self.overlap!r}"
        if self.pdl not in PDL:
            checks["pdl"] = f"must be one of {', '.join(PDL)}, got {self.pdl!r}"
        if self.gemv not in GEMV:
            checks["gemv"] = f"must be one of {', '.join(GEMV)}, got {self.gemv!r}"
        try:  # the same parser the build sizes the pool with, against a nominal amount available
            parse_memory(self.kv_cache_memory, available=1 << 40, default=1)
        except ValueError as exc:
            checks["kv_cache_memory"] = str(exc).removeprefix("kv_cache_memory ")
        if not isinstance(self.signals, SignalConfig):
            checks["signals"] = f"must be a SignalConfig, got {self.signals!r}"
        _refuse(self, checks)


OVERLAP = ("auto", "on", "off")  # EngineConfig.overlap
PDL = ("auto", "on", "off")  # EngineConfig.pdl
GEMV = ("auto", "skinny", "torch")  # EngineConfig.gemv


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 40
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    topk_logprobs: int = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        _refuse(self, {
            "n": _integer(self.n, 1),
            "temperature": _number(self.temperature, 0),
            "top_p": _number(self.top_p, 0, 1, open_low=True),
            "top_k": _integer(self.top_k, 0),
            "max_tokens": _integer(self.max_tokens, 0),
            "stop": _stop_strings(self.stop),
            "stop_token_ids": (f"must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}"
                               if not isinstance(self.stop_token_ids, list)
                               or any(_integer(t, 0) for t in self.stop_token_ids) else None),
            "ignore_eos": None if isinstance(self.ignore_eos, bool) else f"must be True or False, got {self.ignore_eos!r}",
            "seed": None if self.seed is None else _integer(self.seed),
            "topk_logprobs": _integer(self.topk_logprobs, 0),
        })

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _stop_strings(stop) -> str | None:
    """An empty stop string matches at every position: each completion would end after one token."""
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        return f"must be a string or a list of strings, got {stop!r}"
    if any(x == "" for x in stop):
        return "holds an empty string, which every text ends with (each completion would stop after one token)"
    return None
