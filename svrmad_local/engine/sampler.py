"""Sampling with one random stream per sample.

Each sample owns a `random.Random` (seeded from its request's seed and its index) and draws exactly
one uniform number per token, which it maps through the inverse CDF of its (temperature, top-k,
top-p)-warped distribution sorted by probability. The token therefore depends only on that sample's
logits and its own stream, never on batch mates: seeded requests are reproducible whatever else
shares the step. The draws are plain Python, so a step dispatches the same torch ops at any batch size.
"""

from __future__ import annotations

import random

import torch

from svrmad_local.kernels._backend import staged


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[random.Random]) -> torch.Tensor:
    """`logits` [R, V] fp32; returns token ids [R] (on the logits' device). The host values (row indices,
    temperatures, top-k, top-p, the uniform draws) reach the device through `staged`: pinned, never a
    blocking copy, so the host is not held up by the step still running on the GPU."""
    R, V = logits.shape
    dev = logits.device
    greedy = [i for i, t in enumerate(temperature) if t == 0]
    if len(greedy) == R:
        return logits.argmax(-1)
    out = torch.empty(R, dtype=torch.long, device=dev)
    if greedy:
        g = staged(greedy, torch.long, dev)
        out[g] = logits[g].argmax(-1)
    rows = [i for i, t in enumerate(temperature) if t != 0]
    every = len(rows) == R  # the usual case: no indexing (whose ops would depend on the batch)
    at = None if every else staged(rows, torch.long, dev)
    lg = (logits if every else logits[at]) / staged([temperature[i] for i in rows], logits.dtype, dev).unsqueeze(1)
    ks = [top_k[i] if 0 < top_k[i] < V else V for i in rows]
    kmax = max(ks)
    # top-k first (a partial sort) when every row asks for one: sorting 150k logits is the cost
    vals, idx = lg.topk(kmax, dim=-1) if kmax < V else lg.sort(dim=-1, descending=True)
    ranks = torch.arange(vals.shape[1], device=vals.device)
    vals = vals.masked_fill(ranks.unsqueeze(0) >= staged(ks, torch.long, dev).unsqueeze(1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    cum = probs.cumsum(-1)
    p = staged([top_p[i] for i in rows], torch.float32, dev).unsqueeze(1)
    probs = probs.masked_fill((cum - probs) >= p, 0.0)  # keep the smallest head whose mass reaches top-p
    cum = probs.cumsum(-1)
    u = staged([generators[i].random() for i in rows], torch.float64, dev)
    target = (u * cum[:, -1].double()).to(cum.dtype).unsqueeze(1)
    pos = torch.searchsorted(cum, target, right=True).clamp(max=vals.shape[1] - 1)
    # never land on a masked-out token (float rounding at the very top of the CDF)
    pos = torch.minimum(pos, (probs > 0).sum(-1, keepdim=True) - 1)
    picked = idx.gather(1, pos).squeeze(1)
    if every:
        return picked
    out[at] = picked
    return out
