"""How a linear runs: one place decides it, once, when the engine is built (and again if the run's
own steps want another backend: engine/relinear.py).

- "aten": each module's own forward (`F.linear`: MKL sgemm on the CPU, cuBLAS on a GPU).
- "panels": CPU, fp32 and bf16, AVX2 and up. Every `nn.Linear` weight is re-laid once into 16-column
  panels and multiplied by our kernel (kernels/cpu_linear.py), which streams the weights at close to the
  machine's read bandwidth; bf16 runs AMX tiles or avx512_bf16 where the CPU has them, two FMAs a pair
  elsewhere (the figures, with the machines: docs/engine.md, "CPU linears"). Its arithmetic does not
  depend on the batch, so a row's output is bitwise the same at any batch size. A tied LM head and its
  embedding share one panel matrix: the embedding reads its rows from the panels (an exact copy).
- "onednn": CPU, fp32 or bf16. Every weight is reordered once into oneDNN's blocked layout and the
  module computes with `mkldnn._linear_pointwise` (the pair that inductor's freezing pass uses, and
  what vLLM's CPU backend does): at M = 1-64 MKL's fp32 GEMM runs several times slower than that, on
  AVX2 and AVX-512 alike (benchmarks/bench_linear.py prints the ratio). A tied LM head runs through oneDNN on the dense
  matrix it shares with the embedding (no second copy).
- "auto": where more than one backend can run on the CPU, the one measured fastest on this machine
  for the expected workload (models/calibrate.py: a few seconds once per machine, cached), weighed
  again by the run's own steps; with SVRMAD_CALIBRATE=0, the panels where the kernel builds, else
  oneDNN (bf16 with a oneDNN bf16 path); else F.linear, saying why.
- Packed quantized modules (models/quant: MXFP4 experts, FP8 linears) are not `nn.Linear`s: they
  own their matmul and are left alone here.

Either layout *replaces* the dense weight (same bytes; `relayout` moves a model from one to another,
exact copies). oneDNN packs bf16 only where it has a bf16 path on this CPU (avx512_bf16 / AMX /
avx_ne_convert); the panels pack bf16 on any AVX2 CPU. Numerics move at fp32 rounding level against
F.linear (another summation order), so exactness is stated against a reference that runs the same
backend; see docs/engine.md, "CPU linears".
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from svrmad_local.kernels import cpu_linear

from . import calibrate
from .layouts import DENSE, ONEDNN, PANELS, Layout, sibling_groups

log = logging.getLogger("svrmad_local")

CHOICES = ("auto", "panels", "onednn", "aten")
FUSE_DEVICES = ("cuda",)  # where "auto" fuses sibling projections on their plain weights (layouts.DENSE)


@dataclass(frozen=True)
class Selection:
    """What select_linear put in place: `value` names the layout ("panels", "oneDNN packed", "aten"),
    `line` says it in one line with the reason, `fell_back`: "auto" on a CPU could not pack."""
    value: str
    line: str
    fell_back: bool = False


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives in a packed layout. `weight` keeps its dtype and device (code
    that asks `.weight.dtype` or `.device` still works) but not a plain matrix's layout: any other use
    fails loudly rather than computing with a layout it does not understand. Unpacked (a tied LM head
    beside an embedding that needs the dense rows), it runs oneDNN on the very same dense Parameter."""

    def __init__(self, linear: nn.Linear, layout: Layout, pack: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.layout = layout if pack else ONEDNN
        self.packed = pack
        self.weight = nn.Parameter(layout.pack(linear.weight.detach()), requires_grad=False) if pack \
            else linear.weight
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.mm(x, self.weight, self.bias, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return self.layout.unpack(self.weight, self.out_features, self.in_features) if self.packed else self.weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """state_dict() and save_pretrained() see the plain weight, so a packed model saves as usual."""
        destination[prefix + "weight"] = self.dense_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias.detach()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.layout.name if self.packed else 'oneDNN on the dense weight'}")


class PanelEmbedding(nn.Module):
    """A plain `nn.Embedding` whose matrix is the tied LM head's panels: lookups copy rows out of
    the panels (the same values), so the head streams its packed layout and no dense copy is kept."""

    def __init__(self, emb: nn.Embedding, head: PackedLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = emb.num_embeddings, emb.embedding_dim, emb.padding_idx
        self.weight = head.weight  # the same Parameter: tied, counted once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_linear.rows_of(self.weight, ids, self.embedding_dim)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = cpu_linear.unpack(self.weight, self.num_embeddings, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from the tied LM head's panels"


class FusedGroup(nn.Module):
    """Sibling projections of one input (q/k/v, gate/up, DeepSeek's q_a/kv_a) packed as one matrix:
    one GEMM where there were two or three. At decode shapes a call's fixed cost is larger than a
    small projection's arithmetic, so fewer, larger calls win (docs/engine.md, "CPU linears").
    The first part called with an input computes every part's rows; its siblings, called with the same
    tensor (as transformers' modules do), take their slices of that result."""

    def __init__(self, linears: list[nn.Linear], layout: Layout):
        super().__init__()
        w = torch.cat([m.weight.detach() for m in linears])
        self.in_features, self.out_features, self.layout = w.shape[1], w.shape[0], layout
        self.weight = nn.Parameter(layout.pack(w), requires_grad=False)
        biases = [m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features) for m in linears]
        has_bias = any(m.bias is not None for m in linears)
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if has_bias else None
        ends = torch.tensor([m.out_features for m in linears]).cumsum(0).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))
        # the input being served and its fused output, held only until every part has taken its slice
        # (holding `x` also keeps its identity from being reused by another tensor meanwhile)
        self._x = self._out = None
        self._taken: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every part's rows at once (what `part` computes on a new input)."""
        return self.layout.mm(x, self.weight, self.bias, self.out_features)

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._x or i in self._taken:
            self._out = self(x)
            self._x, self._taken = x, set()
        out = self._out[..., slice(*self.bounds[i])]
        self._taken.add(i)
        if len(self._taken) == len(self.bounds):
            self._x = self._out = None
        return out

    def dense_weight(self) -> torch.Tensor:
        return self.layout.unpack(self.weight, self.out_features, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # each part saves its own rows under its own name


class FusedPart(nn.Module):
    """One projection of a FusedGroup, under the name and with the interface of the nn.Linear it replaced."""

    def __init__(self, group: FusedGroup, i: int, linear: nn.Linear):
        super().__init__()
        self.group, self.i = group, i
        self.in_features, self.out_features, self.has_bias = linear.in_features, linear.out_features, linear.bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.i, x)

    def dense_weight(self) -> torch.Tensor:
        lo, hi = self.group.bounds[self.i]
        return self.group.dense_weight()[lo:hi]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        lo, hi = self.group.bounds[self.i]
        destination[prefix + "weight"] = self.dense_weight()
        if self.has_bias:
            destination[prefix + "bias"] = self.group.bias.detach()[lo:hi]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows {self.group.bounds[self.i]} of a fused {self.group.layout.name} GEMM"


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The weight of any linear as a plain [out, in] matrix (packed or quantized ones unpack)."""
    return linear.dense_weight() if hasattr(linear, "dense_weight") else linear.weight


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights really take: packed modules count their packed bytes, tied
    tensors count once, a packed weight counts its packed bytes (oneDNN's as the dense one it
    replaced, panels with up to 15 zero columns of padding)."""
    seen, total = set(), 0
    for m in model.modules():
        if hasattr(m, "packed_bytes"):
            total += m.packed_bytes()
            seen.update(id(t) for t in (*m.parameters(), *m.buffers()))  # packed tensors are buffers
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for b in model.buffers():
        if id(b) not in seen:
            seen.add(id(b))
            total += b.numel() * b.element_size()
    return total


def _why_not_onednn(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"weights on {device.type}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ("bf16 weights on a CPU without a oneDNN bf16 path (no avx512_bf16/AMX): bf16 GEMMs run ~3x "
                "slower than fp32 here, load with --dtype fp32")
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} weights (oneDNN packs fp32 and bf16)"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "tensor-parallel (DTensor) weights"
    return None


def _why_not_panels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"weights on {device.type}"
    if dtype not in cpu_linear.DTYPES:
        return f"{str(dtype).removeprefix('torch.')} weights (the panel kernel takes fp32 and bf16)"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "tensor-parallel (DTensor) weights"
    if not cpu_linear.available():
        return f"no panel kernel: {cpu_linear.unavailable_reason()}"
    return None


def select_linear(model: nn.Module, choice: str = "auto", fuse: bool = True,
                  workload: calibrate.Workload | None = None, cache: str | None = None) -> Selection:
    """Apply the linear backend `choice` to `model` in place, once; returns what runs (`Selection`,
    its line also logged at info level). `fuse`: sibling projections of one input become one GEMM
    (FusedGroup). "auto" on a CPU where several backends can run takes the one measured fastest for
    `workload` (models/calibrate.py, its figures cached under `cache`, the --cache-dir;
    `calibrate.recorded(model)` holds the figures)."""
    if choice not in CHOICES:
        raise ValueError(f"linear must be one of {', '.join(CHOICES)}, got {choice!r}")
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    packed_q = sum(1 for m in model.modules() if hasattr(m, "packed_bytes"))
    done = [m for m in model.modules() if isinstance(m, (PackedLinear, FusedPart))]
    if done:  # an earlier engine on this model packed it (packing is in place and one-way)
        layout = done[0].group.layout if isinstance(done[0], FusedPart) else done[0].layout
        if choice not in ("auto", layout.choice):
            raise ValueError(f"linear={choice!r}: this model's linears were packed as {layout.name} by an earlier "
                             f"engine; load the model again to run them another way")
        return _said(layout.name, f"{layout.name} ({len(done)} linears, packed by an earlier engine)", packed_q)
    if choice == "aten" or not linears:
        what = "aten (F.linear)" + (", as asked" if choice == "aten" else ": no nn.Linear to pack")
        return _said("aten", what, packed_q)
    p = linears[0][1].weight
    why_panels = _why_not_panels(model, p.device, p.dtype) if choice in ("auto", "panels") else "not asked"
    why = why_panels if choice == "panels" else _why_not_onednn(model, p.device, p.dtype)
    measured = ""
    if choice == "auto" and p.device.type == "cpu" and (why_panels is None or why is None) and calibrate.enabled():
        # more than one backend can run: the measured one (models/calibrate.py) rather than a fixed rule
        cal = calibrate.calibrate(model, [b for b, w in (("panels", why_panels), ("onednn", why), ("aten", None))
                                          if w is None], workload, fuse, cache=cache)
        setattr(model, calibrate.RECORD, cal)
        if cal.choice == "aten":
            return _said("aten", f"aten (F.linear), {cal.reason}", packed_q)
        why_panels = why_panels if cal.choice == "panels" else "calibrated"
        measured = f"; {cal.reason}"
    if why_panels is None:
        layout = PANELS
    elif why is None:
        layout = ONEDNN
    elif choice == "auto" and p.device.type != "cpu":  # cuBLAS and the like: packing is a CPU matter
        return fuse_dense(model, packed_q) if fuse and p.device.type in FUSE_DEVICES \
            else _said("aten", f"aten (F.linear): weights on {p.device.type}", packed_q)
    elif choice == "auto":
        return _said("aten", f"aten (F.linear): packing is off: {why}", packed_q, fell_back=True)
    else:
        raise ValueError(f"linear={choice!r} cannot run here: {why}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and emb is not None and head.weight is emb.weight

    groups = sibling_groups(model, linears) if fuse else []
    fused = {name for g in groups for name, _ in g}
    for g in groups:
        group = FusedGroup([m for _, m in g], layout)
        for i, (name, m) in enumerate(g):
            _put(model, name, FusedPart(group, i, m))
    # a tied head is packed only where the embedding can read its rows from the packed matrix: the
    # panels of a plain nn.Embedding (Gemma's scaled embedding, a max_norm that rewrites rows, and
    # oneDNN's opaque layout cannot)
    shared = tied and layout is PANELS and type(emb) is nn.Embedding and emb.max_norm is None
    note = ""
    for name, m in linears:
        if name not in fused:
            _put(model, name, PackedLinear(m, layout, pack=not tied or m is not head or shared))
            if shared and m is head:
                emb_name = next(n for n, mod in model.named_modules() if mod is emb)
                _put(model, emb_name, PanelEmbedding(emb, model.get_output_embeddings()))
                note = "; the tied LM head and the embedding share its panels"
            elif tied and m is head:
                note = "; the tied LM head on its shared dense weight"
    note = (f", as {len(linears) - len(fused) + len(groups)} GEMMs (q/k/v and gate/up fused)" if groups else "") + note
    return _said(layout.name, f"{layout.name} ({len(linears)} linears, {str(p.dtype).removeprefix('torch.')}){note}"
                              f"{measured}", packed_q)


def fuse_dense(model: nn.Module, packed_q: int = 0) -> Selection:
    """F.linear on the plain weights, sibling projections fused (layouts.DENSE): one kernel where a GPU's
    step launched two or three ("auto" on a GPU). A group's parts give up their weights as soon as the
    group holds its copy (moved to the meta device: the caller may still hold the modules), so the
    model's memory grows by one group at a time, not by every fused weight; the allocator's freed
    blocks go back before the KV pool is sized."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    if not linears:
        return _said(DENSE.name, "aten (F.linear): no nn.Linear to fuse", packed_q)
    device = linears[0][1].weight.device
    groups = sibling_groups(model, linears)
    holders = Counter(id(t) for m in model.modules() for t in m.parameters(recurse=False))
    for g in groups:
        group = FusedGroup([m for _, m in g], DENSE)
        for i, (name, m) in enumerate(g):
            _put(model, name, FusedPart(group, i, m))
            if all(holders[id(t)] == 1 for t in m.parameters()):  # a weight another module holds stays
                m.to("meta")
    if groups and device.type == "cuda":
        torch.cuda.empty_cache()
    fused = sum(len(g) for g in groups)
    note = f", as {len(linears) - fused + len(groups)} GEMMs (q/k/v and gate/up fused)" if groups else ""
    return _said(DENSE.name, f"aten (F.linear) on {device.type}{note}", packed_q)


def _put(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def unpack_all(model: nn.Module) -> None:
    """Plain nn.Linear modules again (and a plain nn.Embedding where it read a tied head's panels), in place,
    each from its packed weight (exact copies): what select_linear started from, for another layout."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    groups: dict[int, torch.Tensor] = {}

    def plain(m: nn.Module, weight: nn.Parameter, bias: torch.Tensor | None) -> nn.Linear:
        lin = nn.Linear(m.in_features, m.out_features, bias=bias is not None, device="meta")
        lin.weight = weight
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
        return lin

    shared = None  # the dense matrix a tied head and its embedding share again
    if isinstance(emb, PanelEmbedding):
        shared = nn.Parameter(cpu_linear.unpack(emb.weight, emb.num_embeddings, emb.embedding_dim), requires_grad=False)
        plain_emb = nn.Embedding(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, device="meta")
        plain_emb.weight = shared
        _put(model, next(n for n, mod in model.named_modules() if mod is emb), plain_emb)
    for name, m in list(model.named_modules()):
        if isinstance(m, FusedPart):
            g = m.group
            if id(g) not in groups:
                groups[id(g)] = g.dense_weight()
            lo, hi = g.bounds[m.i]
            bias = g.bias.detach()[lo:hi].clone() if m.has_bias else None
            _put(model, name, plain(m, nn.Parameter(groups[id(g)][lo:hi].clone(), requires_grad=False), bias))
            if m.i == len(g.bounds) - 1:  # the group's last part (siblings come in order): its dense copy goes
                del groups[id(g)]
        elif isinstance(m, PackedLinear):
            if shared is not None and m.packed and m.layout is PANELS and m.weight.data_ptr() == emb.weight.data_ptr():
                weight = shared  # the tied head: the embedding's dense matrix, one Parameter as before
            elif m.packed:
                weight = nn.Parameter(m.dense_weight(), requires_grad=False)
            else:
                weight = m.weight  # a tied head on its shared dense weight
            _put(model, name, plain(m, weight, None if m.bias is None else m.bias.detach()))


def relayout(model: nn.Module, choice: str) -> Selection:
    """The model's linears moved, in place, to the backend `choice` ("panels", "onednn", "aten") from the
    layout they are in: every weight unpacked (an exact copy) and packed again, one module at a time."""
    unpack_all(model)
    return select_linear(model, choice)


def _said(value: str, what: str, packed_q: int, fell_back: bool = False) -> Selection:
    if packed_q:
        what += f"; {packed_q} packed quantized modules compute with their own kernels"
    log.info("linear backend: %s", what)
    return Selection(value, what, fell_back)
