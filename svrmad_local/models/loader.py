"""Load a local checkpoint directly: a folder with config.json and *.safetensors, never a hub.

Errors name what is wrong (missing folder, no weights, an architecture transformers cannot build as
a causal LM, weights that do not match the config, a config or tokenizer that cannot be read)
instead of letting transformers silently fill missing weights with random values.

A checkpoint's own Python code never runs (`trust_remote_code=False` on every load: no "run the
custom code? [y/N]" prompt) and pickled weights are never read (`use_safetensors=True`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from svrmad_local.errors import UserError
from svrmad_local.models import hf


class ModelLoadError(UserError, RuntimeError):
    pass


log = logging.getLogger("svrmad_local.models")


# Every from_pretrained call: a local folder only, and never the folder's own Python code.
SAFE = {"local_files_only": True, "trust_remote_code": False}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names of the CPU's own bf16 arithmetic


def native_bf16() -> list[str]:
    """The bf16 instructions this CPU has (avx512_bf16, AMX's bf16 tiles), as /proc/cpuinfo names them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if not flags:  # no /proc (not Linux): what torch's own dispatch reads
        cpu = getattr(torch, "cpu", None)
        has = getattr(cpu, "_is_avx512_bf16_supported", None)
        flags = ["avx512_bf16"] if has is not None and has() else []
    return [f for f in BF16_FLAGS if f in flags]


def default_dtype(device: str | None) -> torch.dtype:
    """bf16 on a GPU and on a CPU with its own bf16 arithmetic (avx512_bf16 or AMX), fp32 on other CPUs
    (bf16 there is converted on the fly and changes the statistics for nothing). docs/engine.md, "The
    default dtype"."""
    return default_dtype_and_why(device)[0]


def default_dtype_and_why(device: str | None) -> tuple[torch.dtype, str]:
    """`--dtype auto` here, and why, in words the engine's start line uses."""
    if device and device.startswith("cuda") or (device in (None, "auto") and torch.cuda.is_available()):
        return torch.bfloat16, "--dtype auto: bf16 on a GPU"
    has = native_bf16()
    if has:
        return torch.bfloat16, (f"--dtype auto: bf16 on a CPU with bf16 arithmetic ({', '.join(has)}); --dtype fp32 "
                                "--linear panels computes the same tokens on every machine")
    return torch.float32, "--dtype auto: fp32 on a CPU without bf16 arithmetic (no avx512_bf16 or AMX)"


def describe_dtype(dtype: torch.dtype, device: torch.device | str) -> tuple[str, str]:
    """(a short note for the engine's start line, the reason) of weights in `dtype` on `device`: on a CPU,
    the machine's default and why (what --dtype auto takes) or that another dtype was asked for."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return "", "where the weights are"
    auto, why = default_dtype_and_why(str(device))
    if dtype != auto:
        return ("as asked" if device.type == "cpu" else ""), \
            f"as asked (--dtype auto would take {str(auto).removeprefix('torch.')} here)"
    if device.type != "cpu":
        return "", why
    has = native_bf16()
    return f"auto: {', '.join(has)}" if has else "auto: no bf16 arithmetic here", why


def parse_dtype(dtype: str | torch.dtype | None, device: str | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


@dataclass
class CheckedFolder:
    """What `check_folder` read, for the load that follows."""
    path: Path
    raw: dict
    config: object
    spec: object  # quant.QuantSpec | None
    mode: str
    why: str
    dtype: torch.dtype
    device: str | None


def check_device(device: str | None) -> None:
    """A --device this torch can use, before anything is built on it."""
    if device is None or device == "auto":
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"device {device!r} is not a device torch knows (cpu, cuda, cuda:N)") from None
    if dev.type != "cuda":
        return
    if torch.version.cuda is None and torch.version.hip is None:
        raise ModelLoadError(f"device {device!r}: this torch ({torch.__version__}) was built without CUDA; install "
                             "the CUDA build (https://pytorch.org/get-started/locally/, e.g. pip install torch "
                             "--index-url https://download.pytorch.org/whl/cu128), or run on cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise ModelLoadError(f"device {device!r}: torch {torch.__version__} has CUDA but sees no GPU "
                             "(check nvidia-smi and CUDA_VISIBLE_DEVICES), or run on cpu")
    if dev.index is not None and dev.index >= count:
        raise ModelLoadError(f"device {device!r}: only {count} GPU{'s' if count > 1 else ''} visible (cuda:0"
                             f"{f' to cuda:{count - 1}' if count > 1 else ''})")


def check_folder(path: str | Path, *, dtype: str | torch.dtype | None = None, device: str | None = None,
                 device_map: str | dict | None = None, tp=False, quantization: str = "auto") -> CheckedFolder:
    """Every check of a checkpoint folder that reads no weight: the folder, config.json and its
    fields, the architecture, the weight files against their headers (sizes, the index's shards),
    the quantization and its tensors' dtypes, the tokenizer files, the device. `svrmad run` calls it
    before it writes anything (job/preflight.py); `load_model` calls it first too."""
    from svrmad_local.models import files, quant
    from svrmad_local.models.plan import PlanError, check_config_fields

    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a folder (expected config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not (path / files.INDEX).is_file():
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".gguf"))
        hint = f" (found {other}; convert to safetensors)" if other else ""
        raise ModelLoadError(f"{path} holds no *.safetensors weights{hint}")
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}/config.json is not valid JSON: {exc}") from None
    try:
        check_config_fields(raw, f"{path}/config.json")
    except PlanError as exc:
        raise ModelLoadError(str(exc)) from None
    try:
        config = AutoConfig.from_pretrained(path, **SAFE)
    except Exception as exc:
        if raw.get("auto_map"):
            raise ModelLoadError(
                f"{path} needs its own Python code (auto_map in config.json), which svrmad-local never runs; "
                "use a checkpoint of an architecture transformers ships") from None
        raise ModelLoadError(f"{path}/config.json cannot be used: {' '.join(str(exc).split())}") from exc
    if config.model_type not in hf.causal_lm_types():
        raise ModelLoadError(
            f"architecture {config.model_type!r} ({json.dumps(getattr(config, 'architectures', None))}) is not a "
            "decoder-only causal LM that transformers can build"
        )
    headers = files.check_files(path)
    check_generation_config(path)
    check_device(device)
    if device is None and device_map is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype = parse_dtype(dtype, device)
    spec = quant.quant_spec(raw)
    mode, why = quant.choose_mode(quantization, spec, device, bool(tp), device_map)
    if spec is not None:
        quant.check_dtypes({k: t["dtype"] for h in headers.values() for k, t in h.items()}, spec)
    return CheckedFolder(path, raw, config, spec, mode, why, torch_dtype, device)


def load_model(path: str | Path, *, dtype: str | torch.dtype | None = None, device: str | None = None,
               device_map: str | dict | None = None, tp=False, quantization: str = "auto") -> LoadedModel:
    """`device`: "cpu", "cuda", "cuda:1"... (default: cuda if available). `device_map`: passed to
    accelerate ("auto" spreads a model too large for one GPU over all visible GPUs). `tp`: this rank's
    part of the model under our tensor-parallel plan (models/shard.py) over `tp`, a dist.Group,
    or True for the whole initialised torch.distributed world (every rank of the group calls this).
    `quantization`: for MXFP4 / FP8 checkpoints, "native"
    keeps the weights packed, "dequantize" expands them exactly into `dtype`, "auto" takes native where
    a packed path exists for the device (models/quant, docs/quantization.md). Every check that needs
    no weight runs first (`check_folder`), and the tokenizer loads before the weights."""
    from svrmad_local.models import quant

    from transformers import AutoModelForCausalLM

    c = check_folder(path, dtype=dtype, device=device, device_map=device_map, tp=tp, quantization=quantization)
    path, config, spec, mode, torch_dtype, device = c.path, c.config, c.spec, c.mode, c.dtype, c.device
    tokenizer = load_tokenizer(path)
    check_vocabulary(tokenizer, config, path)
    if tp:  # our own plan (models/shard.py): each rank reads its slice; `tp` is the group, or True for the world
        from svrmad_local.dist import Group
        from svrmad_local.models.shard import load_sharded

        if device_map is not None:
            raise ModelLoadError("tensor parallelism and a device map do not mix: pass one of them")
        group = Group.whole_world() if tp is True else tp
        model = load_sharded(path, config, torch_dtype, device, group, spec)
        if spec is not None:
            model.svrmad_quantization["summary"] = (f"loading {path.name} ({spec.describe()}) split over "
                                                    f"{group.size} ranks, with the weights packed")
        return LoadedModel(model, tokenizer, path)
    if spec is not None:
        held = "with the weights packed (native)" if mode == "native" else f"dequantized into {torch_dtype}"
        line = f"loading {path.name} ({spec.describe()}) {held}: {c.why}"
        log.info(line)
        model = quant.load_quantized(path, config, spec, mode, torch_dtype, device, device_map)
        model.svrmad_quantization["summary"] = line
        return LoadedModel(model, tokenizer, path)
    kwargs = dict(SAFE, dtype=torch_dtype, use_safetensors=True, output_loading_info=True)
    if device_map is not None:
        kwargs["device_map"] = device_map
    # Quiet only for this call (our checks below say what matters, in our words), not for the process;
    # quantized folders never reach here, so no quantizer fallback can be hidden.
    try:
        with hf.quiet():
            model, info = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as exc:
        if "mismatched" in str(exc):
            detail = ", ".join(_shape_mismatches(path, config)[:3])
            raise ModelLoadError(f"checkpoint {path} does not match its config.json: weights of the wrong shape ({detail})") from exc
        raise ModelLoadError(f"loading the weights in {path} failed: {exc}") from exc
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in info.get("missing_keys", []) if k not in tied]
    problems = {
        "missing from the checkpoint": missing,
        "not used by the config's architecture": info.get("unexpected_keys", []),
        "of the wrong shape": [str(m) for m in info.get("mismatched_keys", [])],
    }
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        detail = "; ".join(f"{len(v)} weights {k} (e.g. {', '.join(list(v)[:3])})" for k, v in bad.items())
        raise ModelLoadError(f"checkpoint {path} does not match its config.json: {detail}")
    if device_map is None and not tp:
        model = model.to(device)
    return LoadedModel(model.eval(), tokenizer, path)


def check_generation_config(path: Path) -> None:
    """The folder's generation_config.json, read as transformers will read it: transformers skips a
    file that is not JSON with a log line (its eos ids then silently go) and refuses a bad value
    only once the weights are loaded, so both are refused here, naming the file."""
    from transformers import GenerationConfig

    file = path / "generation_config.json"
    if not file.is_file():
        return
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON ({getattr(exc, 'msg', exc)}); fix it, or move it away to use "
                             "the model's default generation settings") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} is a JSON {type(raw).__name__}, not an object")
    try:
        with hf.quiet():
            GenerationConfig.from_dict(raw)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{file}: {' '.join(str(exc).split())}") from None


def check_vocabulary(tokenizer, config, path: Path) -> None:
    """A tokenizer with more tokens than the model has embeddings makes ids the model cannot read
    (the chat template's special tokens are usually the last ids): every question would fail."""
    if tokenizer is None:
        return
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        beyond = tokenizer.convert_ids_to_tokens(list(range(vocab, min(len(tokenizer), vocab + 3))))
        raise ModelLoadError(f"the tokenizer in {path} has {len(tokenizer)} tokens but the model's vocabulary "
                             f"(config.json vocab_size) has {vocab}: ids {vocab} and up (e.g. {', '.join(map(str, beyond))}) "
                             "have no embedding; use the tokenizer saved with these weights")


def load_tokenizer(path: Path):
    """The folder's tokenizer; None when it has no tokenizer files (token-level use still works,
    chat prompts need one). Files that are there but cannot be loaded are an error."""
    from transformers import AutoTokenizer

    present = [name for name in TOKENIZER_FILES if (path / name).exists()]
    if not present:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, **SAFE)
    except Exception as exc:
        raise ModelLoadError(f"the tokenizer in {path} ({', '.join(present)}) cannot be loaded: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None


def _shape_mismatches(path: Path, config) -> list[str]:
    """'name: checkpoint shape vs config shape' for weights present in both (meta device: no memory)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for k in sf.keys():
                got = tuple(sf.get_slice(k).get_shape())
                if k in expected and expected[k] != got:
                    out.append(f"{k}: {list(got)} in the checkpoint vs {list(expected[k])} from the config")
    return out
