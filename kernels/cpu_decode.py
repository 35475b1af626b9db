"""Decode attention on the CPU that reads K/V in place from the paged cache.

Why: with SDPA, every layer of every decode step first gathers each sequence's whole context out of
the paged cache into a padded [B, L, heads, dim] buffer (KVCache.gather), then attends to it. At the
paper's lengths that copy is the largest cost after the linears (22% of a step at 700 tokens of
context, issue 20's profile), and it reads and writes every K/V byte twice more than attention needs.
This kernel walks each sequence's block table instead: one pass over its keys and values, in place.

It is a small C++ function compiled once on first use (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions; nothing is downloaded), parallel on torch's own thread pool
(at::parallel_for: no second OpenMP team, see docs/engine.md) over sequences when there are at
least two per thread, else over (sequence, KV head). A whole sequence's item reads each token's K/V
row of all heads as one contiguous run, and the heads of one KV group share each read (GQA without
copying heads); one table lookup per block. At 11 sequences x 1,000 tokens of the default's shape
this took a layer's decode attention from 6.3 ms to 2.4 ms on a 2-core AVX2 EPYC. Sliding windows and GPT-OSS sinks are
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

// dot and axpy over float rows: explicit AVX2 where built for it (the compiler's reduction
// vectorisation was measured ~3x slower here), scalar otherwise
static inline float dotf(const float* a, const float* b, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  for (; d + 8 <= D; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  s0 = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpyf(float w, const float* x, float* y, int64_t D) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 wv = _mm256_set1_ps(w);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
#endif
  for (; d < D; ++d) y[d] += w * x[d];
}

// a row as floats: itself when T is float, else converted into `buf`
template <typename T>
static inline const float* as_float(const T* row, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* row, float*, int64_t) { return row; }

template <typename T>
static void run(const T* q, const T* k, const T* v, const int64_t* table, const int64_t* lens, const float* sinks,
                T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t Dv, int64_t maxb, int64_t bs,
                float scale, int64_t window) {
  const int64_t G = H / KVH;
  // one work item: a sequence and a range of its KV heads. Whole sequences when there are enough of
  // them (each token's K/V row of all heads is one contiguous read); one KV head each otherwise.
  const int64_t per = B >= 2 * at::get_num_threads() ? KVH : 1, parts = KVH / per;
  at::parallel_for(0, B * parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(per * G * D), scores, acc(per * G * Dv), kbuf(KVH * D), vbuf(KVH * Dv);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / parts, g0 = (item % parts) * per, L = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - start;
      const int64_t NH = per * G, h0 = g0 * G;  // this item's query heads: h0 .. h0 + NH
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(q[(b * H + h0 + h) * D + d]);
      scores.assign(NH * n, 0.f);
      for (int64_t p0 = start - start % bs; p0 < L; p0 += bs) {
        const T* kb = k + table[b * maxb + p0 / bs] * bs * KVH * D;
        for (int64_t p = std::max(p0, start), e = std::min(p0 + bs, L); p < e; ++p) {
          const float* kp = as_float(kb + ((p - p0) * KVH + g0) * D, kbuf.data(), per * D);
          const int64_t t = p - start;
          for (int64_t h = 0; h < NH; ++h) scores[h * n + t] = dotf(qf.data() + h * D, kp + (h / G) * D, D) * scale;
        }
      }
      std::vector<float> denom(NH);
      for (int64_t h = 0; h < NH; ++h) {
        float* sh = scores.data() + h * n;
        const float* sink = sinks ? sinks + h0 + h : nullptr;
        float m = sink ? *sink : -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
        float sum = sink ? std::exp(*sink - m) : 0.f;
        for (int64_t t = 0; t < n; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        denom[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = start - start % bs; p0 < L; p0 += bs) {
        const T* vb = v + table[b * maxb + p0 / bs] * bs * KVH * Dv;
        for (int64_t p = std::max(p0, start), e = std::min(p0 + bs, L); p < e; ++p) {
          const float* vp = as_float(vb + ((p - p0) * KVH + g0) * Dv, vbuf.data(), per * Dv);
          const int64_t t = p - start;
          for (int64_t h = 0; h < NH; ++h) axpyf(scores[h * n + t], vp + (h / G) * Dv, acc.data() + h * Dv, Dv);
        }
      }
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t d = 0; d < Dv; ++d)
          out[(b * H + h0 + h) * Dv + d] = static_cast<T>(acc[h * Dv + d] / denom[h]);
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

_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                                     "-mavx512dq"]}
_lock = threading.Lock()
_module = None
_error: str | None = None


def _load():
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils.cpp_extension import load_inline

                # built per ISA level, never -march=native: ~/.cache may outlive the machine it was
                # built on, and a build for another CPU's features would die on an illegal instruction
                isa = torch.backends.cpu.get_cpu_capability().lower()
                # -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers; built
                # without it the pragma is ignored and the kernel ran on one thread (measured: 2 threads
                # = 1). It links libgomp.so.1, which the loader resolves to the copy torch already
                # loaded (same soname): one OpenMP runtime, the worker thread's one team.
                omp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
                _module = load_inline(
                    name=f"svrmad_cpu_decode_v2_{isa}", cpp_sources=[_SOURCE], functions=["paged_decode"],
                    extra_cflags=["-O3", "-fopenmp-simd", *omp, *_ISA_FLAGS.get(isa, [])], extra_ldflags=omp,
                    verbose=False)
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
