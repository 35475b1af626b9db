"""What a quantized checkpoint folder declares and holds, read from config.json and the safetensors
headers (never the weights), and the one-line refusals for what we do not read.

Two published layouts are read (docs/quantization.md):
* ``quant_method: "mxfp4"`` (GPT-OSS): MoE experts as ``<name>_blocks`` / ``<name>_scales``;
* ``quant_method: "fp8"`` (DeepSeek-V3): e4m3 weights with ``<name>_scale_inv`` per block of
  ``weight_block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from svrmad_local.errors import UserError

SUPPORTED = {"mxfp4": "MXFP4 experts, GPT-OSS layout", "fp8": "FP8 e4m3 with block scales, DeepSeek-V3 layout"}
MODES = ("auto", "native", "dequantize")


class QuantError(UserError, RuntimeError):
    """A quantized checkpoint we cannot read, or a mode that has no path: one line, naming what."""


@dataclass(frozen=True)
class QuantSpec:
    method: str  # "mxfp4" | "fp8"
    block: tuple[int, int] | None = None  # fp8: weight_block_size

    def describe(self) -> str:
        if self.block:
            return SUPPORTED[self.method].replace("block", f"{self.block[0]}x{self.block[1]} block")
        return SUPPORTED[self.method]


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors' name: "F8_E4M3", "U8", "BF16", "F32", ...
    shape: tuple[int, ...]


def quant_spec(raw_config: dict) -> QuantSpec | None:
    """The checkpoint's quantization as config.json declares it; None for a plain checkpoint."""
    q = raw_config.get("quantization_config")
    if q is None and isinstance(raw_config.get("text_config"), dict):
        q = raw_config["text_config"].get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method") or q.get("quant_type") or "unknown")
    if method not in SUPPORTED:
        if q.get("load_in_4bit") or q.get("load_in_8bit"):
            method = "bitsandbytes"
        raise QuantError(f"quantization {method!r} (config.json quantization_config) is not a format svrmad-local "
                         f"reads; it reads {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}; use a bf16 "
                         "release of the model or dequantize it to plain safetensors")
    if method == "mxfp4":
        return QuantSpec("mxfp4")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantError(f"fp8 format {fmt!r} (config.json quantization_config.fmt) is not read; only e4m3 is")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantError(f"fp8 checkpoint without a usable weight_block_size ({block!r}); svrmad-local reads "
                         "block-scaled FP8 such as DeepSeek-V3's [128, 128]")
    return QuantSpec("fp8", (int(block[0]), int(block[1])))


def read_index(path: Path) -> dict[str, TensorInfo]:
    """Every tensor name of the folder's *.safetensors, with its file, dtype and shape (headers only)."""
    from safetensors import safe_open

    index: dict[str, TensorInfo] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for key in sf.keys():
                s = sf.get_slice(key)
                index[key] = TensorInfo(f, s.get_dtype(), tuple(s.get_shape()))
    return index


class Reader:
    """Tensors of a folder by name, each file opened once; remembers which names were read."""

    def __init__(self, path: Path):
        self.index = read_index(path)
        self.used: set[str] = set()
        self._open: dict[Path, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def dtype(self, key: str) -> str | None:
        info = self.index.get(key)
        return info.dtype if info else None

    def get(self, key: str, shape: tuple[int, ...] | None = None, what: str = "tensor"):
        """The tensor `key` (CPU); QuantError naming it when it is missing or not `shape`."""
        from safetensors import safe_open

        info = self.index.get(key)
        if info is None:
            raise QuantError(f"{what} {key} is missing from the checkpoint")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise QuantError(f"{what} {key} has shape {list(info.shape)}; the config needs {list(shape)}")
        if info.file not in self._open:
            self._open[info.file] = safe_open(info.file, "pt")
        self.used.add(key)
        return self._open[info.file].get_tensor(key)


PLAIN_DTYPES = ("F32", "BF16", "F16", "F64")
SCALE_DTYPES = {"fp8": ("F32", "BF16", "F8_E8M0"), "mxfp4": ("U8",)}


def check_dtypes(dtypes: dict[str, str], spec: QuantSpec) -> None:
    """Refuse, from the headers alone, a tensor whose dtype has no place in `spec`'s layout: an
    8-bit weight that is not the format's packed one (an FP8 weight saved as F8_E5M2 or U8 would
    otherwise be read as plain numbers and generate garbage), a packed weight without its scales,
    or scales of a dtype the format does not use. One line naming the tensor and its dtype."""
    for name, dt in sorted(dtypes.items()):
        if dt in PLAIN_DTYPES and not name.endswith(("_scale_inv", "_scales", "_blocks")):
            continue
        problem = _fp8_problem(name, dt, dtypes) if spec.method == "fp8" else _mxfp4_problem(name, dt, dtypes)
        if problem:
            raise QuantError(f"tensor {name} ({dt}): {problem}")


def _fp8_problem(name: str, dt: str, dtypes: dict[str, str]) -> str | None:
    if name.endswith("_scale_inv"):
        if dt not in SCALE_DTYPES["fp8"]:
            return "FP8 block scales are F32, BF16 or F8_E8M0"
        base = name.removesuffix("_scale_inv")
        return None if base in dtypes else f"the weight it scales, {base} is missing from the checkpoint"
    if dt == "F8_E4M3":
        return None if name + "_scale_inv" in dtypes else f"its scale tensor {name}_scale_inv is missing"
    return (f"a weight stored as {dt} is not read by the fp8 layout, which holds F8_E4M3 weights with "
            "_scale_inv block scales and plain F32/BF16/F16 ones")


def _mxfp4_problem(name: str, dt: str, dtypes: dict[str, str]) -> str | None:
    if name.endswith(("_blocks", "_scales")):
        base = name[:-7]
        other = base + ("_scales" if name.endswith("_blocks") else "_blocks")
        if other not in dtypes:
            return f"{other} is missing from the checkpoint"
        return None if dt == "U8" else "MXFP4 blocks and scales are U8"
    return (f"a weight stored as {dt} is not read by the mxfp4 layout, which holds U8 _blocks/_scales pairs "
            "and plain F32/BF16/F16 weights")
