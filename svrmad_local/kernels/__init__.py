"""Kernels of the local engine (see docs/kernels.md).

* :func:`token_stats` - fused LM-head statistics (target log-prob, entropy, top-k, lse) without a
  [T, V] fp32 logits tensor.
* :func:`attend_partial`, :func:`merge_states`, :func:`cascade_attention` - shared-prefix
  (cascade) attention over the paged KV cache, with optional sliding windows; :func:`cascade_plan`
  builds its Triton bookkeeping once for many calls (the layers of a step).
* :func:`apply_sinks` - GPT-OSS attention sinks on any finished ``(out, lse)``.
* :func:`paged_decode` - decode attention reading K/V in place through a block table (split-K).
* ``kernels.sample_pack.sample_pack`` - a decode step's sampling and token statistics in two kernels.
* :func:`paged_prefill` - causal prefill attention of varlen runs, reading K/V in place the same way.
* :func:`dequantize_mxfp4`, :func:`mxfp4_matmul` - GPT-OSS's MXFP4 experts, from the packed bytes.
* :func:`dequantize_fp8`, :func:`fp8_matmul` - DeepSeek-V3's block-scaled FP8 e4m3 weights.

Every kernel function takes ``kernel_impl="auto"|"torch"|"triton"``; "auto" uses triton only when it is
importable and the tensors are on CUDA (``SVRMAD_KERNELS=torch`` forces the torch reference).
"""
from ._backend import HAS_TRITON, select_impl
from .paged_decode import paged_decode, reference_paged_decode
from .paged_prefill import paged_prefill, reference_paged_prefill
from .prefix_attention import (CascadePlan, Level, apply_sinks, attend_partial, cascade_attention, cascade_plan,
                               merge_states, reference_attention)
from .fp8 import dequantize_fp8, fp8_matmul
from .mxfp4 import dequantize_mxfp4, mxfp4_matmul
from .token_stats import TokenStats, reference_token_stats, token_stats

__all__ = [
    "HAS_TRITON", "select_impl", "TokenStats", "token_stats", "reference_token_stats",
    "Level", "attend_partial", "merge_states", "cascade_attention", "cascade_plan", "CascadePlan", "apply_sinks",
    "paged_decode", "reference_paged_decode", "paged_prefill", "reference_paged_prefill",
    "reference_attention", "dequantize_mxfp4", "mxfp4_matmul", "dequantize_fp8", "fp8_matmul",
]
