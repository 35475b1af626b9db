// Decode attention on the CPU reading K/V in place through a paged cache's block tables: built by
// _cpu_build.py, called from cpu_decode.py (which says why it exists and what it measured).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

using namespace svrmad;

constexpr int64_t PF_AHEAD = 2;  // blocks ahead that prefetch_rows reads

// x[t] = e^(x[t] - m) in place; returns their sum
static inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#ifdef SVRMAD_AVX2
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
#ifdef SVRMAD_AVX2
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
#ifdef SVRMAD_AVX2
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
}
