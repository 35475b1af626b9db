"""The tensor-parallel plan as rules on tensor names: which weights split, and how.

One table, read by the loader (models/shard.py, which cuts the tensors) and by `svrmad plan`
(models/plan.py, which counts the bytes each rank holds), so the two cannot disagree. The names are
the published ones (and transformers' module names, which are the same for these architectures);
a tensor no rule names is whole on every rank. docs/plan.md, "Tensor parallel", says why each is so.
"""
from __future__ import annotations

import re

# the architectures the plan covers, by config.model_type
PLANNED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")
SCALE = "_scale_inv"  # FP8 block scales: cut with their weight, on its block grid

RULES = [
    (re.compile(r"mlp\.experts\."), "experts"),  # routed experts: by expert (expert parallel)
    (re.compile(r"self_attn\.([qkv]|q_b|kv_b)_proj\.(weight|weight_scale_inv|bias)$"), "rows"),  # by heads
    (re.compile(r"self_attn\.sinks$"), "rows"),
    (re.compile(r"self_attn\.o_proj\.(weight|weight_scale_inv)$"), "cols"),
    (re.compile(r"self_attn\.o_proj\.bias$"), "first"),  # added once: on the group's first rank
    (re.compile(r"mlp\.(shared_experts?\.)?(gate|up)_proj\.(weight|weight_scale_inv|bias)$"), "rows"),
    (re.compile(r"mlp\.(shared_experts?\.)?down_proj\.(weight|weight_scale_inv)$"), "cols"),
    (re.compile(r"mlp\.(shared_experts?\.)?down_proj\.bias$"), "first"),
]
DIM = {"rows": 0, "cols": -1, "experts": 0}  # the dimension each kind cuts


def split_of(name: str) -> str:
    """How tensor `name` splits: experts, rows, cols, first (whole on the first rank, zeros on the
    others) or whole."""
    return next((how for pattern, how in RULES if pattern.search(name)), "whole")
