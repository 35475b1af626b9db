"""Building a model from a quantized folder with our own code: no transformers quantizer, no hub.

transformers builds the architecture on the meta device (its own modules, our attention hooks
unchanged); then every weight is read from the safetensors files by name:
* ``native``: the experts (MXFP4) and the FP8 linears are swapped for the packed modules of
  modules.py first, and their bytes are loaded as published;
* ``dequantize``: each packed weight is dequantized exactly (one expert or one matrix at a time)
  into the dtype asked for, and lands in transformers' own module, per-expert keys fused as
  transformers fuses them. Every weight ends in the dtype a plain checkpoint of the model gets.
A `device_map` is computed on the meta model with the packed modules as unsplittable units.
"""
from __future__ import annotations

import copy
import itertools
import re
from pathlib import Path

import torch
from torch import nn

from svrmad_local.models import hf

from .formats import MODES, QuantError, QuantSpec, Reader
from .modules import Fp8Experts, Fp8Linear, Mxfp4Experts

TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8,
                "F8_E4M3": torch.float8_e4m3fn}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
PACKED_DTYPES = (torch.uint8, torch.float8_e4m3fn)
NATIVE_DEVICES = ("cpu", "cuda")  # torch reference everywhere torch has fp8; Triton on cuda


def choose_mode(requested: str, spec: QuantSpec | None, device: str | None, tp: bool, device_map) -> tuple[str, str]:
    """(mode, why) for a checkpoint of `spec`; mode "plain" for an unquantized one."""
    if requested not in MODES:
        raise QuantError(f"quantization {requested!r}: use one of {', '.join(MODES)}")
    if spec is None:
        if requested == "native":
            raise QuantError("quantization 'native' asked for, but the checkpoint is not quantized (no "
                             "quantization_config in config.json); use auto")
        return "plain", "the checkpoint is not quantized"
    if tp and requested == "dequantize":
        raise QuantError(f"tensor parallelism over a {spec.method} checkpoint keeps the weights packed (each rank "
                         "reads its blocks and their scales); use --quantization native or auto")
    kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    if tp and kind not in NATIVE_DEVICES:
        raise QuantError(f"tensor parallelism over a {spec.method} checkpoint keeps the weights packed, which runs on "
                         f"{' and '.join(NATIVE_DEVICES)}, not {kind}")
    if kind not in NATIVE_DEVICES:
        if requested == "native":
            raise QuantError(f"quantization 'native' has no path on {kind} (packed {spec.method} runs on "
                             f"{' and '.join(NATIVE_DEVICES)}); use dequantize")
        if requested == "auto":
            return "dequantize", f"no packed {spec.method} path on {kind}"
    if requested == "dequantize":
        return "dequantize", "asked for"
    how = "Triton kernels when available" if kind == "cuda" else "the torch reference, one expert or matrix at a time"
    return "native", f"{'asked for' if requested == 'native' else 'a packed path exists'} on {kind} ({how})"


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    """transformers' model of `config` on the meta device (buffers real: RoPE tables), without its
    quantizer: our loading fills the weights."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    hf.apply_dtype_plan(model, dtype)
    return model


def load_quantized(path: Path, config, spec: QuantSpec, mode: str, dtype: torch.dtype, device: str | None,
                   device_map: str | dict | None = None):
    """The model of `path` with its weights native (packed) or dequantized into `dtype`, on `device`,
    or spread by `device_map` (accelerate's; a packed module always stays whole on one device)."""
    reader = Reader(path)
    model = meta_model(config, dtype)
    if mode == "native":
        _pack(model, reader, spec, dtype)
    placement = _placement(model, device_map) if device_map is not None else {"": torch.device(device or "cpu")}
    _fill(model, reader, spec, dtype, placement)
    _check_unused(model, reader, config)
    model.svrmad_quantization = {"method": spec.method, "mode": mode, "block": spec.block}
    hf.load_generation_config(model, path)
    if device_map is None:
        return model.to(device).eval()
    from accelerate import dispatch_model

    for name, b in list(model.named_buffers()):  # the non-persistent ones (RoPE tables) follow their module
        mod_name, _, bname = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._buffers[bname] = b.to(_device_of(name, placement))
    return dispatch_model(model, placement).eval()


def _placement(model: nn.Module, device_map) -> dict[str, torch.device | str]:
    """accelerate's device map for the (meta) model, refusing one that would cut a packed module."""
    from .modules import packed_modules

    packed = packed_modules(model)
    if isinstance(device_map, str):
        from accelerate.utils import get_balanced_memory, infer_auto_device_map

        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise QuantError(f"device_map {device_map!r}: use auto, balanced, balanced_low_0, sequential or a dict")
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        no_split += sorted({type(m).__name__ for m in packed.values()})
        memory = None if device_map == "sequential" else get_balanced_memory(
            model, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    for key, dev in device_map.items():
        cut = next((p for p in packed if key.startswith(p + ".")), None)
        if cut is not None:
            raise QuantError(f"device_map entry {key!r} cuts the packed module {cut}: its blocks and scales stay on "
                             "one device; map the whole module (or its layer)")
        if dev == "disk":
            raise QuantError(f"device_map puts {key or 'the model'} on disk; quantized checkpoints load to devices only")
    return dict(device_map)


def _device_of(name: str, placement: dict) -> torch.device | str:
    """The device of tensor `name`: the entry of its longest mapped prefix."""
    best = None
    for key in placement:
        if (key == "" or name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    if best is None:
        raise QuantError(f"device_map places no device for {name}")
    dev = placement[best]
    return f"cuda:{dev}" if isinstance(dev, int) else dev


# ----------------------------------------------------------------------------------- native


def _pack(model: nn.Module, reader: Reader, spec: QuantSpec, dtype: torch.dtype) -> None:
    """Swap the modules whose weights the checkpoint holds packed for the packed modules (meta)."""
    swaps = {}
    for name, m in model.named_modules():
        if spec.method == "mxfp4" and f"{name}.gate_up_proj_blocks" in reader:
            if not hasattr(m, "gate_up_proj_bias"):
                raise QuantError(f"{name}.gate_up_proj_blocks: MXFP4 blocks on a {type(m).__name__}, which is not "
                                 "a GPT-OSS experts module")
            for n in ("hidden_size", "intermediate_size"):
                if getattr(m, n) % 32:
                    raise QuantError(f"{name}: MXFP4 needs {n} to be a multiple of 32, got {getattr(m, n)}")
            swaps[name] = Mxfp4Experts(m.num_experts, m.hidden_size, m.intermediate_size, m.alpha, m.limit, dtype)
        elif spec.method == "fp8" and isinstance(m, nn.Linear) and reader.dtype(f"{name}.weight") == "F8_E4M3":
            swaps[name] = Fp8Linear(m.in_features, m.out_features, spec.block, m.bias is not None, dtype,
                                    _scale_dtype(reader, f"{name}.weight_scale_inv"))
        elif spec.method == "fp8" and _is_fused_experts(m):
            per_expert = reader.dtype(f"{name}.0.gate_proj.weight") == "F8_E4M3"
            if per_expert or reader.dtype(f"{name}.gate_up_proj") == "F8_E4M3":
                key = f"{name}.0.gate_proj.weight_scale_inv" if per_expert else f"{name}.gate_up_proj_scale_inv"
                e, two_i, h = m.gate_up_proj.shape
                swaps[name] = Fp8Experts(e, h, two_i // 2, spec.block, m.act_fn, dtype, fused=not per_expert,
                                         scale_dtype=_scale_dtype(reader, key))
    for name, new in swaps.items():
        model.set_submodule(name, new)


def _is_fused_experts(m: nn.Module) -> bool:
    """transformers' [E, 2I, H] / [E, H, I] experts with act(gate) * up (DeepseekV3Experts and kin)."""
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3
            and hasattr(m, "act_fn") and not hasattr(m, "gate_up_proj_bias"))


def _scale_dtype(reader: Reader, key: str) -> torch.dtype:
    if key not in reader:
        raise QuantError(f"scale tensor {key} is missing from the checkpoint")
    dt = reader.dtype(key)
    if dt not in ("F32", "BF16", "F8_E8M0"):
        raise QuantError(f"scale tensor {key} is {dt}; FP8 block scales are F32, BF16 or E8M0")
    return TORCH_DTYPES[dt]


# ----------------------------------------------------------------------------------- filling


def _fill(model: nn.Module, reader: Reader, spec: QuantSpec, dtype: torch.dtype, placement: dict) -> None:
    """Every parameter (and persistent buffer) from the checkpoint, placed straight on its device."""
    done: dict[int, torch.Tensor] = {}  # tied weights: one tensor, filled once
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                dev = _device_of(prefix + pname, placement)
                value = _source(reader, prefix + pname, p, spec, dev).to(dev)
                done[id(p)] = nn.Parameter(value, requires_grad=False)
            mod._parameters[pname] = done[id(p)]
        for bname, b in list(mod._buffers.items()):
            if b is None or bname in mod._non_persistent_buffers_set:
                continue
            if b.is_meta or prefix + bname in reader:
                dev = _device_of(prefix + bname, placement)
                mod._buffers[bname] = _source(reader, prefix + bname, b, spec, dev).to(dev)


def _source(reader: Reader, name: str, target: torch.Tensor, spec: QuantSpec, dev="cpu") -> torch.Tensor:
    """The checkpoint's value for model tensor `name`: as stored (packed targets), or dense in the
    target's dtype (plain, FP8-dequantized, MXFP4-dequantized, or per-expert keys fused)."""
    shape, dt = tuple(target.shape), target.dtype
    raw = dt in PACKED_DTYPES or name.endswith(("_scale_inv", "_scales"))
    if name in reader:
        if raw:
            return _checked_dtype(reader, name, reader.get(name, shape, "packed tensor"), dt)
        return _dense(reader, name, shape, dt, spec, dev)
    if f"{name}_blocks" in reader:
        return _dense_mxfp4(reader, name, shape, dt, dev)
    parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    if f"{parent}.0.down_proj.weight" in reader and len(shape) == 3:  # per-expert keys, as DeepSeek publishes
        if raw:  # Fp8Experts' `gate_proj` <- experts.{e}.gate_proj.weight, `gate_proj_scale_inv` <- ...weight_scale_inv
            proj, scale, _ = leaf.partition("_scale_inv")
            keys = [f"{parent}.{e}.{proj}.weight{scale}" for e in range(shape[0])]
            return torch.stack([_checked_dtype(reader, k, reader.get(k, shape[1:], "packed tensor"), dt) for k in keys])
        projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else (leaf,)
        rows = shape[1] // len(projs)
        return torch.stack([torch.cat([_dense(reader, f"{parent}.{e}.{p}.weight", (rows, shape[2]), dt, spec, dev)
                                       for p in projs]) for e in range(shape[0])])
    raise QuantError(f"weight {name} is missing from the checkpoint")


def _checked_dtype(reader: Reader, name: str, value: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    if value.dtype != dt:
        raise QuantError(f"packed tensor {name} is {reader.dtype(name)}; expected {dt}")
    return value


def _dense(reader: Reader, name: str, shape, dt: torch.dtype, spec: QuantSpec, dev="cpu") -> torch.Tensor:
    """A plain weight, or an FP8 one (with `<name>_scale_inv`) dequantized on `dev`, in `dt`."""
    from svrmad_local.kernels.fp8 import dequantize_fp8

    if reader.dtype(name) != "F8_E4M3":
        return reader.get(name, shape, "weight").to(dt)
    if spec.block is None:
        raise QuantError(f"weight {name} is FP8, but config.json declares {spec.method}, not fp8")
    w, s = reader.get(name, shape, "weight"), reader.get(name + "_scale_inv", None, "scale tensor")
    out = torch.empty(shape, dtype=dt, device=dev)
    lead = list(itertools.product(*map(range, shape[:-2])))  # [()] for a matrix
    try:
        for i in lead:  # one expert (one matrix) at a time
            out[i] = dequantize_fp8(w[i].to(dev), s[i].to(dev), spec.block, dt)
    except ValueError as exc:
        raise QuantError(f"scale tensor {name}_scale_inv: {str(exc).split(': ', 1)[-1]}") from None
    return out


def _dense_mxfp4(reader: Reader, name: str, shape, dt: torch.dtype, dev="cpu") -> torch.Tensor:
    """[E, rows, cols] from `<name>_blocks/_scales`, transposed when the model keeps [E, in, out]."""
    from svrmad_local.kernels.mxfp4 import dequantize_mxfp4

    bkey, skey = name + "_blocks", name + "_scales"
    binfo = reader.index[bkey]
    if skey not in reader:
        raise QuantError(f"scale tensor {skey} is missing from the checkpoint")
    rows, cols = (binfo.shape[1], binfo.shape[2] * 32) if len(binfo.shape) == 4 else (-1, -1)
    if len(shape) != 3 or binfo.shape[0] != shape[0] or binfo.shape[-1] != 16 or \
            shape[1:] not in ((rows, cols), (cols, rows)):
        raise QuantError(f"MXFP4 blocks {bkey} have shape {list(binfo.shape)}; the config needs "
                         f"[{shape[0]}, out, in/32, 16] for a weight {list(shape)}")
    blocks = reader.get(bkey, None, "packed tensor")
    scales = reader.get(skey, blocks.shape[:-1], "scale tensor")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantError(f"MXFP4 {bkey} and {skey} must be U8, got {reader.dtype(bkey)} and {reader.dtype(skey)}")
    transpose = shape[1:] == (cols, rows)  # GPT-OSS keeps expert weights [in, out]
    out = torch.empty(shape, dtype=dt, device=dev)
    for e in range(shape[0]):  # one expert at a time, on the device it goes to
        w = dequantize_mxfp4(blocks[e].to(dev), scales[e].to(dev), dt)
        out[e] = w.T if transpose else w
    return out


def _check_unused(model: nn.Module, reader: Reader, config) -> None:
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    layers = getattr(config, "num_hidden_layers", None)
    mtp = getattr(config, "num_nextn_predict_layers", 0) or 0  # DeepSeek's multi-token-prediction layers

    def ignored(key: str) -> bool:
        if any(p.search(key) for p in ignore):
            return True
        m = re.match(r"model\.layers\.(\d+)\.", key)
        return bool(mtp and m and layers is not None and int(m.group(1)) >= layers)

    unused = sorted(k for k in reader.index if k not in reader.used and not ignored(k))
    if unused:
        raise QuantError(f"{len(unused)} tensors of the checkpoint are not used by the config's architecture "
                         f"(e.g. {', '.join(unused[:3])})")
