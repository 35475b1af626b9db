"""Where a packed linear's weight lives and how it multiplies: the layouts `select_linear` (linear.py)
packs into and `calibrate` (calibrate.py) times, and which projections of a layer read one input (fused
into one GEMM). Both modules read them from here, so neither imports the other's internals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from svrmad_local.kernels import cpu_linear

BATCH_HINT = 24  # oneDNN picks its blocking for this M; other M's build their own primitive once
_reorder = torch.ops.mkldnn._reorder_linear_weight  # a module attribute, so a test can count the calls


@dataclass(frozen=True)
class Layout:
    """A packed weight's layout: how a dense [N, K] weight becomes it (`pack`), how it multiplies
    (`mm(x, packed, bias, N)`) and how it comes back dense (`unpack(packed, N, K)`)."""

    name: str
    choice: str  # its EngineConfig.linear value
    pack: Callable
    mm: Callable
    unpack: Callable


def _onednn_mm(x, w, bias, n):
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


ONEDNN = Layout("oneDNN packed", "onednn", lambda w: _reorder(w, BATCH_HINT), _onednn_mm, lambda w, n, k: w.to_dense())
PANELS = Layout("panels", "panels", lambda w: cpu_linear.pack(w), lambda x, w, bias, n: cpu_linear.linear(x, w, n, bias),
                cpu_linear.unpack)
# Not a packing: siblings fused on their plain weights, multiplied by F.linear (cuBLAS) or, at decode's few
# rows, the skinny kernel (engine/gemv.py). What "auto" does on a GPU, where a step's launches cost more
# than a small projection's reads: q, k and v as one kernel instead of three.
DENSE = Layout("aten", "aten", lambda w: w, lambda x, w, bias, n: F.linear(x, w, bias), lambda w, n, k: w)


def multiplies_dense(m: nn.Module) -> bool:
    """Whether m is `F.linear` over a plain [out, in] `m.weight` (and `m.bias`): an nn.Linear, or siblings
    fused on their plain weights (a FusedGroup laid out DENSE). What the skinny kernel can run instead."""
    return type(m) is nn.Linear or getattr(m, "layout", None) is DENSE


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"))


def sibling_groups(model: nn.Module, linears: list[tuple[str, nn.Linear]]) -> list[list[tuple[str, nn.Linear]]]:
    """Sets of plain linears under one parent that read one input (SIBLINGS), same in_features, dtype and
    device, none under an accelerate hook (a hook moves the input to its module's device and back: a fused
    group would skip it)."""
    by_name = dict(linears)
    groups = []
    for parent, _ in model.named_modules():
        for names in SIBLINGS:
            full = [f"{parent}.{n}" if parent else n for n in names]
            ms = [by_name.get(f) for f in full]
            if all(m is not None and not hasattr(m, "_hf_hook") for m in ms) \
                    and len({(m.in_features, m.weight.dtype, m.weight.device) for m in ms}) == 1:
                groups.append(list(zip(full, ms)))
    return groups
