"""Decode attention on the CPU that reads K/V in place from the paged cache.

Why: with SDPA, every layer of every decode step first gathers each sequence's whole context out of
the paged cache into a padded [B, L, heads, dim] buffer (KVCache.gather), then attends to it. At the
paper's lengths that copy is the largest cost after the linears (22% of a step at 700 tokens of
context, issue 20's profile), and it reads and writes every K/V byte twice more than attention needs.
This kernel walks each sequence's block table instead: one pass over its keys and values, in place.

It is a small C++ function compiled once on first use (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions; nothing is downloaded), parallel over (sequence, KV head) on torch's own
thread pool (at::parallel_for: no second OpenMP team, see docs/engine.md). The heads of one KV group
share each key and value read (GQA without copying heads). Sliding windows and GPT-OSS sinks are
applied exactly as the torch reference does. Where no compiler is found, `available()` is False and
the engine keeps the gather + SDPA path, saying why once.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("svrmad_local")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void run(const T* q, const T* k, const T* v, const int64_t* table, const int64_t* lens, const float* sinks,
                T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t Dv, int64_t maxb, int64_t bs,
                float scale, int64_t window) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(G * D), scores, acc(G * Dv);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / KVH, g = item % KVH, L = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - start;
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(q[(b * H + g * G + h) * D + d]);
      scores.assign(G * n, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = start + t, slot = table[b * maxb + p / bs] * bs + p % bs;
        const T* kp = k + (slot * KVH + g) * D;
        for (int64_t h = 0; h < G; ++h) {
          const float* qh = qf.data() + h * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(kp[d]);
          scores[h * n + t] = s * scale;
        }
      }
      std::vector<float> denom(G);
      for (int64_t h = 0; h < G; ++h) {
        float* sh = scores.data() + h * n;
        float m = sinks ? sinks[g * G + h] : -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
        float sum = sinks ? std::exp(sinks[g * G + h] - m) : 0.f;
        for (int64_t t = 0; t < n; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        denom[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = start + t, slot = table[b * maxb + p / bs] * bs + p % bs;
        const T* vp = v + (slot * KVH + g) * Dv;
        for (int64_t h = 0; h < G; ++h) {
          const float w = scores[h * n + t];
          float* ah = acc.data() + h * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) ah[d] += w * static_cast<float>(vp[d]);
        }
      }
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < Dv; ++d)
          out[(b * H + g * G + h) * Dv + d] = static_cast<T>(acc[h * Dv + d] / denom[h]);
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table, torch::Tensor lens,
                           int64_t block_size, double scale, int64_t window, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [B,H,D], k/v [slots,KVH,D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  auto tab = table.to(torch::kLong).contiguous();
  auto len = lens.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), Dv = v.size(2);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of KV heads");
  auto out = torch::empty({B, H, Dv}, q.options());
  torch::Tensor sk;
  if (sinks.has_value()) sk = sinks->to(torch::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), tab.data_ptr<int64_t>(),
                  len.data_ptr<int64_t>(), sinks.has_value() ? sk.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(),
                  B, H, KVH, D, Dv, tab.size(1), block_size, static_cast<float>(scale), window);
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_error: str | None = None


def _load():
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils.cpp_extension import load_inline

                _module = load_inline(
                    name="svrmad_cpu_decode", cpp_sources=[_SOURCE], functions=["paged_decode"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
            except Exception as exc:  # no compiler, no ninja, a read-only cache...
                _error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                log.info("CPU paged decode kernel unavailable (%s); decode attention gathers the context", _error)
    return _module


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_DECODE=0 turns it off."""
    if os.environ.get("SVRMAD_CPU_DECODE", "1") == "0":
        return False
    return _load() is not None


def unavailable_reason() -> str | None:
    return _error


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at position context_len - 1), k_cache/v_cache [slots, KVH, D]
    flat slots of the paged cache, block_table [B, max_blocks], context_lens [B] (keys, the query's own
    included). Returns [B, H, Dv]; the query sees keys p > L - 1 - window."""
    mod = _load()
    if mod is None:
        raise RuntimeError(f"the CPU paged decode kernel could not be built: {_error}")
    return mod.paged_decode(q.contiguous(), k_cache, v_cache, block_table, context_lens, block_size, float(scale),
                            -1 if window is None else int(window), sinks)
