"""Which decode linears take the skinny kernel (kernels/skinny.py) instead of F.linear: timed once per
machine, the figures kept (engine/kept.py: every later engine on that machine picks the same configs, so
its log-probs are the same bits from run to run), the picks made from them (engine/choices.py
`gemv_choice` calls this).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from svrmad_local.kernels import skinny
from svrmad_local.kernels._backend import HAS_TRITON, triton
from svrmad_local.models.layouts import multiplies_dense

from . import kept
from . import tp
from .families import (DENSE_MLPS, GATED, LAYERS, NORMED, ROUTERS, gate_up_linears, gemm_module, qkv_linears,
                       shares_left, silu_down)

MARGIN = 0.05  # the skinny kernel is taken for a shape and row count only where this much faster
# Below this many bytes of weights a decode step is bound by its launches, not by reading the weights
# (SmolLM2-135M's 270 MB step already is, on an H200: measurements.md), so "auto" times nothing and keeps
# F.linear: the test models would otherwise compile and time the kernel at every engine built
MIN_BYTES = 64 * 2**20
# A down projection whose input is SiLU(gate) * up runs with the activation in the kernel's prologue
# (skinny.bound_gated), which holds the gate's and up's tiles beside the weight's, and a q/k/v or gate/up linear
# with the add + RMSNorm before it in its prologue (skinny.bound_normed), which first walks the whole row for its
# sum of squares: other kernels than the plain ones, each timed as such against the op before it then the plain
# shape's pick, for this many of the plain shape's fastest configs
PROLOGUE_TRIES = 3


def decode_linears(model) -> dict[tuple[int, int], nn.Linear]:
    """The plain linears our decoder calls in its layers, and the LM head, one per (N, K) shape (the first
    found: the others of that shape hold other weights of the same size), in the kernel's dtypes. A
    mixture-of-experts router is left out: the decoder calls it as a module (families.ROUTERS)."""
    layers = getattr(model.base_model, "layers", [])
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    routers = {id(getattr(layer.mlp, ROUTERS[type(layer.mlp).__name__][0])) for layer in layers
               if type(getattr(layer, "mlp", None)).__name__ in ROUTERS}
    shapes: dict[tuple[int, int], nn.Linear] = {}
    for m in [m for layer in layers for m in layer.modules()] + ([head] if head is not None else []):
        if multiplies_dense(m) and m.weight.dtype in skinny.DTYPES and id(m) not in routers:
            shapes.setdefault(tuple(m.weight.shape), m)
    return shapes


def gated_downs(model) -> dict[tuple[int, int], nn.Module]:
    """The down projections that read SiLU(gate) * up (`families.silu_down`) in the model's layers, one per
    (N, K) shape, in the kernel's dtypes."""
    shapes: dict[tuple[int, int], nn.Module] = {}
    for m in (m for layer in getattr(model.base_model, "layers", []) for m in layer.modules()):
        down = silu_down(m)
        if down is not None and down.weight.dtype in skinny.DTYPES:
            shapes.setdefault(tuple(down.weight.shape), down)
    return shapes


def normed_linears(model) -> dict[tuple[int, int], nn.Module]:
    """The one-GEMM q/k/v and gate/up linears of the model's layers (a fused group, or Phi-3's one
    projection: families.gemm_module), which our decoder may run with the add + RMSNorm before them in the skinny
    kernel's prologue (families.normed_columns), one per (N, K) shape, in the kernel's dtypes. A latent
    attention's and a mixture-of-experts block's stay out: their norms feed several calls."""
    shapes: dict[tuple[int, int], nn.Module] = {}
    for layer in getattr(model.base_model, "layers", []):
        groups = [] if hasattr(layer.self_attn, "kv_a_proj_with_mqa") else [qkv_linears(layer.self_attn)]
        if type(getattr(layer, "mlp", None)).__name__ in DENSE_MLPS:
            groups.append(gate_up_linears(layer.mlp))
        for linears in groups:
            m = gemm_module(linears)
            if m is not None and multiplies_dense(m) and m.weight.dtype in skinny.DTYPES:
                shapes.setdefault(tuple(m.weight.shape), m)
    return shapes


def unsummed_shapes(model) -> set[tuple[int, int]]:
    """The (N, K) shapes of the decode linears whose every module our decoder leaves its split-K partials
    unsummed for the norm after it (families.shares_left: o_proj and down): timed without the sum kernel, as
    they run (a shape another linear shares, which sums its own, is timed with it)."""
    sharded, left, others = tp.group_of(model) is not None, set(), set()
    for layer in getattr(model.base_model, "layers", []):
        family = LAYERS.get(type(layer).__name__)
        leaves = shares_left(layer, family, sharded) if family is not None else set()
        for m in layer.modules():
            if multiplies_dense(m):
                (left if m in leaves else others).add(tuple(m.weight.shape))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        others.add(tuple(head.weight.shape))
    return left - others


def _configs_at(times: dict, configs) -> dict[str, float]:
    names = {str(c) for c in configs}
    return {c: t for c, t in times.items() if c in names}


def time_all(linears: dict[tuple[int, int], nn.Linear], timer_for: Callable, rows=skinny.ROWS,
             configs=skinny.CONFIGS, gated: dict | None = None, normed: dict | None = None,
             unsummed: set | frozenset = frozenset()) -> dict[str, dict[str, dict[str, float]]]:
    """{"NxK": {rows: {"torch": s, config: s}}}: seconds a call, F.linear and each config that runs.
    `timer_for(linear)` gives a timer (rows, "torch" | Config) -> seconds (`skinny.cuda_timer` on a GPU; a
    test passes made-up figures); a config that raises (cannot compile here) is left out, and one that does not
    take that many rows (`skinny.runs`: the broadcast configs above 8) is not timed.

    Then each down projection of `gated` (`gated_downs`, the shapes among `linears`) as it runs, under
    "NxK silu": "torch" is act_mul then the plain shape's pick (F.linear where none), the others the
    PROLOGUE_TRIES fastest plain configs at that row count with the activation in their prologue;
    `timer_for(linear, plain, "silu")` gives that timer, `plain` the plain shape's picks {rows: Config}. And
    so each linear of `normed` (`normed_linears`) under "NxK norm": add_rms_norm then the plain pick, against
    the configs with the norm in their prologue (`timer_for(linear, plain, "norm")`). A shape of `unsummed`
    (`unsummed_shapes`) is timed as it runs, a split config's partials left for the norm after it:
    `timer_for(linear, ..., unsummed=True)`."""
    figures = {}

    def timer_of(m, *args):
        return timer_for(m, *args, unsummed=True) if tuple(m.weight.shape) in unsummed else timer_for(m, *args)

    for (n, k), m in linears.items():
        timer = timer_of(m)
        per_rows = figures[f"{n}x{k}"] = {}
        for r in rows:
            times = per_rows[str(r)] = {"torch": timer(r, "torch")}
            for cfg in (c for c in configs if skinny.runs(c, r)):
                try:
                    times[str(cfg)] = timer(r, cfg)
                except Exception:  # noqa: BLE001 - a config this device cannot compile: not a candidate
                    continue
    by_name = {str(c): c for c in configs}
    for prologue, modules in ((GATED, gated), (NORMED, normed)):
        for (n, k), m in (modules or {}).items():
            plain = figures.get(f"{n}x{k}")
            if plain is None:  # not among the decode linears: the decoder calls it as a module
                continue
            timer = timer_of(m, pick({f"{n}x{k}": plain}, configs).get((n, k), {}), prologue)
            per_rows = figures[f"{n}x{k} {prologue}"] = {}
            for r in rows:
                times = per_rows[str(r)] = {"torch": timer(r, "torch")}
                fastest = sorted((t, c) for c, t in _configs_at(plain[str(r)], configs).items())[:PROLOGUE_TRIES]
                for _t, name in fastest:
                    try:
                        times[name] = timer(r, by_name[name])
                    except Exception:  # noqa: BLE001 - this variant does not launch here (more shared memory)
                        continue
    return figures


def pick(figures: dict, configs=skinny.CONFIGS, margin: float = MARGIN) -> dict[tuple, dict[int, skinny.Config]]:
    """{(N, K): {rows: Config}} (a gated down projection's under `gated_key`, a normed linear's under
    `normed_key`): for each shape and row count, the fastest config where it beats the "torch" figure by
    `margin`; none elsewhere."""
    by_name = {str(c): c for c in configs}
    picks = {}
    for shape, per_rows in figures.items():
        dims, *prologue = shape.split(" ")
        n, k = (int(v) for v in dims.split("x"))
        for r, times in per_rows.items():
            timed = _configs_at(times, configs)
            best = min(timed, key=timed.get, default=None)
            if best is not None and timed[best] < times["torch"] * (1 - margin):
                picks.setdefault((n, k, *prologue), {})[int(r)] = by_name[best]
    return picks


def line(picks: dict, shapes: int, rows=skinny.ROWS) -> str:
    """The record's value: how many of the shapes take the skinny kernel at each row count (the plain shapes:
    the gated and normed picks are in the reason)."""
    plain = [p for shape, p in picks.items() if len(shape) == 2]
    if not plain:
        return "torch"
    counts = [sum(r in p for p in plain) for r in rows]
    return "skinny for " + ", ".join(f"{c} of {shapes} shapes at {r} row{'s' if r > 1 else ''}"
                                     for c, r in zip(counts, rows))


def detail(picks: dict) -> str:
    """Each picked shape's configs by row count, for the record's reason ("NxK silu": a down projection with
    the activation in its prologue; "NxK norm": a linear with the add + RMSNorm before it in its prologue)."""
    return "; ".join(f"{n}x{k}{' ' + rest[0] if rest else ''}: " + ", ".join(f"{r}:{c}" for r, c in sorted(p.items()))
                     for (n, k, *rest), p in sorted(picks.items(), key=lambda item: (item[0][:2], len(item[0]))))


def key(linears: dict, device: str, gated: dict | None = None, normed: dict | None = None,
        unsummed: set | frozenset = frozenset()) -> dict:
    """What the figures depend on: the device (its name), the software, the shapes (with their dtype and
    bias), the gated down projections, the normed linears and the shapes timed unsummed, the candidates and
    the kernel's source."""
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__ if HAS_TRITON else None,
            "linears": sorted(f"{n}x{k} {str(m.weight.dtype).removeprefix('torch.')}{' bias' if m.bias is not None else ''}"
                              for (n, k), m in linears.items()),
            "gated": sorted(f"{n}x{k}" for n, k in (gated or {})),
            "normed": sorted(f"{n}x{k}" for n, k in (normed or {})), "prologue_tries": PROLOGUE_TRIES,
            "unsummed": sorted(f"{n}x{k}" for n, k in unsummed),
            "rows": list(skinny.ROWS), "configs": [str(c) for c in skinny.CONFIGS],
            "kernel": kept.source_digest(Path(skinny.__file__))}


def measured(linears: dict, device: str, cache: str | Path | None, timer_for: Callable,
             gated: dict | None = None, normed: dict | None = None,
             unsummed: set | frozenset = frozenset()) -> tuple[dict, bool]:
    """(figures, whether they were kept from an earlier engine): the kept ones for this key (`device` the
    device's name), else timed now through `timer_for` (see `time_all`) and kept under `cache` (engine/kept.py)."""
    return kept.measured("gemv", key(linears, device, gated, normed, unsummed), cache,
                         lambda: time_all(linears, timer_for, gated=gated, normed=normed, unsummed=unsummed))
