"""Our tensor-parallel plan: which slice of every weight a rank holds, read from the safetensors files.

Why our own (and not transformers' `tp_plan`): the split must be one we can state, count in
`svrmad plan`, run inside a replica's own process group, keep packed (MXFP4, FP8) weights packed, and
read slice by slice from the files, so a rank never holds (or reads) the whole checkpoint.

The plan, per decoder layer (docs/plan.md, "Tensor parallel", says why):
* attention split by heads: q/k/v rows (and biases, GPT-OSS's sinks) by whole query and KV heads,
  o_proj by the matching input columns, its bias on the group's first rank only (added once).
  DeepSeek's MLA: q_b_proj and kv_b_proj rows by heads, o_proj columns; q_a, kv_a (the latent) and
  their norms whole, so every rank computes and caches the same latent;
* a dense MLP and a shared expert column/row: gate/up rows, down columns;
* routed experts by expert (expert parallel): rank r holds experts [r E/T, (r+1) E/T) whole, and
  the router's picks of other ranks' experts are skipped on this rank;
* everything else whole on every rank: embeddings, norms, the router, the LM head.
The rules are models/tp_plan.py's table (which `svrmad plan` counts from).
A packed weight is cut only on its block grid (FP8: weight_block_size; MXFP4 experts are cut by
expert, never inside), and its scales are cut with it. The attention block and the MLP block each
end in one all-reduce of the hidden state (engine/tp.py hooks them): 2 collectives a layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from svrmad_local.dist import Group, lost_rank
from svrmad_local.models import hf
from svrmad_local.models.plan import PlanError, check_planned, check_tp_heads
from svrmad_local.models.quant.formats import QuantSpec, Reader
from svrmad_local.models.quant.load import PACKED_DTYPES, _check_unused, _pack, meta_model
from svrmad_local.models.tp_plan import SCALE, split_of

@dataclass(frozen=True)
class Cut:
    """This rank's part of a tensor: [start, stop) along `dim`; `first`: whole on rank 0, zeros on the others."""

    dim: int = 0
    start: int = 0
    stop: int = 0
    first: bool = False


def _part(size: int, group: Group, what: str) -> tuple[int, int]:
    if size % group.size:
        raise PlanError(f"--tp {group.size} does not divide {what} ({size}); use a --tp that divides {size}")
    n = size // group.size
    return group.rank * n, (group.rank + 1) * n


def plan_cuts(model: nn.Module, group: Group, block) -> dict[str, Cut]:
    """The cut of every split tensor (parameters and buffers) of the full-size meta model."""
    cuts: dict[str, Cut] = {}
    for mod_name, mod in model.named_modules():
        tensors = {**dict(mod.named_parameters(recurse=False)), **dict(mod.named_buffers(recurse=False))}
        for leaf, t in tensors.items():
            name = f"{mod_name}.{leaf}"
            how = split_of(name)
            if how == "whole":
                continue
            if how == "first":
                cuts[name] = Cut(first=True)
                continue
            if how == "experts":
                cuts[name] = Cut(0, *_part(t.shape[0], group, f"the {t.shape[0]} experts of {mod_name}"))
                continue
            scale = leaf.endswith(SCALE)
            values = tensors[leaf[: -len(SCALE)]].shape if scale else t.shape  # the weight the scales go with
            dim = 0 if how == "rows" else len(values) - 1
            a, b = _part(values[dim], group, f"{mod_name}'s {values[dim]} {'rows' if dim == 0 else 'columns'}")
            if scale or (t.dtype in PACKED_DTYPES and f"{leaf}{SCALE}" in tensors):
                unit = block[0 if dim == 0 else 1]
                if (b - a) % unit:  # every rank refuses alike (the first's part starts on a block too)
                    raise PlanError(f"--tp {group.size} cuts the {block[0]}x{block[1]} FP8 blocks of {mod_name} "
                                    f"({values[dim]} {'rows' if dim == 0 else 'columns'} give {b - a} a rank); "
                                    f"use a --tp that keeps {values[dim]} / tp a multiple of {unit}")
                if scale:
                    a, b = a // unit, -(-b // unit)
            cuts[name] = Cut(dim, a, b)
    return cuts


def _shrink(model: nn.Module, cuts: dict[str, Cut]) -> None:
    """Every cut tensor of the meta model takes its local shape, and the modules their local sizes."""
    for mod_name, mod in model.named_modules():
        for store in (mod._parameters, mod._buffers):
            for leaf, t in list(store.items()):
                c = cuts.get(f"{mod_name}.{leaf}")
                if t is None or c is None or c.first:
                    continue
                shape = list(t.shape)
                shape[c.dim] = c.stop - c.start
                local = torch.empty(shape, dtype=t.dtype, device="meta")
                store[leaf] = nn.Parameter(local, requires_grad=False) if isinstance(t, nn.Parameter) else local
        if isinstance(getattr(mod, "weight", None), torch.Tensor) and hasattr(mod, "in_features"):
            mod.out_features, mod.in_features = mod.weight.shape  # nn.Linear and Fp8Linear
        mine = [c for n, c in cuts.items() if n.rpartition(".")[0] == mod_name]
        if mine and split_of(mod_name + ".") == "experts":
            mod.num_experts = mine[0].stop - mine[0].start
            # transformers' grouped/batched experts then mask the padding rows they leave unwritten
            mod._is_expert_parallel = True
            mod.register_forward_pre_hook(_local_experts(mine[0].start, mod.num_experts), with_kwargs=True)


def _local_experts(offset: int, count: int):
    """Router picks -> this rank's expert numbers; another rank's expert becomes the padding index
    (`count`), which every experts module here skips."""

    def hook(_mod, args, kwargs):
        args = list(args)
        index = args[1] if len(args) > 1 else next(kwargs[k] for k in ("top_k_index", "router_indices") if k in kwargs)
        local = index - offset
        local = torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))
        if len(args) > 1:
            args[1] = local
        else:
            kwargs["top_k_index" if "top_k_index" in kwargs else "router_indices"] = local
        return tuple(args), kwargs

    return hook


class Slices(Reader):
    """The checkpoint's tensors, read a cut at a time (only those bytes leave the file)."""

    def read(self, key: str, cut: Cut | None = None) -> torch.Tensor:
        from safetensors import safe_open

        info = self.index.get(key)
        if info is None:
            raise PlanError(f"weight {key} is missing from the checkpoint")
        if info.file not in self._open:
            self._open[info.file] = safe_open(info.file, "pt")
        self.used.add(key)
        s = self._open[info.file].get_slice(key)
        if cut is None or cut.first:
            return s[:]
        index = [slice(None)] * len(info.shape)
        index[cut.dim] = slice(cut.start, cut.stop)
        return s[tuple(index)]

    def expert_keys(self, name: str, count: int) -> list[list[str]] | None:
        """Per expert, the published keys that make tensor `name` of a fused experts module
        (`experts.{e}.gate_proj.weight` and `.up_proj.weight` for gate_up_proj, ...); None when the file
        holds `name` itself."""
        if name in self:
            return None
        parent, leaf = name.rsplit(".", 1)
        proj, scale, _ = leaf.partition(SCALE)
        projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
        return [[f"{parent}.{e}.{p}.weight{scale}" for p in projs] for e in range(count)]


def read_tensor(files: Slices, name: str, full: tuple[int, ...], cut: Cut | None, rank: int) -> torch.Tensor:
    """This rank's part of model tensor `name` (full shape `full`) from the files."""
    keys = files.expert_keys(name, full[0]) if len(full) == 3 and split_of(name) == "experts" else None
    if keys is None:
        value = files.read(name, cut)
        return torch.zeros_like(value) if cut is not None and cut.first and rank else value
    files.used.update(k for ks in keys for k in ks if k in files)  # other ranks read the other experts
    mine = keys[cut.start: cut.stop] if cut is not None else keys
    return torch.stack([torch.cat([files.read(k) for k in ks]) for ks in mine])


def meta_split(config, dtype: torch.dtype, group: Group, spec: QuantSpec | None, files: Reader):
    """This rank's model on the meta device: built from `config`, packed where `files` (names and
    dtypes only) hold packed weights, each split tensor at its local shape. Returns (model, the full
    shape of every tensor, the cuts). Refuses, in one line, a split the plan cannot make."""
    check_planned(config.model_type, spec is not None)
    check_tp_heads(config.to_dict(), group.size)
    model = meta_model(config, dtype)
    model.tie_weights()  # a tied LM head is the embedding's tensor: read once, from the embedding's name
    if spec is not None:
        _pack(model, files, spec, dtype)
    full = {n: tuple(t.shape) for n, t in [*model.named_parameters(remove_duplicate=False),
                                           *model.named_buffers(remove_duplicate=False)]}
    cuts = plan_cuts(model, group, spec.block if spec is not None and spec.block else (1, 1))
    _shrink(model, cuts)
    return model, full, cuts


def load_sharded(path: Path, config, dtype: torch.dtype, device: str | None, group: Group,
                 spec: QuantSpec | None = None) -> nn.Module:
    """The model of `path` with this rank's part of every weight (packed weights kept packed), on
    `device`, its attention and MLP blocks reducing over `group` (every rank of the group calls this)."""
    files = Slices(Path(path))
    model, full, cuts = meta_split(config, dtype, group, spec, files)
    done: dict[int, torch.Tensor] = {}  # tied weights: one tensor, read once
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for store in (mod._parameters, mod._buffers):
            for leaf, t in list(store.items()):
                name = prefix + leaf
                if t is None or (store is mod._buffers and (leaf in mod._non_persistent_buffers_set or not t.is_meta)
                                 and name not in files):
                    continue
                if id(t) not in done:
                    value = read_tensor(files, name, full[name], cuts.get(name), group.rank)
                    if tuple(value.shape) != tuple(t.shape):
                        raise PlanError(f"weight {name} has shape {list(value.shape)} on this rank; the plan needs "
                                        f"{list(t.shape)} (the checkpoint does not match its config.json)")
                    raw = t.dtype in PACKED_DTYPES or leaf.endswith((SCALE, "_scales", "_blocks"))
                    if raw and value.dtype != t.dtype:
                        raise PlanError(f"packed tensor {name} is {value.dtype}; expected {t.dtype}")
                    value = value.to(device=device, dtype=None if raw else t.dtype)
                    done[id(t)] = nn.Parameter(value, requires_grad=False) if isinstance(t, nn.Parameter) else value
                store[leaf] = done[id(t)]
    _check_unused(model, files, config)
    for layer in model.base_model.layers:
        reduce_outputs(layer.self_attn, group)
        reduce_outputs(layer.mlp, group)
    model.svrmad_tp = group
    if spec is not None:
        model.svrmad_quantization = {"method": spec.method, "mode": "native", "block": spec.block}
    hf.load_generation_config(model, path)
    return model.to(device).eval()


def reduce_outputs(module: torch.nn.Module, group: Group) -> None:
    """Sum `module`'s output (a tensor, or a tuple whose first item is the tensor) over the group, in
    place, after every forward: the row-parallel end of an attention or MLP block."""

    def hook(_mod, _args, out):
        t = out[0] if isinstance(out, tuple) else out
        with lost_rank(group):
            dist.all_reduce(t, group=group.pg)
        return out

    module.register_forward_hook(hook)
