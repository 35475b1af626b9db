"""Our tensor-parallel plan: which slice of every weight a rank holds, read from the safetensors files.

Why our own (and not transformers' `tp_plan`): the split must be one we can state, count in
`svrmad plan`, run inside a replica's own process group, and read slice by slice from the files, so a
rank never holds (or reads) the whole checkpoint.

The plan, per decoder layer (docs/plan.md, "Tensor parallel"):
* attention split by heads: q/k/v rows (and their biases) by whole query and KV heads, o_proj by the
  matching input columns; o_proj's bias, if any, on the group's first rank only (it is added once);
* a dense MLP (and a shared expert) column/row: gate/up rows, down columns;
* routed experts split inside each expert (every rank holds a 1/tp slice of every expert's
  intermediate columns), not by expert: the work of a step is the same on every rank whatever the
  router picks, and the layer still needs one all-reduce;
* everything else whole on every rank: embeddings, norms (Qwen3's per-head q/k norms too), the
  router, the LM head.
The attention block and the MLP block each end in one all-reduce of the hidden state (engine/tp.py
hooks them): 2 collectives a layer, of hidden_size values a token.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from svrmad_local.engine.tp import Group, reduce_outputs
from svrmad_local.models.plan import PlanError, check_tp_heads
from svrmad_local.models.quant.formats import read_index

# the architectures the plan covers, by config.model_type (their modules' names are the rules' names)
PLANNED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

# (parameter name pattern, how it splits); unmatched parameters are whole on every rank
RULES = [
    (re.compile(r"self_attn\.[qkv]_proj\.(weight|bias)$"), "rows"),
    (re.compile(r"self_attn\.o_proj\.weight$"), "cols"),
    (re.compile(r"self_attn\.o_proj\.bias$"), "first"),
    (re.compile(r"mlp\.(shared_experts?\.)?(gate|up)_proj\.weight$"), "rows"),
    (re.compile(r"mlp\.(shared_experts?\.)?down_proj\.weight$"), "cols"),
    (re.compile(r"mlp\.experts\.gate_up_proj$"), "expert_gate_up"),
    (re.compile(r"mlp\.experts\.down_proj$"), "expert_down"),
]


def split_of(name: str) -> str:
    """How parameter `name` splits: rows, cols, first (the first rank's only), expert_gate_up,
    expert_down, or whole."""
    return next((how for pattern, how in RULES if pattern.search(name)), "whole")


def check_planned(config) -> None:
    kind = getattr(config, "model_type", "?")
    if kind not in PLANNED:
        raise PlanError(f"--tp over a {kind} model is not planned yet (the tensor-parallel plan covers "
                        f"{', '.join(PLANNED)}); run it with --tp 1, data parallel, or --device-map auto")


class Slices:
    """The folder's tensors by name, each file opened once; reads the part of a tensor a rank needs."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.index = read_index(path)
        self._open = {f: safe_open(f, "pt") for f in {i.file for i in self.index.values()}}
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def read(self, key: str, dim: int | None = None, part: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `key`, or its rows/columns [part[0], part[1]) along `dim` (only those bytes are read)."""
        if key not in self.index:
            raise PlanError(f"weight {key} is missing from the checkpoint")
        self.used.add(key)
        s = self._open[self.index[key].file].get_slice(key)
        if dim is None:
            return s[:]
        index = [slice(None)] * len(self.index[key].shape)
        index[dim] = slice(*part)
        return s[tuple(index)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.index[key].shape)


def _part(size: int, group: Group, name: str) -> tuple[int, int]:
    if size % group.size:
        raise PlanError(f"--tp {group.size} does not divide {name} ({size} rows or columns to split); use a "
                        f"--tp that divides {size}")
    n = size // group.size
    return group.rank * n, (group.rank + 1) * n


def _expert_keys(files: Slices, name: str, n: int) -> list[str] | None:
    """Per-expert keys as published (`experts.{e}.gate_proj.weight`), or None when the file holds the
    fused tensor under the parameter's own name."""
    if name in files:
        return None
    parent, leaf = name.rsplit(".", 1)
    projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    return [f"{parent}.{e}.{p}.weight" for e in range(n) for p in projs]


def read_part(files: Slices, name: str, shape: tuple[int, ...], group: Group) -> torch.Tensor:
    """This rank's part of parameter `name`, whose whole shape is `shape`."""
    how = split_of(name)
    if how == "whole":
        return files.read(name)
    if how in ("rows", "cols"):
        dim = 0 if how == "rows" else len(shape) - 1
        return files.read(name, dim, _part(shape[dim], group, name))
    if how == "first":
        value = files.read(name)
        return value if group.rank == 0 else torch.zeros_like(value)
    experts = shape[0]
    keys = _expert_keys(files, name, experts)
    if how == "expert_gate_up":  # [E, 2I, H]: this rank's rows of the gate half and of the up half
        half = shape[1] // 2
        a, b = _part(half, group, name + " (each expert's intermediate size)")
        if keys is None:
            return torch.cat([files.read(name, 1, (a, b)), files.read(name, 1, (half + a, half + b))], 1)
        return torch.stack([torch.cat([files.read(keys[2 * e], 0, (a, b)), files.read(keys[2 * e + 1], 0, (a, b))])
                            for e in range(experts)])
    a, b = _part(shape[2], group, name + " (each expert's intermediate size)")  # expert_down: [E, H, I]
    if keys is None:
        return files.read(name, 2, (a, b))
    return torch.stack([files.read(k, 1, (a, b)) for k in keys])


def load_sharded(path: Path, config, dtype: torch.dtype, device: str | None, group: Group) -> nn.Module:
    """The model of `path` with this rank's part of every weight, on `device`, its attention and MLP
    blocks reducing over `group` (every rank of the group calls this)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    check_planned(config)
    check_tp_heads(config.to_dict(), group.size)
    files = Slices(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    done: dict[int, nn.Parameter] = {}  # tied weights: one tensor, read once
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                value = read_part(files, prefix + pname, tuple(p.shape), group)
                done[id(p)] = nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=False)
            mod._parameters[pname] = done[id(p)]
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
    unused = sorted(set(files.index) - files.used)
    if unused:
        raise PlanError(f"checkpoint {path} does not match its config.json: {len(unused)} weights not used by the "
                        f"config's architecture (e.g. {', '.join(unused[:3])})")
    for layer in model.base_model.layers:
        reduce_outputs(layer.self_attn, group)
        reduce_outputs(layer.mlp, group)
    model.svrmad_tp = group
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except Exception:  # no generation_config.json: the one from_config made stays
        pass
    return model.to(device).eval()
