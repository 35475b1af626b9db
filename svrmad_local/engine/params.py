"""Sampling parameters, in the spirit of vLLM's SamplingParams.

Defaults follow the paper's Appendix A (temperature 1.0, top-p 0.95, top-k 40). A request with a
seed draws from its own random stream, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
