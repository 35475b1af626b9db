"""Requests, their sequences and what they return.

A request is a prompt plus SamplingParams; with n > 1 one *leader* sequence computes the prompt
and the n samples fork from its KV (the prompt is computed once). A scoring request is a prompt
plus a given continuation, fed through teacher-forced, with statistics for the continuation.
"""

from __future__ import annotations

import itertools
import random

import asyncio
import time
from dataclasses import dataclass, field

from .config import SamplingParams


@dataclass
class Usage:
    """Exact token accounting of one request.

    prompt_tokens: what an API would bill: the whole prompt once per sample (n calls of one agent
    each), so it can be compared with the paper's counts. computed_tokens: prompt tokens the
    engine actually ran through the model (after prefix reuse; preemption recompute included).
    cached_tokens = prompt_tokens - computed_tokens. generated_tokens: over all n samples.
    """

    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    peak_kv_bytes: int = 0
    preemptions: int = 0
    time_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "peak_kv_bytes": self.peak_kv_bytes,
            "preemptions": self.preemptions,
            "time_s": self.time_s,
        }


@dataclass
class Completion:
    """One sample: its exact tokens, text and per-token statistics from the raw distribution."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[float]
    entropies: list[float]
    topk_logprobs: list[list[float]]
    topk_ids: list[list[int]]
    signals: dict[str, float | None]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    completions: list[Completion]
    usage: Usage


@dataclass
class ScoreOutput:
    """Statistics of a given continuation under a prompt (teacher forcing)."""

    logprobs: list[float]
    entropies: list[float]
    topk_logprobs: list[list[float]]
    topk_ids: list[list[int]]
    signals: dict[str, float | None]
    usage: Usage


class Request:
    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, future: asyncio.Future | None,
                 score_from: int | None = None):
        self.id = rid
        self.prompt = list(prompt)
        self.params = params
        self.future = future
        self.score_from = score_from  # scoring request: statistics for tokens[score_from:]
        self.seed = params.seed  # the engine draws one when None; sample i streams from (seed, i)
        self.usage = Usage(prompt_tokens=len(prompt) * (1 if score_from is not None else params.n))
        self.t0 = time.perf_counter()
        self.sequences: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.error: BaseException | None = None
        # the blocks its sequences hold, with how many of them hold each (kept by the scheduler as blocks
        # change, so the peak KV of a step is one len() and not a walk over every block)
        self.held_blocks: dict[int, int] = {}

    @property
    def num_outputs(self) -> int:
        """Sequences that finish this request: one for scoring (or max_tokens=0), else n."""
        return 1 if self.score_from is not None or self.params.max_tokens == 0 else self.params.n


_uids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # sample index within the request (0 = leader)
    tokens: list[int]
    num_prompt: int
    generator: random.Random | None
    blocks: list[int] = field(default_factory=list)
    # the runner keeps each sequence's block table on the device and appends to it (kv_cache.DeviceTables):
    # `uid` names the sequence there, `blocks_epoch` changes whenever `blocks` changes other than by an append
    uid: int = field(default_factory=lambda: next(_uids))
    blocks_epoch: int = 0
    num_computed: int = 0  # tokens whose KV is in `blocks`
    num_indexed: int = 0  # leading full blocks already put in the prefix tree
    is_leader_prefill: bool = False  # leader of an n>1 request that has not forked yet
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params
