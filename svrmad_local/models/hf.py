"""Where the engine meets transformers: the one module that knows how its releases differ.

The engine rides transformers' own modules (docs/architecture.md, "How the engine meets the model
code") and plugs in at a few public-ish seams: the cache object a model body forwards to every layer,
the attention function registered by name, the table of causal-LM architectures, the chat-template
environment, the library's logging. Each seam is named here once, so a new release that moves one is
one change in one file, and the range of releases CI tests (`LOWEST` .. `HIGHEST`, both ends run the
exactness tests: .ci/run) is stated next to the code that depends on it.

Differences handled today:
- which weights a load keeps in fp32 when bf16/fp16 is asked (`_keep_in_fp32_modules_strict`: DeepSeek-V3's
  router): `from_pretrained` applies it in every release, but a model built by `from_config` (our
  quantized and sharded loads fill such a model) has them in fp32 only from 5.24, whose modeling code
  makes them so; `apply_dtype_plan` gives a built model what `from_pretrained` would.
- the keyword that carries the cache into a model body (and on to every layer's `Cache.update`):
  `past_key_values` up to 5.23, `cache` from 5.24 (5.40 drops the old name). It is read from the
  body's own signature, once per class, so a model that moved early or late still gets the right one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re

import torch

LOWEST = "5.17"  # the lowest release CI runs the exactness tests under (.ci/run)
HIGHEST = "5.24"  # the highest; pyproject's pin is >=LOWEST, <HIGHEST + 1 minor


def version() -> str:
    import transformers

    return transformers.__version__


@functools.cache
def cache_kwarg(body_type: type) -> str:
    """The keyword under which `body_type.forward` takes the cache it hands every layer."""
    params = inspect.signature(body_type.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ValueError(f"{body_type.__name__}.forward takes no cache (neither `cache` nor `past_key_values`) "
                    f"under transformers {version()}")


def run_body(body, ids, pos, cache):
    """The model body (the base model, without its head) over ids/pos [1, T], every layer's cache
    writes going to `cache`; transformers' own cache is never built (use_cache=False)."""
    return body(input_ids=ids, position_ids=pos, use_cache=False, **{cache_kwarg(type(body)): cache})


def register_attention(name: str, fn) -> None:
    """Make `fn` selectable as `model.set_attn_implementation(name)`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


def attn_implementation(config):
    """The attention implementation `config` holds as set (None: transformers' default choice)."""
    return config._attn_implementation_internal


def set_attn_implementation(config, value) -> None:
    """Switch `config`'s attention without transformers' checks (they ran once, in the model's
    `set_attn_implementation`): the engine flips it around each of its own forwards."""
    config._attn_implementation_internal = value


def causal_lm_types() -> frozenset[str]:
    """The `model_type`s transformers builds as a causal LM (AutoModelForCausalLM's table)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@contextlib.contextmanager
def quiet():
    """transformers' logging at errors only for the block, restored after it (never for the process)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def template_environment(template: str):
    """The jinja environment transformers renders `template` in (its extensions: {% generation %}...),
    or a plain one with the loop controls where this release has no such helper."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template).environment
    except (ImportError, AttributeError):
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def load_generation_config(model, path) -> None:
    """The folder's generation_config.json onto `model` (built from a config, it has a default one);
    without that file the default stays."""
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        pass


def apply_dtype_plan(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast, in place, the weights and buffers that `from_pretrained(dtype=dtype)` would keep in another
    dtype (the model's own plan: names matched as transformers matches them, `*` any run), so a model
    built by `from_config` and filled by us ends in the dtypes a plain load gives. Packed tensors
    (any dtype other than `dtype`) are left alone."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    rules = [(re.compile(pattern.replace("*", ".*")), want) for pattern, want in plan.items()]
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                want = next((w for r, w in rules if r.search(prefix + name)), None)
                if t is None or want is None or t.dtype != dtype:
                    continue
                store[name] = torch.nn.Parameter(t.to(want), requires_grad=t.requires_grad) if isinstance(
                    t, torch.nn.Parameter) else t.to(want)
