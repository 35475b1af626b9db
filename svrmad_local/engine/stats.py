"""Token statistics from the raw model distribution, and the per-sequence signals derived from them.

Everything is computed from fp32 logits at temperature 1 (the model's own distribution, like vLLM's
raw logprobs), never from the temperature/top-k/top-p warped one used to draw the token: the prior
signals of the paper describe the model, not the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from svrmad_local.kernels import cpu_ops

from .config import SamplingParams, SignalConfig

# the top-k width of every step's statistics, at least (the default topk_logprobs): a batch of default
# requests computes the width the static decode step holds (engine/graphs.py); a request's own are sliced
STATS_TOP_K = SamplingParams.topk_logprobs


@dataclass
class StepStats:
    """Statistics of a batch of positions: one row per position."""

    logprob: torch.Tensor  # [R] log p(chosen token)
    entropy: torch.Tensor  # [R] entropy of the full distribution (nats)
    topk_logprobs: torch.Tensor  # [R, k] sorted descending
    topk_ids: torch.Tensor  # [R, k]


def row_sum(x: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """`x` [R, V] summed over V in an order that does not depend on R. torch sums a lone row (one
    output) in two passes split over the threads, and each row of a batch in one pass: a token's
    entropy then changed in its last bits with the number of rows in its step, which a run's timing
    decides, so two runs of one seeded job differed. Here `chunk`-wide slices are summed first (many
    outputs: each in one pass, whatever R), then the V / chunk partial sums (too few to split)."""
    pad = (-x.shape[-1]) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))  # adding zeros changes no sum
    return x.view(x.shape[0], -1, chunk).sum(-1).sum(-1)


def stats_from_logits(logits: torch.Tensor, chosen: torch.Tensor, topk: int) -> StepStats:
    """`logits` [R, V] (any dtype; upcast here), `chosen` [R] token ids."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -row_sum(logp.exp().mul_(logp))  # in place: the same products, one [R, V] buffer fewer
    lp = logp.gather(1, chosen.view(-1, 1).to(logp.device)).squeeze(1)
    k = min(topk, logp.shape[-1])
    top = cpu_ops.topk(logp, k) if k > 0 else None  # torch.topk's bits, compiled on the CPU
    return StepStats(
        logprob=lp,
        entropy=entropy,
        topk_logprobs=top.values if top is not None else logp.new_zeros(logp.shape[0], 0),
        topk_ids=top.indices if top is not None else chosen.new_zeros(logp.shape[0], 0),
    )


def pack(tokens: torch.Tensor, st: StepStats) -> torch.Tensor:
    """A step's sampled tokens [R] and their statistics as one [R, 3 + 2k] float64 tensor, which the host
    reads at once: token id, log-prob, entropy, the k top log-probs, the k top ids (ids and fp32 values
    are exact in float64)."""
    # one float64 column makes the concatenation float64 (torch.cat promotes), converting the others in it
    return torch.cat((tokens.to(torch.float64).unsqueeze(1), st.logprob.unsqueeze(1), st.entropy.unsqueeze(1),
                      st.topk_logprobs, st.topk_ids), dim=1)


def disagreement(got: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor, topk: int) -> str | None:
    """What breaks the contract every faster sampling path keeps against the torch ops' step, comparing its
    packed rows `got` with theirs `ref` (`pack`'s layout, k = topk); None where it holds. Tokens and top ids
    bit for bit; log-probs within 2e-5 of torch's; NaN entropies where torch's are, the others within 1e-4
    (+1e-5 relative) of the float64 truth from `logits`, not of torch's fp32 sums, which can themselves be
    1.2e-4 off it (262,152 entries). The tests and bench_sampling.py hold every path to it."""
    if got.shape != ref.shape or got.dtype != torch.float64:
        return f"packed rows {tuple(got.shape)} {got.dtype}, expected {tuple(ref.shape)} torch.float64"
    a, b = got[:, [1, *range(3, 3 + topk)]], ref[:, [1, *range(3, 3 + topk)]]  # the log-probs
    close = (a == b) | ((a - b).abs() <= 2e-5) | (a.isnan() & b.isnan())  # equal infinities and NaNs agree
    checks = (("tokens", torch.equal(got[:, 0], ref[:, 0])), ("top ids", torch.equal(got[:, 3 + topk:], ref[:, 3 + topk:])),
              ("log-probs", bool(close.all())), ("NaN entropies", torch.equal(got[:, 2].isnan(), ref[:, 2].isnan())))
    for what, ok in checks:
        if not ok:
            return f"the {what} differ"
    finite = ~ref[:, 2].isnan()
    lp = torch.log_softmax(logits[finite].double(), -1)
    truth = -(lp.exp() * lp).sum(-1)
    off = (got[finite, 2] - truth).abs() - 1e-5 * truth.abs()
    if bool((off > 1e-4).any()):
        return f"an entropy is {off.max().item() + 1e-4:.2e} from the float64 truth (1e-4 allowed)"
    return None


def unpack(row: list[float], k: int) -> tuple[int, float, float, list[float], list[int]]:
    """One row of `pack`'s tensor as the host read it: (token, log-prob, entropy, top log-probs, top ids),
    the top ones cut to the first `k`."""
    width = (len(row) - 3) // 2
    return (int(row[0]), row[1], row[2], row[3 : 3 + min(k, width)], [int(i) for i in row[3 + width : 3 + width + k]])


def sequence_signals(
    logprobs: list[float], entropies: list[float], topk_logprobs: list[list[float]], cfg: SignalConfig | None = None
) -> dict[str, float | None]:
    """Per-sequence signals: min-LL, perplexity, mean entropy and DeepConf confidences.

    Token confidence = -mean of the top-k logprobs (high when the distribution is peaked); group
    confidence = mean token confidence over a sliding window (clipped to the sequence length);
    lowest-group = min over windows; bottom-10% = mean of the lowest 10% of windows; tail = mean
    token confidence over the last `tail_tokens` tokens. An empty sequence gives None everywhere.
    """
    cfg = cfg or SignalConfig()
    n = len(logprobs)
    keys = ("min_ll", "ppl", "mean_logprob", "mean_entropy", "conf_mean", "conf_lowest_group", "conf_bottom10", "conf_tail")
    if n == 0:
        return dict.fromkeys(keys)
    lp = torch.tensor(logprobs, dtype=torch.float64)
    mean_lp = float(lp.mean())
    out: dict[str, float | None] = {
        "min_ll": float(lp.min()),
        "ppl": math.exp(-mean_lp),
        "mean_logprob": mean_lp,
        "mean_entropy": float(torch.tensor(entropies, dtype=torch.float64).mean()),
    }
    if topk_logprobs and len(topk_logprobs[0]) > 0:
        conf = -torch.tensor(topk_logprobs, dtype=torch.float64).mean(-1)
        w = max(1, min(cfg.group_window, n))
        csum = torch.cat([conf.new_zeros(1), conf.cumsum(0)])
        groups = (csum[w:] - csum[:-w]) / w
        n_bottom = max(1, math.ceil(cfg.bottom_fraction * len(groups)))
        out.update(
            conf_mean=float(conf.mean()),
            conf_lowest_group=float(groups.min()),
            conf_bottom10=float(groups.sort().values[:n_bottom].mean()),
            conf_tail=float(conf[-max(1, min(cfg.tail_tokens, n)) :].mean()),
        )
    else:
        out.update(conf_mean=None, conf_lowest_group=None, conf_bottom10=None, conf_tail=None)
    return out
