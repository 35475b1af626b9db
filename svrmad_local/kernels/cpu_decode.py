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
this took a layer's decode attention from 6.3 ms to 2.4 ms on a 2-core AVX2 EPYC, and the fp32 AVX2
inner loops below (eight keys a reduction, vectorised exponentials, accumulators in registers) to
1.9 ms. The scattered blocks defeat the hardware's stream prefetch at every block edge, so the fp32
loops prefetch the rows two blocks ahead into L2 (2-core AVX-512 EPYC, 30 layers' caches, so nothing
stays in cache: 12 x 1,000 tokens 1.3 -> 0.9 ms a layer, 8 x 2,000 1.8 -> 1.25, 2 x 1,000 2x).
Sliding windows and GPT-OSS sinks are applied exactly as the torch reference does. Where no compiler
is found, `available()` is False and the engine keeps the gather + SDPA path, saying why once.
"""

from __future__ import annotations

import torch

from ._cpu_build import Kernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

constexpr int64_t PF_AHEAD = 2;  // blocks ahead that prefetch_rows reads

#if defined(__AVX2__) && defined(__FMA__)
// the sum of a vector's eight lanes
static inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
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
  s = hsum(s0);
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

#if defined(__AVX2__) && defined(__FMA__)
// e^x for x <= 0 (softmax exponents), 8 at a time: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor
// series to r^6 (truncation below 1e-7 relative), times 2^n built in the exponent bits. Clamped at -87
// (e^-87 ~ 2e-38, still normal), which no softmax weight can tell from 0.
static inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n*hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// the sums of eight vectors' lanes, as one vector [sum(a0), ..., sum(a7)]
static inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// x[t] = e^(x[t] - m) in place; returns their sum
static inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
    _mm256_storeu_ps(x + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; t < n; ++t) { x[t] = std::exp(x[t] - m); sum += x[t]; }
  return sum;
}

// out[j] = scale * (q . rows[j * stride]) for j < cnt (cnt <= 8): eight dots share one reduction
static inline void dots8(const float* q, const float* rows, int64_t stride, int64_t cnt, int64_t D, float scale,
                         float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (cnt == 8 && D % 8 == 0) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(rows + j * stride + d), qv, acc[j]);
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    return;
  }
#endif
  for (int64_t j = 0; j < cnt; ++j) out[j] = dotf(q, rows + j * stride, D) * scale;
}

// pulls `rows` rows of `bytes` each, `stride` bytes apart, towards L2 (the rows of a block PF_AHEAD on,
// while this one computes: a block table scatters a context, so the hardware's prefetch stops at every
// block edge)
static inline void prefetch_rows(const void* base, int64_t rows, int64_t stride, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t r = 0; r < rows; ++r, p += stride)
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
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
        if constexpr (std::is_same<T, float>::value) {  // rows read in place, eight tokens a reduction
          for (int64_t p = std::max(p0, start), e = std::min(p0 + bs, L); p < e; p += 8) {
            const int64_t cnt = std::min<int64_t>(8, e - p), t = p - start;
            const float* rows = kb + ((p - p0) * KVH + g0) * D;
            if (p0 + PF_AHEAD * bs < L)
              prefetch_rows(k + ((table[b * maxb + p0 / bs + PF_AHEAD] * bs + (p - p0)) * KVH + g0) * D, cnt,
                            KVH * D * sizeof(float), per * D * sizeof(float));
            for (int64_t h = 0; h < NH; ++h)
              dots8(qf.data() + h * D, rows + (h / G) * D, KVH * D, cnt, D, scale, scores.data() + h * n + t);
          }
          continue;
        }
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
        denom[h] = (sink ? std::exp(*sink - m) : 0.f) + exp_sub_sum(sh, n, m);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = start - start % bs; p0 < L; p0 += bs) {
        const T* vb = v + table[b * maxb + p0 / bs] * bs * KVH * Dv;
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same<T, float>::value) {
          if (Dv == 64) {  // a head's accumulator stays in registers over the block's tokens
            const int64_t p1 = std::max(p0, start), e = std::min(p0 + bs, L);
            for (int64_t h = 0; h < NH; ++h) {
              float* a = acc.data() + h * Dv;
              if (h % G == 0 && p0 + PF_AHEAD * bs < L)
                prefetch_rows(v + ((table[b * maxb + p0 / bs + PF_AHEAD] * bs + (p1 - p0)) * KVH + g0 + h / G) * Dv,
                              e - p1, KVH * Dv * sizeof(float), Dv * sizeof(float));
              __m256 r[8];
              for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(a + 8 * j);
              const float* w = scores.data() + h * n - start;
              const float* row = vb + ((p1 - p0) * KVH + g0 + h / G) * Dv;
              for (int64_t p = p1; p < e; ++p, row += KVH * Dv) {
                const __m256 wv = _mm256_set1_ps(w[p]);
                for (int j = 0; j < 8; ++j) r[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + 8 * j), r[j]);
              }
              for (int j = 0; j < 8; ++j) _mm256_storeu_ps(a + 8 * j, r[j]);
            }
            continue;
          }
        }
#endif
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

_KERNEL = Kernel("svrmad_cpu_decode_v4", _SOURCE, ["paged_decode"], "SVRMAD_CPU_DECODE", "CPU paged decode kernel")


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_DECODE=0 turns it off;
    without it decode attention gathers the context for SDPA."""
    return _KERNEL.available()


def unavailable_reason() -> str | None:
    return _KERNEL.unavailable_reason()


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, at position context_len - 1), k_cache/v_cache [slots, KVH, D]
    flat slots of the paged cache, block_table [B, max_blocks], context_lens [B] (keys, the query's own
    included). Returns [B, H, Dv]; the query sees keys p > L - 1 - window."""
    return _KERNEL.module().paged_decode(q.contiguous(), k_cache, v_cache, block_table, context_lens, block_size, float(scale),
                            -1 if window is None else int(window), sinks)
