// The fused ops of a Llama-shaped decoder layer, fp32 (RMSNorm with the residual add, RoPE with the K/V
// cache write): built by _cpu_build.py with -ffp-contract=off, called from cpu_ops.py (its numerics).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>

#include "simd.h"

#ifndef SVRMAD_AVX2
#error "the fused decoder ops need AVX2 and FMA (-mavx2 -mfma)"
#endif

using namespace svrmad;

// one row: y = w * (x * (1 / sqrt(mean(x^2) + eps)))
static inline void norm_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  float s = sum_lanes_in_order(acc);
  for (; i < h; ++i) s += x[i] * x[i];
  const float r = 1.0f / std::sqrt(s / static_cast<float>(h) + eps);
  for (int64_t j = 0; j < h; ++j) y[j] = w[j] * (x[j] * r);
}

static void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, what, ": fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), what, ": weight must be [hidden]");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w, "rms_norm");
  const int64_t R = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(X + r * H, W, Y + r * H, H, (float)eps);
  });
  return y;
}

// s = residual + x (the layer's skip connection), y = rms_norm(s): returns (y, s)
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.dtype() == x.dtype(),
              "add_rms_norm: residual must match x");
  const int64_t R = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  auto s = torch::empty_like(x);
  const float *X = x.data_ptr<float>(), *Res = residual.data_ptr<float>(), *W = w.data_ptr<float>();
  float *Y = y.data_ptr<float>(), *S = s.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < H; ++j) S[r * H + j] = Res[r * H + j] + X[r * H + j];
      norm_row(S + r * H, W, Y + r * H, H, (float)eps);
    }
  });
  return {y, s};
}

// out[j] = x[j] * cos[j] + rot(x)[j] * sin[j], rot(x) = (-x[D/2:], x[:D/2]): transformers' rotate_half
static inline void rope_head(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float a = x[j] * c[j];
    const float b = (-x[j + h]) * s[j];
    out[j] = a + b;
  }
  for (int64_t j = h; j < d; ++j) {
    const float a = x[j] * c[j];
    const float b = x[j - h] * s[j];
    out[j] = a + b;
  }
}

// q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] (any row and head strides, unit stride within a head);
// cos/sin [T, D]; caches kc [S, KVH, D], vc [S, KVH, Dv] contiguous; slots [T].
// Returns the rotated q [T, H, D]; the rotated k and v go to rows slots[t] of the caches.
torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  for (auto* t : {&q, &k, &v, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->dtype() == torch::kFloat32, "rope_store: fp32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rope_store: q, k, v must be [T, heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "rope_store: a head must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), Dv = v.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(2) == D && k.size(0) == T && v.size(0) == T && v.size(1) == KVH,
              "rope_store: q, k, v shapes disagree");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D &&
              sin.sizes() == cos.sizes(), "rope_store: cos/sin must be contiguous [T, head_dim]");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.size(1) == KVH && kc.size(2) == D &&
              vc.size(1) == KVH && vc.size(2) == Dv, "rope_store: cache shapes disagree with k/v");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.numel() == T,
              "rope_store: slots must be [T] int64");
  auto out = torch::empty({T, H, D}, q.options());
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>();
  float *O = out.data_ptr<float>(), *KC = kc.data_ptr<float>(), *VC = vc.data_ptr<float>();
  const int64_t* SL = slots.data_ptr<int64_t>();
  const int64_t S = kc.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(SL[t] >= 0 && SL[t] < S, "rope_store: slot ", SL[t], " outside the cache's ", S, " rows");
  at::parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = C + t * D, *s = Sn + t * D;
      for (int64_t h = 0; h < H; ++h)
        rope_head(Q + t * q.stride(0) + h * q.stride(1), c, s, O + (t * H + h) * D, D);
      for (int64_t h = 0; h < KVH; ++h) {
        rope_head(K + t * k.stride(0) + h * k.stride(1), c, s, KC + (SL[t] * KVH + h) * D, D);
        const float* vs = V + t * v.stride(0) + h * v.stride(1);
        std::copy(vs, vs + Dv, VC + (SL[t] * KVH + h) * Dv);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rope_store", torch::wrap_pybind_function(rope_store), "rope_store");
}
