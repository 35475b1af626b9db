"""The engine's settings: what a caller chooses, and nothing that runs.

`EngineConfig` (how the engine is built), `SamplingParams` (what one request asks for) and
`SignalConfig` (the confidence windows of the per-sequence signals) are plain dataclasses with no
torch in sight, so that eval/config.py and the commands that never load a model (`svrmad replay`,
`svrmad merge`, `svrmad report`) can read and write them without importing the engine.

SamplingParams' defaults follow the paper's Appendix A (temperature 1.0, top-p 0.95, top-k 40). A
request with a seed draws from its own random stream, so its tokens do not depend on what else
shares the batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class SignalConfig:
    """DeepConf-style confidence windows (Fu et al., 2025 use 2048 for both); a researcher with short
    answers will want smaller ones, so both are parameters of the engine."""

    group_window: int = 2048
    tail_tokens: int = 2048
    bottom_fraction: float = 0.10



@dataclass
class EngineConfig:
    """block_size: tokens per KV block. kv_cache_memory: the KV budget, as bytes (int), a fraction
    of the memory available after loading (float <= 1), or a string such as "2GiB"; None means
    90% of free GPU memory, or half the RAM available after loading capped at what max_num_seqs x
    max_model_len can use (engine/memory.py). kernel_impl: "auto" | "torch" | "triton", the path of
    kernels/ (fused token statistics for scoring, cascade attention): "auto" takes Triton on a GPU,
    "torch" forces the references. cascade: "auto" (off: measured slower, see runner._cascade_enabled) | "on" | "off".
    linear: "auto" | "panels" | "onednn" | "aten", how the model's linears run (models/linear.py): "auto"
    takes, on the CPU, the backend measured fastest here for the workload (models/calibrate.py, cached per
    machine; SVRMAD_CALIBRATE=0: the panels for fp32, else oneDNN's layout, else F.linear) and says why;
    the packing is done in place, once.

    decoder: "auto" | "lean" | "modules", how the layers run (engine/lean.py): "auto" takes the lean
    forward (fused norms, RoPE and cache writes; bitwise the modules' computation with those norms) for
    fp32 Llama/Mistral/Qwen2/Qwen3 on the CPU, else the model's own modules, saying why.

    mla: "absorbed" (decode rows of multi-head latent attention read the cached latent, engine/mla.py) |
    "expanded" (transformers' own expansion of the whole context at every step, the reference).

    cuda_graphs: "auto" | "on" | "static" | "off" (engine/graphs.py): decode-only steps at fixed batch
    sizes over static buffers, captured in CUDA graphs and replayed; "auto" takes them on a CUDA device
    when nothing rules them out and says why not in `info["cuda_graphs"]`, "on" makes a reason an
    error, "static" runs the same fixed-shape path eagerly on any device (what a graph would record).

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
    adapt_threads: bool = field(default_factory=lambda: os.environ.get("SVRMAD_ADAPT_THREADS", "1") != "0")
    score_chunk: int = 1024
    signals: SignalConfig = field(default_factory=SignalConfig)
    seed: int = 0


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
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 0:
            problems.append(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.topk_logprobs < 0:
            problems.append(f"topk_logprobs must be >= 0, got {self.topk_logprobs}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
