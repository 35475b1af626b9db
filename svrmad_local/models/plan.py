"""`svrmad plan`: will this checkpoint fit these GPUs, and how many debates at once? Asked before
anything loads, from config.json and the safetensors headers (never the weights), so a user learns
that DeepSeek-V3.1 needs an 8xH200 node before downloading 640 GiB to an 8xH100 one.

Weights are counted as one list of `Weight`s, whichever way the folder tells us about them: from
the headers where the *.safetensors are there (exact, packed tensors merged with their scales),
else rebuilt from config.json for the architectures we know (GPT-OSS, DeepSeek-V3, Llama/Qwen-like
dense models). The choices (reserve, prompt length, what stays bf16) are in docs/plan.md.

It also holds the two tensor-parallel refusals the loader shares with the plan: heads that a TP
degree does not divide, and a split that would cut a quantization block.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from svrmad_local.errors import UserError
from svrmad_local.models import files as checkpoint_files
from svrmad_local.models.files import DTYPE_BYTES

GiB = 2**30
AGENTS, NEW_TOKENS = 6, 16_384  # the paper's shape: 6 agents, up to 16,384 generated tokens each
PROMPT_TOKENS = 1_024  # the question in its chat template (debate prompts reuse cached answers)
# What a GPU keeps besides the weights and the KV pool, counted as the engine sizes its pool
# (engine/memory.py): the pool gets GPU_SHARE of the memory free after loading, less what a profiled
# forward at the largest prefill chunk takes (`forward_bytes`, estimated here, measured by the engine).
GPU_SHARE = 0.9  # engine/memory.py's default share
CUDA_CONTEXT = GiB  # the CUDA context, cuBLAS workspaces and compiled kernels: not free after loading
PREFILL_TOKENS = 2048  # EngineConfig.max_num_batched_tokens's default (tests/test_plan.py checks it)
MLA_CHUNK_BYTES = 256 * 2**20  # the engine's bound on the latent expanded at once in a prefill (engine/mla.py)
NCCL_BYTES = GiB  # NCCL's buffers under --tp (allocated outside torch at the first collective)
KV_ITEM = 2  # the cache holds bf16 keys and values
MXFP4_BLOCK = 32  # values per e8m0 scale; 16 bytes of e2m1 codes + 1 byte of scale
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DENSE = ("llama", "mistral", "qwen2", "qwen3")


class PlanError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Weight:
    """One weight as the model uses it. `shape` is logical (the values it stands for: [E,] out, in
    for a linear); `fmt` is "mxfp4", "fp8" or the stored dtype ("BF16", "F32"...); `stored` is the
    bytes in the files, scales included, where the headers told us (else computed from the format)."""

    name: str
    shape: tuple[int, ...]
    fmt: str
    block: tuple[int, ...] = ()
    stored: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def native_bytes(self) -> int:
        if self.stored is not None:
            return self.stored
        lead = math.prod(self.shape[:-2]) if len(self.shape) > 2 else 1
        if self.fmt == "mxfp4":  # per 32 values: 16 bytes of codes + 1 byte e8m0 scale
            return 17 * math.prod(self.shape[:-1]) * math.ceil(self.shape[-1] / MXFP4_BLOCK)
        if self.fmt == "fp8":  # 1 byte a value + an fp32 scale per block, partial blocks at the edges
            out, inp = self.shape[-2:]
            return self.numel + 4 * lead * math.ceil(out / self.block[0]) * math.ceil(inp / self.block[1])
        return self.numel * DTYPE_BYTES[self.fmt]

    def block_shape(self) -> tuple[int, ...]:
        """The quantization block over the logical shape (1 where a split may fall anywhere)."""
        if self.fmt == "mxfp4":
            return (1,) * (len(self.shape) - 1) + (MXFP4_BLOCK,)
        if self.fmt == "fp8":
            return (1,) * (len(self.shape) - 2) + tuple(self.block)
        return (1,) * len(self.shape)


# --- what the folder says ---------------------------------------------------------------------

def read_config(path: Path) -> dict:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise PlanError(f"model path {path} is not a folder (expected config.json, and *.safetensors if downloaded)")
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{path} has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}/config.json is not valid JSON: {exc}") from None
    cfg = check_config_fields(cfg, f"{path}/config.json")
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4", "fp8"):
        raise PlanError(f"{path}: quantization {method!r} is not one svrmad-local reads (mxfp4, fp8, or none)")
    return cfg


# config.json fields the plan and the engine compute with: an integer >= 1 (>= 0 for the second
# group) where present; a string, a zero or a float here is one line naming the field, not a
# ZeroDivisionError or a TypeError deep inside the count.
POSITIVE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "head_dim",
                   "intermediate_size", "vocab_size", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
                   "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "sliding_window",
                   "moe_layer_freq", "max_position_embeddings")
NON_NEGATIVE_FIELDS = ("first_k_dense_replace", "n_shared_experts", "qk_nope_head_dim")
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def check_config_fields(raw, where: str) -> dict:
    """The model's own config (a multimodal config's text_config, with the quantization_config of
    the whole), its integer fields checked; PlanError naming the field otherwise."""
    if not isinstance(raw, dict):
        raise PlanError(f"{where} holds {json.dumps(raw)[:40]}, not an object of fields")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise PlanError(f"{where}: text_config is {json.dumps(text)[:40]}, not an object of fields")
    cfg = text | {k: v for k, v in raw.items() if k == "quantization_config"}

    def bad(name, expected):
        raise PlanError(f"{where}: {name} is {json.dumps(cfg.get(name))}; expected {expected}")

    qc = cfg.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        bad("quantization_config", "an object of fields")
    block = (qc or {}).get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2 and all(_count(b, 1) for b in block)):
        raise PlanError(f"{where}: quantization_config.weight_block_size is {json.dumps(block)}; expected two "
                        "integers >= 1, e.g. [128, 128]")
    for low, names in ((1, POSITIVE_FIELDS), (0, NON_NEGATIVE_FIELDS)):
        for name in names:
            if cfg.get(name) is not None and not _count(cfg[name], low):
                bad(name, f"an integer >= {low}")
    for name in BOOL_FIELDS:
        if cfg.get(name) is not None and not isinstance(cfg[name], bool):
            bad(name, "true or false")
    types, layers = cfg.get("layer_types"), cfg.get("num_hidden_layers")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)
                                  and (layers is None or len(types) == layers)):
        bad("layer_types", f"a list of {layers or 'num_hidden_layers'} layer type names")
    return cfg


def _count(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def read_header(file: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size (models/files.py)."""
    try:
        return checkpoint_files.read_header(file)
    except checkpoint_files.CheckpointFileError as exc:
        raise PlanError(str(exc)) from None


def header_weights(path: Path, cfg: dict) -> tuple[list[Weight], list[Path]] | None:
    """The weights as the headers describe them, or None when the files are not all there (an index
    naming shards that are missing: the plan then counts from config.json)."""
    try:
        names = checkpoint_files.index_files(path)
    except checkpoint_files.CheckpointFileError as exc:
        raise PlanError(str(exc)) from None
    if names is not None:
        files = [path / n for n in names]
        if not all(f.is_file() for f in files):
            return None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, dict] = {}
    for f in files:
        tensors.update(read_header(f))
    layers = cfg.get("num_hidden_layers")
    beyond = re.compile(r"model\.layers\.(\d+)\.")
    block = tuple((cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    out, used = [], set()

    def size(name):
        used.add(name)
        begin, end = tensors[name]["data_offsets"]
        return end - begin

    for name, t in tensors.items():
        m = beyond.match(name)
        if m and layers is not None and int(m.group(1)) >= layers:  # e.g. DeepSeek's MTP layer: not built
            used.add(name)
            continue
        if name in used:
            continue
        shape = tuple(t["shape"])
        if name.endswith("_blocks") and name[:-7] + "_scales" in tensors:
            logical = shape[:-2] + (shape[-2] * shape[-1] * 2,)
            out.append(Weight(name[:-7], logical, "mxfp4", stored=size(name) + size(name[:-7] + "_scales")))
        elif t["dtype"].startswith("F8") and name + "_scale_inv" in tensors:
            out.append(Weight(name, shape, "fp8", block, stored=size(name) + size(name + "_scale_inv")))
        elif name.endswith(("_scales", "_scale_inv")):
            continue  # its weight comes later in the header; claimed there
        else:
            if t["dtype"] not in DTYPE_BYTES:
                raise PlanError(f"{name}: dtype {t['dtype']} unknown to the plan")
            out.append(Weight(name, shape, t["dtype"], stored=size(name)))
    stray = sorted(n for n in tensors if n not in used)
    if stray:
        raise PlanError(f"{stray[0]} has no weight it scales (or its weight is of an unexpected dtype)")
    return out, files


def config_weights(cfg: dict) -> list[Weight]:
    """The weights transformers builds for this config, in the published names and formats. Each
    builder yields (name, logical shape, kind): "linear" or "experts" where a quantization may pack
    it, a dtype where the checkpoints publish it so whatever the rest is, False for plain weights."""
    mt = cfg.get("model_type")
    build = {"gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3, **{d: _dense for d in DENSE}}.get(mt)
    if build is None:
        raise PlanError(f"architecture {mt!r}: the plan counts {', '.join(['gpt_oss', 'deepseek_v3', *DENSE])} "
                        "from config.json alone; for another, put its *.safetensors next to config.json (only "
                        "their headers are read)")
    qc = cfg.get("quantization_config") or {}
    skip = list(qc.get("modules_to_not_convert") or [])
    plain = CONFIG_DTYPES.get(cfg.get("torch_dtype") or cfg.get("dtype"), "BF16")
    block = tuple(qc.get("weight_block_size") or (128, 128))
    out = []
    for name, shape, quantizable in build(cfg):
        fmt = quantizable if quantizable in DTYPE_BYTES else plain  # a dtype: published so, always
        if quantizable in ("linear", "experts") and not any(_matches(name, p) for p in skip):
            fmt = {"mxfp4": "mxfp4", "fp8": "fp8"}.get(qc.get("quant_method"), plain)
        if quantizable == "experts" and fmt == "fp8" or quantizable == "linear" and fmt == "mxfp4":
            fmt = plain  # MXFP4 packs only the MoE experts; FP8 every projection
        out.append(Weight(name, tuple(shape), fmt, block if fmt == "fp8" else ()))
    return out


def _matches(name: str, pattern: str) -> bool:
    """modules_to_not_convert: a glob or a module name, matching the weight's module or a parent."""
    return any(fnmatch.fnmatchcase(name, p) for p in (pattern, pattern + ".*", "*." + pattern + ".*"))


def _attn_linear(p, q_out, kv_out, h, bias, o_bias=None):
    o_bias = bias if o_bias is None else o_bias
    yield f"{p}.q_proj.weight", (q_out, h), "linear"
    yield f"{p}.k_proj.weight", (kv_out, h), "linear"
    yield f"{p}.v_proj.weight", (kv_out, h), "linear"
    yield f"{p}.o_proj.weight", (h, q_out), "linear"
    if bias:
        yield from ((f"{p}.{n}_proj.bias", (d,), False) for n, d in (("q", q_out), ("k", kv_out), ("v", kv_out)))
    if o_bias:
        yield f"{p}.o_proj.bias", (h,), False


def _mlp(p, h, inter, bias=False):
    for n, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        yield f"{p}.{n}.weight", shape, "linear"
        if bias:
            yield f"{p}.{n}.bias", shape[:1], False


def _ends(cfg, h):
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), False
    yield "model.norm.weight", (h,), False
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (cfg["vocab_size"], h), False


def _dense(cfg):
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    qwen2 = cfg["model_type"] == "qwen2"
    bias = qwen2 or cfg.get("attention_bias", False) and cfg["model_type"] != "mistral"
    yield from _ends(cfg, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _attn_linear(f"{p}.self_attn", heads * hd, kv * hd, h, bias, o_bias=bias and not qwen2)
        if cfg["model_type"] == "qwen3":
            yield from ((f"{p}.self_attn.{n}.weight", (hd,), False) for n in ("q_norm", "k_norm"))
        yield from _mlp(f"{p}.mlp", h, cfg["intermediate_size"], cfg.get("mlp_bias", False) and cfg["model_type"] == "llama")
        yield from ((f"{p}.{n}.weight", (h,), False) for n in ("input_layernorm", "post_attention_layernorm"))


def _gpt_oss(cfg):
    h, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    yield from _ends(cfg, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _attn_linear(f"{p}.self_attn", heads * hd, kv * hd, h, cfg.get("attention_bias", True))
        yield f"{p}.self_attn.sinks", (heads,), False
        yield from ((f"{p}.{n}.weight", (h,), False) for n in ("input_layernorm", "post_attention_layernorm"))
        yield f"{p}.mlp.router.weight", (e, h), False
        yield f"{p}.mlp.router.bias", (e,), False
        # published as [E, out rows, in/32 blocks, 16 bytes]: logical [E, out, in]
        yield f"{p}.mlp.experts.gate_up_proj", (e, 2 * inter, h), "experts"
        yield f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * inter), False
        yield f"{p}.mlp.experts.down_proj", (e, h, inter), "experts"
        yield f"{p}.mlp.experts.down_proj_bias", (e, h), False


def _deepseek_v3(cfg):
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_rank, kv_rank, bias = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg.get("attention_bias", False)
    e, moe_inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    yield from _ends(cfg, h)
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        if q_rank:
            yield f"{a}.q_a_proj.weight", (q_rank, h), "linear"
            yield f"{a}.q_a_layernorm.weight", (q_rank,), False
            yield f"{a}.q_b_proj.weight", (heads * (nope + rope), q_rank), "linear"
        else:
            yield f"{a}.q_proj.weight", (heads * (nope + rope), h), "linear"
        yield f"{a}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h), "linear"
        yield f"{a}.kv_a_layernorm.weight", (kv_rank,), False
        yield f"{a}.kv_b_proj.weight", (heads * (nope + v), kv_rank), "linear"
        yield f"{a}.o_proj.weight", (h, heads * v), "linear"
        if bias:
            yield from ((f"{a}.{n}.bias", (d,), False) for n, d in
                        (("q_a_proj" if q_rank else "q_proj", q_rank or heads * (nope + rope)),
                         ("kv_a_proj_with_mqa", kv_rank + rope), ("o_proj", h)))
        yield from ((f"{p}.{n}.weight", (h,), False) for n in ("input_layernorm", "post_attention_layernorm"))
        if i < cfg.get("first_k_dense_replace", 0) or i % cfg.get("moe_layer_freq", 1):
            yield from _mlp(f"{p}.mlp", h, cfg["intermediate_size"])
            continue
        yield f"{p}.mlp.gate.weight", (e, h), False
        yield f"{p}.mlp.gate.e_score_correction_bias", (e,), "F32"
        for j in range(e):
            yield from _mlp(f"{p}.mlp.experts.{j}", h, moe_inter)
        if cfg.get("n_shared_experts"):
            yield from _mlp(f"{p}.mlp.shared_experts", h, moe_inter * cfg["n_shared_experts"])


# --- the KV cache ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerKV:
    bytes_per_token: int  # the whole layer, all heads
    heads: int  # KV heads a TP split divides; 0 for a latent every rank keeps whole
    window: int | None


def kv_layers(cfg: dict) -> list[LayerKV]:
    """Per layer what one token adds to the cache: K and V of each KV head, or for multi-head latent
    attention the latent (kv_lora_rank) and the shared RoPE key (qk_rope_head_dim)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):
        return [LayerKV((cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * KV_ITEM, 0, None)] * n
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        windows = [window if t == "sliding_attention" else None for t in types]
    else:
        windows = [window if cfg.get("use_sliding_window", True) else None] * n
    return [LayerKV(2 * kv * hd * KV_ITEM, kv, w) for w in windows]


# --- what the engine keeps besides weights and KV -------------------------------------------------

def kv_room(free: int, held: int, share: float = GPU_SHARE) -> int:
    """What the KV pool may take on one GPU: `share` of the memory free after loading, less `held`, what
    the profiled forward took there. One rule for the engine (engine/memory.py, which measures `held`)
    and the plan (which estimates it, `forward_bytes`)."""
    return max(0, int(share * free) - held)


def forward_bytes(cfg: dict, tp: int = 1, layers_here: int | None = None, tokens: int = PREFILL_TOKENS) -> int:
    """An estimate of what the engine's profiled forward (one prefill chunk of `tokens` tokens) takes on a
    GPU and keeps: the largest layer's activations in bf16 (the residual stream and its copies; the
    attention's query, keys, values and output, for latent attention a bounded chunk of the expanded
    latent; the MLP or the routed experts' rows), the absorbed MLA weights of the GPU's `layers_here`
    layers (bf16 copies of kv_b_proj's two halves), and NCCL's buffers under --tp. The engine measures
    the real figure (Engine.info["kv_held"]); the GPU check prints both."""
    t, h, item = tokens, cfg["hidden_size"], 2
    heads = cfg["num_attention_heads"] // tp
    layers_here = cfg["num_hidden_layers"] if layers_here is None else layers_here
    stream = 6 * t * h * item
    absorbed = 0
    if cfg.get("kv_lora_rank"):
        nope, rope, v, c = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        attn = 2 * t * heads * (nope + rope) * item + min(MLA_CHUNK_BYTES, t * heads * (2 * nope + rope + v) * item) \
            + t * heads * v * (item + 4)
        absorbed = layers_here * heads * c * (nope + v) * item
    else:
        kv = max(1, (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) // tp)
        hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        attn = 2 * t * (2 * heads + 2 * kv) * hd * item
    experts = next((cfg[k] for k in ("n_routed_experts", "num_local_experts") if cfg.get(k)), 0)
    if experts:
        top = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 1
        inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        mlp = t * top * (3 * inter + 2 * h) * item + t * experts * 4
    else:
        mlp = 3 * t * (cfg["intermediate_size"] // tp) * item
    return stream + max(attn, mlp) + absorbed + (NCCL_BYTES if tp > 1 else 0)


# --- tensor-parallel refusals --------------------------------------------------------------------

def check_tp_heads(cfg: dict, tp: int) -> None:
    """--tp N splits attention by heads, so N must divide the attention heads and the KV heads (a
    latent-attention cache is not split by heads: each rank keeps it whole)."""
    if tp <= 1:
        return
    heads = cfg.get("num_attention_heads")
    kv = None if cfg.get("kv_lora_rank") else cfg.get("num_key_value_heads") or heads
    for what, n in (("attention heads", heads), ("KV heads", kv)):
        if n is not None and n % tp:
            raise PlanError(f"--tp {tp} does not divide the model's {n} {what}"
                            f" ({cfg.get('num_attention_heads')} attention, {kv or 'latent'} KV); "
                            f"use a --tp that divides {n}")


def check_block_split(name: str, shape, block_shape, tp: int, dim: int) -> None:
    """Refuse a split of `shape` over `tp` ranks along `dim` that would cut a quantization block:
    each rank's part must start on a block boundary (a partial last block only at the tensor's end)."""
    dim = dim % len(shape)
    size, block = shape[dim], block_shape[dim]
    if size % tp:
        raise PlanError(f"{name}: dimension {dim} of {list(shape)} ({size}) does not split over {tp} ranks")
    if (size // tp) % block and tp > 1:
        raise PlanError(f"{name}: splitting dimension {dim} of {list(shape)} over {tp} ranks gives {size // tp} "
                        f"per rank, which cuts its {block}-wide quantization blocks; use a --tp that keeps "
                        f"{size} / tp a multiple of {block}")


def check_planned(model_type: str, packed: bool) -> None:
    """--tp runs our own plan (models/tp_plan.py), which covers these architectures."""
    from svrmad_local.models.tp_plan import PLANNED

    if model_type not in PLANNED:
        raise PlanError(f"--tp over a {model_type} model is not planned yet (the tensor-parallel plan covers "
                        f"{', '.join(PLANNED)}); run it with --tp 1, data parallel, or --device-map auto")
    if model_type == "gpt_oss" and not packed:
        raise PlanError("--tp over GPT-OSS reads its published MXFP4 release (its plain experts module cannot "
                        "skip another rank's experts); use the MXFP4 checkpoint or --tp 1")


def tp_split_dim(w: Weight) -> int | None:
    """The dimension --tp cuts `w` along under the plan (models/tp_plan.py); None: whole on every rank."""
    from svrmad_local.models.tp_plan import DIM, split_of

    return DIM.get(split_of(w.name))


# --- the plan ----------------------------------------------------------------------------------

def parse_gpus(text: str) -> tuple[int, int]:
    """"8x80GiB" -> (8, 80 GiB); "80GB" -> (1, 80e9). A unit is required."""
    from svrmad_local.sizes import parse_memory

    m = re.fullmatch(r"\s*(?:(\d+)\s*[x×*]\s*)?(.+?)\s*", text or "")
    count = int(m.group(1) or 1) if m else 0
    if not m or count < 1 or not re.search(r"[kmg]i?b\s*$", m.group(2).lower()):
        raise PlanError(f"--gpus {text!r}: expected COUNTxMEMORY, e.g. 8x80GiB or 1x141GB")
    try:
        mem = parse_memory(m.group(2), 0, 0)
    except ValueError:
        raise PlanError(f"--gpus {text!r}: expected COUNTxMEMORY, e.g. 8x80GiB or 1x141GB") from None
    return count, mem


def make_plan(path, gpus: int, gpu_memory: int, quantization: str = "native", tp: int | None = None,
              prompt_tokens: int = PROMPT_TOKENS, held_as: str | None = None) -> dict:
    """`held_as`: the dtype ("F32", "BF16") unpacked weights are held in, when not the published one
    (an fp32 run on the CPU); packed weights keep their bytes."""
    path = Path(path).expanduser()
    if quantization not in ("native", "dequantize"):
        raise PlanError(f"quantization {quantization!r}: use native or dequantize")
    if prompt_tokens < 0:
        raise PlanError(f"--prompt-tokens {prompt_tokens} is negative")
    cfg = read_config(path)
    try:
        return _plan(path, cfg, gpus, gpu_memory, quantization, tp, prompt_tokens, held_as)
    except KeyError as exc:
        raise PlanError(f"{path}/config.json has no {exc.args[0]!r}, which the plan needs") from None


def _plan(path: Path, cfg: dict, gpus, gpu_memory, quantization, tp, prompt_tokens, held_as=None) -> dict:
    found = header_weights(path, cfg)
    weights, source = (found[0], f"safetensors headers ({len(found[1])} files)") if found else \
        (config_weights(cfg), "config.json")
    if tp is not None and (tp < 1 or tp > gpus or gpus % tp):
        raise PlanError(f"--tp {tp} with {gpus} GPUs: the GPUs must be a whole number of tp-GPU groups")
    native = quantization == "native"
    packed = any(w.fmt in ("mxfp4", "fp8") for w in weights)
    if tp and tp > 1:  # the engine's own refusals, in the same words (models/shard.py)
        check_planned(cfg.get("model_type"), packed)
        if packed and not native:
            raise PlanError("tensor parallelism over a packed checkpoint keeps the weights packed (each rank reads "
                            "its blocks and their scales); plan it with --quantization native")
        check_tp_heads(cfg, tp)
        experts = next((cfg[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.get(k)), 0)
        if experts % tp:
            raise PlanError(f"--tp {tp} does not divide the model's {experts} routed experts (split by expert); "
                            f"use a --tp that divides {experts}")
        for w in weights:
            dim = tp_split_dim(w)
            if dim is not None and ".experts." not in w.name:  # experts: whole, by expert (checked above)
                check_block_split(w.name, w.shape, w.block_shape(), tp, dim)

    def size(w: Weight) -> int:
        if held_as and (not native or w.fmt not in ("mxfp4", "fp8")):
            return w.numel * DTYPE_BYTES[held_as]
        return w.native_bytes() if native else 2 * w.numel

    total = sum(size(w) for w in weights)
    # under --tp, what every rank holds whole (embeddings, norms, routers, the LM head, MLA's latent
    # projections) and the split parts, 1/tp each
    whole = total if not tp or tp == 1 else sum(size(w) for w in weights if tp_split_dim(w) is None)
    params: dict[str, int] = {}
    for w in weights:
        key = w.fmt if native else "BF16"
        params[key] = params.get(key, 0) + w.numel

    # how the GPUs hold it: tp-GPU replicas, or (no --tp) one model spread by layers over all GPUs
    span = tp or gpus
    replicas = gpus // span
    layers = kv_layers(cfg)

    def per_gpu(layer: LayerKV) -> int:
        if tp is None:
            return layer.bytes_per_token  # divided by the span below, with the weights
        return layer.bytes_per_token // tp if layer.heads else layer.bytes_per_token

    seq = prompt_tokens + NEW_TOKENS
    grow = sum(per_gpu(x) for x in layers if x.window is None or x.window >= seq)
    capped = [x for x in layers if x.window is not None and x.window < seq]
    cap = sum(per_gpu(x) * x.window for x in capped)
    split = span if tp is None else 1
    seq_bytes = math.ceil((grow * seq + cap) / split)
    seq_uncapped = math.ceil(sum(per_gpu(x) for x in layers) * seq / split)
    weights_gpu = math.ceil(total / span) if tp is None else whole + math.ceil((total - whole) / tp)
    held = forward_bytes(cfg, tp or 1, math.ceil(cfg["num_hidden_layers"] / (1 if tp else span)))
    free = gpu_memory - CUDA_CONTEXT - weights_gpu
    room = kv_room(free, held) if free > 0 else 0
    # what the GPU keeps besides weights and KV: the context, the forward, (1 - share) of the rest
    reserve = gpu_memory - weights_gpu - room if room > 0 else CUDA_CONTEXT + held
    sequences = replicas * (max(0, room) // seq_bytes)
    mem, wg = _gib(gpu_memory), _gib(weights_gpu)
    if weights_gpu > gpu_memory:
        reason = f"needs {wg} of weights per GPU on {mem}"
    elif room <= 0:
        reason = (f"needs {wg} of weights per GPU plus {_gib(reserve)} of reserve (the CUDA context and a forward "
                  f"of {PREFILL_TOKENS:,} tokens) on {mem}")
    elif sequences < AGENTS:
        reason = (f"{wg} of weights and {_gib(reserve)} of reserve per GPU on {mem} leave {_gib(room)} for the KV "
                  f"cache: {sequences} of the {AGENTS} sequences of {seq:,} tokens one question needs")
    else:
        reason = (f"{wg} of weights and {_gib(reserve)} of reserve per GPU on {mem} leave {_gib(room)} for the KV "
                  f"cache: {sequences:,} sequences of {seq:,} tokens, {sequences // AGENTS:,} questions of {AGENTS} agents at once")
    return {
        "model": str(path), "architecture": cfg.get("model_type"), "source": source,
        "quantization": quantization, "parameters": sum(params.values()), "parameters_by_format": params,
        "weight_bytes": total, "gpus": gpus, "gpu_memory": gpu_memory, "tp": tp, "replicas": replicas,
        "weight_bytes_per_gpu": weights_gpu, "weight_bytes_whole_per_gpu": whole if tp and tp > 1 else None,
        "reserve_bytes_per_gpu": reserve, "forward_bytes_per_gpu": held, "kv_room_per_gpu": max(0, room),
        "kv_bytes_per_token": math.ceil(grow / split),
        "kv_window_cap_bytes_per_sequence": math.ceil(cap / split),
        "kv_window_layers": len(capped), "kv_windows": sorted({x.window for x in capped}),
        "kv_latent": any(x.heads == 0 for x in layers),
        "sequence_tokens": seq, "prompt_tokens": prompt_tokens, "new_tokens": NEW_TOKENS,
        "kv_bytes_per_sequence": seq_bytes, "sequences": sequences,
        "sequences_uncapped": replicas * (max(0, room) // seq_uncapped),
        "fits": weights_gpu <= gpu_memory and room > 0 and sequences >= AGENTS, "reason": reason,
    }


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB or n == 0 else f"{n / 2**20:.1f} MiB"


def format_plan(p: dict) -> str:
    fmt = {"mxfp4": "MXFP4 (4.25 bits)", "fp8": "FP8 e4m3 + block scales", "BF16": "bf16", "F32": "fp32"}
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n:,}"  # noqa: E731
    kinds = ", ".join(f"{count(n)} {fmt.get(k, k.lower())}" for k, n in sorted(p["parameters_by_format"].items()))
    if p["tp"] is None:
        layout = "one GPU" if p["gpus"] == 1 else f"spread by layers over {p['gpus']} GPUs (no --tp)"
    else:
        layout = (f"{p['replicas']} replica{'s' if p['replicas'] > 1 else ''} of {p['tp']} GPU"
                  + (f"s, tensor parallel ({_gib(p['weight_bytes_whole_per_gpu'])} of it whole on every rank: "
                     "embeddings, LM head, norms, routers, latent projections)" if p["tp"] > 1 else " each"))
    where = ("the latent, kept whole on every TP rank" if p["kv_latent"] and (p["tp"] or 1) > 1 else
             "the latent" if p["kv_latent"] else "K and V" + (", split by KV heads" if (p["tp"] or 1) > 1 else ""))
    lines = [
        f"svrmad plan: {p['model']} ({p['architecture']}), counted from {p['source']}, quantization {p['quantization']}",
        f"  weights: {_gib(p['weight_bytes'])} ({p['weight_bytes']:,} bytes): {kinds}",
        f"  per GPU: {_gib(p['weight_bytes_per_gpu'])} of weights on {p['gpus']} x {_gib(p['gpu_memory'])}, {layout}; "
        f"reserve {_gib(p['reserve_bytes_per_gpu'])}; KV room {_gib(p['kv_room_per_gpu'])}",
        f"  KV cache per GPU: {p['kv_bytes_per_token']:,} bytes per token ({where})"
        + (f" + {p['kv_window_cap_bytes_per_sequence']:,} bytes per sequence for {p['kv_window_layers']} sliding "
           f"layers capped at their window of {', '.join(map(str, p['kv_windows']))}" if p["kv_window_layers"] else ""),
        f"  sequences of {p['prompt_tokens']:,} + {p['new_tokens']:,} tokens ({_gib(p['kv_bytes_per_sequence'])} each): "
        f"{p['sequences']:,} at once"
        + (f"; {p['sequences_uncapped']:,} if sliding layers keep every token, as the engine's paged cache does today"
           if p["kv_window_layers"] else ""),
        f"  fits: {'yes' if p['fits'] else 'no'}: {p['reason']}",
    ]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder (config.json; *.safetensors headers if there)")
    parser.add_argument("--gpus", required=True, help="COUNTxMEMORY, e.g. 8x80GiB or 1x141GB")
    parser.add_argument("--quantization", choices=("native", "dequantize"), default="native",
                        help="native: packed formats at their real size (default); dequantize: every weight in bf16")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel degree (GPUs per replica); default: one model spread over all GPUs")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help=f"prompt length of each sequence (default {PROMPT_TOKENS})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(args) -> int:
    gpus, mem = parse_gpus(args.gpus)
    plan = make_plan(args.model, gpus, mem, args.quantization, args.tp, args.prompt_tokens)
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0
