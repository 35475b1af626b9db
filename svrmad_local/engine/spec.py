"""What each attention layer of a checkpoint needs from the engine, read once, or a refusal.

The engine runs the checkpoint's own modules and owns only the attention call and the cache. To be
exact on an architecture it must know, per layer, what the model caches (per-head K/V, or the
compressed latent that multi-head latent attention hands to `Cache.update`), the sliding window,
whether learned attention sinks join the softmax, and that nothing else changes the attention. This
module finds out by a *probe*: one two-token forward through recording stand-ins of our attention
function and of the cache, compared with the config. Anything the engine does not implement is
refused here, at `Engine(...)`, in one line naming the feature and the architecture, so the engine
can be wrong on no architecture silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from svrmad_local.models import hf

from .context import probing

# keyword arguments the paged attention understands; any other one with a value is refused
_KNOWN_KWARGS = {"position_ids", "use_cache", "cache_position", "sliding_window", "s_aux", "softcap",
                 "output_attentions", "is_causal", "dropout", "scaling"}


class UnsupportedModel(ValueError):
    """The checkpoint uses an attention feature the engine cannot compute exactly."""


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer as the engine sees it.

    kind "kv": the layer caches per-head keys and values, as the attention receives them.
    kind "latent": the layer caches something smaller that it expands before attention (DeepSeek's
    multi-head latent attention caches the normalised KV latent and the shared RoPE key); the cache
    holds exactly what the layer hands to `Cache.update`, and the attention receives the expansion.
    `k_shape` / `v_shape`: (heads, dim) of the two cached tensors per token.
    `window`: a query at position p sees keys in (p - window, p]; None = all earlier keys.
    `sinks`: learned per-head logits join the softmax denominator (GPT-OSS).
    """

    layer: int
    kind: str
    k_shape: tuple[int, int]
    v_shape: tuple[int, int]
    window: int | None = None
    sinks: bool = False
    module: str = ""

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return (self.k_shape[0] * self.k_shape[1] + self.v_shape[0] * self.v_shape[1]) * size


@dataclass
class ModelSpec:
    arch: str
    layers: list[LayerSpec]
    dtype: torch.dtype

    @property
    def has_latent(self) -> bool:
        return any(s.kind == "latent" for s in self.layers)

    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token(self.dtype) for s in self.layers)

    def describe(self) -> str:
        kinds = sorted({s.kind for s in self.layers})
        windows = sorted({s.window for s in self.layers if s.window})
        extra = [f"sliding window {', '.join(map(str, windows))} on {sum(1 for s in self.layers if s.window)} layers"] if windows else []
        if any(s.sinks for s in self.layers):
            extra.append("attention sinks")
        return f"{self.arch}: {len(self.layers)} layers, {'+'.join(kinds)} cache" + (", " + ", ".join(extra) if extra else "")


class _ProbeCache:
    """Stands in for transformers' Cache during the probe: records what each layer would cache."""

    def __init__(self):
        self.updates: dict[int, list[tuple]] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.updates.setdefault(layer_idx, []).append((tuple(key.shape), tuple(value.shape)))
        return key, value


class Probe:
    """The step context of the probe forward: `paged_attention` records its calls into it."""

    def __init__(self):
        self.calls: dict[int, list[dict]] = {}

    def record(self, module, query, key, value, kwargs: dict) -> torch.Tensor:
        layer = getattr(module, "layer_idx", None)
        self.calls.setdefault(layer, []).append({
            "module": type(module).__name__, "q": tuple(query.shape), "k": tuple(key.shape),
            "v": tuple(value.shape), "causal": getattr(module, "is_causal", True),
            "kwargs": {k: v for k, v in kwargs.items()},
        })
        b, h, t, _ = query.shape
        return query.new_zeros(b, t, h, value.shape[-1])  # [B, T, H, Dv] like an attention output


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _config_windows(config, n: int, arch: str) -> list[int | None]:
    """The window of each layer as the model's own masks apply it: `layer_types` where the config
    has them, else one `sliding_window` for every layer (Mistral, Phi-3, Qwen3-MoE)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return [window] * n
    out = []
    for i, t in enumerate(types[:n]):
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            out.append(window)
        else:
            raise UnsupportedModel(f"{arch}: layer {i} is of type {t!r}; the engine implements full and sliding-window attention only")
    return out


def _refuse_config_features(config, arch: str) -> None:
    checks = [
        (getattr(config, "attn_logit_softcapping", None), "attention logit soft-capping (attn_logit_softcapping={})"),
        (getattr(config, "alibi", None) or getattr(config, "use_alibi", None), "ALiBi position biases ({})"),
        (getattr(config, "position_embedding_type", None) == "alibi" or None, "ALiBi position biases ({})"),
        (getattr(config, "is_encoder_decoder", None), "an encoder-decoder model ({})"),
        (getattr(config, "add_cross_attention", None), "cross-attention (add_cross_attention={})"),
        (getattr(config, "use_bidirectional_attention", None), "bidirectional attention (use_bidirectional_attention={})"),
        (getattr(config, "attention_chunk_size", None), "chunked attention (attention_chunk_size={})"),
    ]
    for value, what in checks:
        if value:
            raise UnsupportedModel(f"{arch}: {what.format(value)} is not implemented by the engine's paged attention")


def inspect_model(model, attached) -> ModelSpec:
    """Probe `model` under `attached()` (the engine's attention switched on) and return its
    ModelSpec, or raise UnsupportedModel naming the first feature the engine cannot compute exactly."""
    config = _text_config(model.config)
    arch = f"{type(model).__name__} ({getattr(config, 'model_type', '?')})"
    _refuse_config_features(config, arch)
    n = config.num_hidden_layers
    windows = _config_windows(config, n, arch)
    body = model.base_model
    device = body.get_input_embeddings().weight.device
    cache, probe = _ProbeCache(), Probe()
    ids = torch.tensor([[0, 1]], device=device)
    with attached(), probing(probe), torch.inference_mode():
        hf.run_body(body, ids, torch.arange(2, device=device)[None], cache)
    missing = [i for i in range(n) if i not in probe.calls]
    if None in probe.calls or missing:
        raise UnsupportedModel(f"{arch}: layers {missing or 'without a layer index'} do not run attention through "
                               "transformers' AttentionInterface (linear attention, recurrent state or a custom "
                               "module); the engine cannot cache them")
    layers = []
    for i in range(n):
        calls, updates = probe.calls[i], cache.updates.get(i, [])
        c = calls[0]
        if len(calls) != 1 or len(updates) != 1:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) calls attention {len(calls)} times and the cache "
                                   f"{len(updates)} times per forward; the engine needs exactly one of each")
        if not c["causal"]:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) is not causal (bidirectional attention)")
        if c["k"][-2] != c["q"][-2]:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) attends to {c['k'][-2]} keys for {c['q'][-2]} "
                                   "queries without a cache (cross-attention)")
        kw = c["kwargs"]
        if kw.get("softcap") is not None:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) uses attention logit soft-capping "
                                   f"(softcap={kw['softcap']}), which the engine's paged attention does not implement")
        unknown = sorted(k for k, v in kw.items() if k not in _KNOWN_KWARGS and v is not None)
        if unknown:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) passes {', '.join(unknown)} to the attention, "
                                   "which the engine's paged attention does not implement")
        if kw.get("is_causal") is False:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) asks for non-causal attention")
        window = windows[i]
        if "sliding_window" in kw and kw["sliding_window"] != window:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) passes sliding_window={kw['sliding_window']} but "
                                   f"its config implies {window}; the engine cannot tell which one the model applies")
        if "sliding_window" not in kw and window is not None:
            raise UnsupportedModel(f"{arch}: the config sets a sliding window of {window} but layer {i} "
                                   f"({c['module']}) does not pass it to the attention; refusing rather than guessing")
        if window is not None and window < 1:
            raise UnsupportedModel(f"{arch}: layer {i} has a sliding window of {window}")
        sinks = kw.get("s_aux") is not None
        (uk, uv) = updates[0]
        kind = "kv" if (uk, uv) == (c["k"], c["v"]) else "latent"
        if kind == "latent" and (window is not None or sinks):
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) combines a compressed (latent) cache with a "
                                   "sliding window or sinks, which the engine does not implement")
        if kind == "kv" and uk[1] != uv[1]:
            raise UnsupportedModel(f"{arch}: layer {i} ({c['module']}) has {uk[1]} key heads and {uv[1]} value heads")
        layers.append(LayerSpec(i, kind, (uk[1], uk[3]), (uv[1], uv[3]), window, sinks, c["module"]))
    dtype = next(model.parameters()).dtype
    return ModelSpec(arch, layers, dtype)
