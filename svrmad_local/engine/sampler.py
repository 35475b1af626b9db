"""Sampling with one random stream per sample, in two parts: what the host draws, what the device computes.

Each sample owns a `random.Random` (seeded from its request's seed and its index) and draws exactly
one uniform number per token (greedy samples draw none), which it maps through the inverse CDF of its
(temperature, top-k, top-p)-warped distribution sorted by probability. The token therefore depends only
on that sample's logits and its own stream, never on batch mates: seeded requests are reproducible
whatever else shares the step.

`prepare` is the host part: the rows' parameters and uniform draws as one table of numbers. `draw` is the
device part: tensor ops of fixed shapes over every row alike (greedy rows included, their argmax chosen at
the end), no value read back and no shape that depends on one, so the static decode step can run it inside
what a CUDA graph captures (engine/graphs.py). The top-k width is at least SAMPLE_TOP_K, the default
top_k: a batch of default requests always runs `topk(SAMPLE_TOP_K)`, the width the graph holds, and a row
asking fewer masks the ranks past its own k inside that width.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from svrmad_local.kernels import cpu_ops, sample_pack
from svrmad_local.kernels._backend import fall_back, select_impl, staged

from .config import SamplingParams
from .stats import STATS_TOP_K, pack, stats_from_logits

SAMPLE_TOP_K = SamplingParams.top_k  # the width of every step's top-k, at least (the default top_k)


@dataclass(frozen=True)
class Draws:
    """The host part of one step's sampling, row i for sample i: `table` [5, R] float64 holds the
    temperature (1 on greedy rows: they are not warped), the top-k (the vocabulary where a row asks none),
    the top-p, the uniform draw (0 on greedy rows, which draw none) and 1 where the row is greedy; counts
    are exact in float64. `K`: the top-k width the step samples from (the vocabulary: a full sort);
    `topk`: the width of its statistics' top log-probs (stats.STATS_TOP_K at least, each row sliced to its own)."""

    table: np.ndarray
    K: int
    topk: int

    @property
    def greedy(self) -> bool:
        """Every row greedy: the argmax is the whole answer."""
        return bool(self.table[4].all())

    def __len__(self) -> int:
        return self.table.shape[1]


def prepare(params: list[SamplingParams], generators: list[random.Random], vocab: int) -> Draws:
    """The rows' parameters as numbers, and one uniform draw from each non-greedy row's own stream,
    for a vocabulary of `vocab` tokens."""
    table = np.empty((5, len(params)), dtype=np.float64)
    for i, (p, gen) in enumerate(zip(params, generators)):
        greedy = p.temperature == 0
        table[:, i] = (1.0 if greedy else p.temperature, _top_k(p, vocab), p.top_p, 0.0 if greedy else gen.random(), greedy)
    return Draws(table, *widths(params, vocab))


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if 0 < p.top_k < vocab else vocab


def widths(params: list[SamplingParams], vocab: int) -> tuple[int, int]:
    """(K, topk) of a step sampling rows with `params` (Draws.K, Draws.topk), without drawing anything: a
    step may be asked whether it can sample inside the static step before any stream moves."""
    kmax = max([SAMPLE_TOP_K] + [_top_k(p, vocab) for p in params if p.temperature != 0])
    topk = max([STATS_TOP_K] + [p.topk_logprobs for p in params])
    return min(kmax, vocab), min(topk, vocab)


def draw(logits: torch.Tensor, temps: torch.Tensor | None, ks: torch.Tensor, ps: torch.Tensor, u: torch.Tensor,
         greedy: torch.Tensor | None, K: int) -> torch.Tensor:
    """Token ids [R] from `logits` [R, V] fp32 and the rows' temperature [R] (fp32; None where every row's
    is 1: x / 1 is x, so the [R, V] division is skipped), top-k [R] (long),
    top-p [R] (fp32), uniform draw [R] (float64) and greedy mask [R] (bool; None: no row is greedy, and
    no argmax is taken, which costs as much as the rest on a CPU at a large vocabulary): row by row, so
    a row's token depends on its own row only. `K`: the top-k width (V: a full sort)."""
    V = logits.shape[1]
    lg = logits if temps is None else logits / temps.unsqueeze(1)
    # top-k first (a partial sort): sorting 150k logits is the cost; on the CPU a compiled one, torch's bits
    vals, idx = cpu_ops.topk(lg, K) if K < V else lg.sort(dim=-1, descending=True)
    ranks = torch.arange(vals.shape[1], device=vals.device)
    vals = vals.masked_fill(ranks.unsqueeze(0) >= ks.unsqueeze(1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    cum = probs.cumsum(-1)
    probs = probs.masked_fill((cum - probs) >= ps.unsqueeze(1), 0.0)  # the smallest head whose mass reaches top-p
    cum = probs.cumsum(-1)
    target = (u * cum[:, -1].double()).to(cum.dtype).unsqueeze(1)
    pos = torch.searchsorted(cum, target, right=True).clamp(max=vals.shape[1] - 1)
    # never land on a masked-out token (float rounding at the very top of the CDF); a row of NaN or infinite
    # logits has no positive probability and takes its first place: the step fails its request (engine/step.py)
    pos = torch.minimum(pos, (probs > 0).sum(-1, keepdim=True) - 1).clamp(min=0)
    picked = idx.gather(1, pos).squeeze(1)
    return picked if greedy is None else torch.where(greedy, cpu_ops.argmax(logits), picked)


def columns(table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """`draw`'s inputs from a [5, R] float64 table (Draws.table on the device): temperature in `dtype`
    (the logits'), top-k, top-p, u, greedy mask."""
    return table[0].to(dtype), table[1].long(), table[2].float(), table[3], table[4] != 0


def sample_rows(logits: torch.Tensor, draws: Draws) -> torch.Tensor:
    """Token ids [R] of `logits` [R, V] fp32 for the rows `draws` describes, eagerly. The table reaches the
    device through `staged` (pinned, never a blocking copy: the host is not held up by the step still
    running on the GPU)."""
    if draws.greedy:
        return cpu_ops.argmax(logits)
    temps, ks, ps, u, greedy = columns(staged(draws.table, torch.float64, logits.device), logits.dtype)
    return draw(logits, None if (draws.table[0] == 1).all() else temps, ks, ps, u,
                greedy if draws.table[4].any() else None, draws.K)


def sample_packed(logits: torch.Tensor, draws: Draws, kernel_impl: str = "auto", fused_rows=None) -> torch.Tensor:
    """The rows' tokens (`sample_rows`) and their statistics (stats.stats_from_logits at width draws.topk),
    packed for the host's one read (stats.pack). On the CPU one compiled call (cpu_ops.sample_pack): the draw's
    torch ops from C++ (torch's tokens), the statistics in one pass of its own (within float rounding). On a
    GPU two Triton kernels do it (`fused`) at the row counts `fused_rows` (a FusedRows; None: at every count)."""
    if cpu_ops.samples(logits):
        return cpu_ops.sample_pack(logits, staged(draws.table, torch.float64, logits.device), draws.K, draws.topk)
    if fuses(logits, draws.K, draws.topk, kernel_impl, fused_rows):
        out = fused(logits, staged(draws.table, torch.float64, logits.device), draws.K, draws.topk, kernel_impl)
        if out is not None:
            return out
    toks = sample_rows(logits, draws)
    return pack(toks, stats_from_logits(logits, toks, draws.topk))


def packed_by_torch(logits: torch.Tensor, table: torch.Tensor, K: int, topk: int) -> torch.Tensor:
    """`draw` and the statistics by torch's ops from a [5, R] table on the device, packed: what the static
    step captures where the Triton kernels do not serve it (and what they are timed against)."""
    toks = draw(logits, *columns(table, logits.dtype), K)
    return pack(toks, stats_from_logits(logits, toks, topk))


@dataclass(frozen=True)
class FusedRows:
    """The row counts at which a step's sampling takes kernels/sample_pack.py's two Triton kernels rather
    than torch's ops, where both can run (`fuses`). Why by rows: the kernels' cost grows with the rows they
    keep a running top-k for, torch's top-k and softmax less so, and which is faster differs by GPU, so the
    build times both at powers of two (engine/choices.py `sampling_choice`). A step of r rows goes by the
    smallest timed count >= r (the static step pads to its batch sizes), above them by the largest."""

    picks: tuple[tuple[int, bool], ...]  # (rows, the kernels taken), ascending, at least one

    def __call__(self, rows: int) -> bool:
        for r, taken in self.picks:
            if rows <= r:
                return taken
        return self.picks[-1][1]

    def __str__(self) -> str:
        spans, lo = [], 1
        for r, taken in self.picks:
            if spans and spans[-1][2] == taken:
                spans[-1][1] = r
            else:
                spans.append([lo, r, taken])
            lo = r + 1
        if len(spans) == 1:
            return ("Triton kernels" if spans[0][2] else "torch's ops") + " at every row count"
        spans[-1][1] = None  # the last span reaches past the timed counts
        return ", ".join(("Triton kernels" if taken else "torch's ops") + " at "
                         + (f"{a}+ rows" if b is None else f"{a} row" if a == b == 1 else
                            f"{a} rows" if a == b else f"{a}-{b} rows")
                         for a, b, taken in spans)


def cuda_timer(vocab: int, device: torch.device, K: int, topk: int):
    """A timer for `sampling_choice`: (rows, "triton" | "torch") -> seconds of a step's sampling, statistics
    and packing at `rows` rows of fp32 logits (a spread like a model's), each call replayed from a CUDA
    graph as the static step runs it (skinny.time_call), the default settings (temperature 1, top-k 40, top-p 0.95)."""
    from svrmad_local.kernels.skinny import time_call

    def timer(rows: int, side: str) -> float:
        g = torch.Generator().manual_seed(rows)
        logits = (3 * torch.randn(rows, vocab, generator=g)).to(device)
        table = torch.from_numpy(prepare([SamplingParams()] * rows, [random.Random(i) for i in range(rows)],
                                         vocab).table).to(device)
        if side == "triton":
            return time_call(lambda: sample_pack.sample_pack(logits, table, K, topk))
        return time_call(lambda: packed_by_torch(logits, table, K, topk))

    return timer


def fuses(logits: torch.Tensor, K: int, topk: int, kernel_impl: str, fused_rows: FusedRows | None = None) -> bool:
    """Whether a step's sampling at widths (K, topk) takes kernels/sample_pack.py's two Triton kernels: fp32
    logits where the Triton kernels run (a GPU; kernel_impl='triton' under the interpreter), widths it keeps,
    at a row count `fused_rows` gives them (None: any)."""
    return logits.dtype == torch.float32 and sample_pack.fits(K, topk, logits.shape[1]) \
        and select_impl(kernel_impl, logits, "sample_pack") == "triton" \
        and (fused_rows is None or fused_rows(logits.shape[0]))


def fused(logits: torch.Tensor, table: torch.Tensor, K: int, topk: int, kernel_impl: str) -> torch.Tensor | None:
    """kernels/sample_pack.py's packed rows (where `fuses`), or None where its Triton path failed under
    "auto" (the torch ops then serve this process: kernels._backend.fall_back)."""
    try:
        return sample_pack.sample_pack(logits, table, K, topk)
    except Exception as err:
        fall_back("sample_pack", err, kernel_impl)
        return None


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[random.Random]) -> torch.Tensor:
    """`logits` [R, V] fp32 and each row's settings as lists; returns token ids [R] (on the logits' device)."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in zip(temperature, top_k, top_p)]
    return sample_rows(logits, prepare(params, generators, logits.shape[1]))
