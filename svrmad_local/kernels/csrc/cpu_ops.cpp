// The fused ops of a Llama-shaped decoder layer, fp32 and bf16 (RMSNorm with the residual add, RoPE with
// the K/V cache write, SiLU-and-multiply): built by _cpu_build.py with -ffp-contract=off, called from
// cpu_ops.py (its numerics). Every value is computed in fp32; a bf16 tensor is rounded where transformers'
// bf16 modules round (each of their ops returns bf16), so the ops compute the modules' bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "kernel_api.h"
#include "simd.h"

#ifndef SVRMAD_AVX2
#error "the fused decoder ops need AVX2 and FMA (-mavx2 -mfma)"
#endif

#include <sleef.h>  // torch's own exponential (libtorch_cpu exports it): SiLU computes torch's bits

using namespace svrmad;

// an element of T as fp32, and fp32 back to T (bf16: rounded to nearest even, as torch rounds)
template <typename T> static inline float to_f(T v);
template <> inline float to_f<float>(float v) { return v; }
template <> inline float to_f<uint16_t>(uint16_t v) { return bf16_to_float(v); }
template <typename T> static inline T from_f(float v);
template <> inline float from_f<float>(float v) { return v; }
template <> inline uint16_t from_f<uint16_t>(float v) { return float_to_bf16(v); }
// what an op of transformers returns in T, read back as fp32: itself in fp32, rounded to bf16 in bf16
template <typename T> static inline float round_as(float v) { return to_f<T>(from_f<T>(v)); }

template <typename T> static inline __m256 load8(const T* p);
template <> inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<uint16_t>(const uint16_t* p) { return load_bf16x8(p); }
// round_as and from_f, eight lanes at once (the same bits: simd.h rounds as float_to_bf16 does)
template <typename T> static inline __m256 round8(__m256 v);
template <> inline __m256 round8<float>(__m256 v) { return v; }
template <> inline __m256 round8<uint16_t>(__m256 v) { return round_bf16x8(v); }
template <typename T> static inline void store8(T* p, __m256 v);
template <> inline void store8<float>(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <> inline void store8<uint16_t>(uint16_t* p, __m256 v) { store_bf16x8(p, v); }

// one row: y = w * (x * (1 / sqrt(mean(x^2) + eps))); in bf16 the normalised x is rounded to bf16 before
// the weight multiplies it (transformers' `weight * hidden_states.to(input_dtype)`)
template <typename T>
static inline void norm_row(const T* x, const T* w, T* y, int64_t h, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    __m256 v = load8<T>(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  float s = sum_lanes_in_order(acc);
  for (; i < h; ++i) s += to_f<T>(x[i]) * to_f<T>(x[i]);
  const float r = 1.0f / std::sqrt(s / static_cast<float>(h) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t j = 0;
  for (; j + 8 <= h; j += 8) store8<T>(y + j, _mm256_mul_ps(load8<T>(w + j), round8<T>(_mm256_mul_ps(load8<T>(x + j), rv))));
  for (; j < h; ++j) y[j] = from_f<T>(to_f<T>(w[j]) * round_as<T>(to_f<T>(x[j]) * r));
}

static void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": fp32 or bf16 only");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": the weight's dtype must be x's");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), what, ": weight must be [hidden]");
}

// an output the caller made (the compiled decode step keeps its outputs between steps): its shape, x's dtype
static void check_out(const torch::Tensor& out, at::IntArrayRef shape, const torch::Tensor& like, const char* what) {
  TORCH_CHECK(out.is_contiguous() && out.sizes() == shape && out.scalar_type() == like.scalar_type(), what,
              ": the output must be a contiguous tensor of the input's dtype and the result's shape");
}

// the data of an fp32 tensor as float, of a bf16 one as its raw bits
template <typename T> static inline T* data(const torch::Tensor& t) {
  if constexpr (std::is_same<T, float>::value) return t.data_ptr<float>();
  else return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

#define SVRMAD_DISPATCH(t, ...)                         \
  if ((t).scalar_type() == at::kFloat) {                \
    using T = float;                                    \
    __VA_ARGS__                                         \
  } else {                                              \
    using T = uint16_t;                                 \
    __VA_ARGS__                                         \
  }

void rms_norm_into(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor y) {
  check_rows(x, w, "rms_norm");
  check_out(y, x.sizes(), x, "rms_norm");
  const int64_t R = x.size(0), H = x.size(1);
  SVRMAD_DISPATCH(x, {
    const T *X = data<T>(x), *W = data<T>(w);
    T* Y = data<T>(y);
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row<T>(X + r * H, W, Y + r * H, H, (float)eps);
    });
  })
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  auto y = torch::empty_like(x);
  rms_norm_into(x, w, eps, y);
  return y;
}

// s = residual + x (the layer's skip connection, rounded to x's dtype), y = rms_norm(s), into y and s; s may be
// the residual itself (each element is read before it is written)
void add_rms_norm_into(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps, torch::Tensor y,
                       torch::Tensor s) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.dtype() == x.dtype(),
              "add_rms_norm: residual must match x");
  check_out(y, x.sizes(), x, "add_rms_norm");
  check_out(s, x.sizes(), x, "add_rms_norm");
  const int64_t R = x.size(0), H = x.size(1);
  SVRMAD_DISPATCH(x, {
    const T *X = data<T>(x), *Res = data<T>(residual), *W = data<T>(w);
    T *Y = data<T>(y), *S = data<T>(s);
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int64_t j = 0;
        for (; j + 8 <= H; j += 8) store8<T>(S + r * H + j, _mm256_add_ps(load8<T>(Res + r * H + j), load8<T>(X + r * H + j)));
        for (; j < H; ++j) S[r * H + j] = from_f<T>(to_f<T>(Res[r * H + j]) + to_f<T>(X[r * H + j]));
        norm_row<T>(S + r * H, W, Y + r * H, H, (float)eps);
      }
    });
  })
}

// returns (y, s)
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  auto y = torch::empty_like(x), s = torch::empty_like(x);
  add_rms_norm_into(x, residual, w, eps, y, s);
  return {y, s};
}

// out[j] = x[j] * cos[j] + rot(x)[j] * sin[j], rot(x) = (-x[D/2:], x[:D/2]): transformers' rotate_half;
// in bf16 each product and the sum rounded to bf16, as its three bf16 ops round them
template <typename T>
static inline void rope_head(const T* x, const T* c, const T* s, T* out, int64_t d) {
  const int64_t h = d / 2;
  if (h % 8 == 0) {  // eight lanes at once, the same arithmetic
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t j = 0; j < h; j += 8) {
      const __m256 a = round8<T>(_mm256_mul_ps(load8<T>(x + j), load8<T>(c + j)));
      const __m256 b = round8<T>(_mm256_mul_ps(_mm256_xor_ps(load8<T>(x + j + h), sign), load8<T>(s + j)));
      store8<T>(out + j, _mm256_add_ps(a, b));
    }
    for (int64_t j = h; j < d; j += 8) {
      const __m256 a = round8<T>(_mm256_mul_ps(load8<T>(x + j), load8<T>(c + j)));
      const __m256 b = round8<T>(_mm256_mul_ps(load8<T>(x + j - h), load8<T>(s + j)));
      store8<T>(out + j, _mm256_add_ps(a, b));
    }
    return;
  }
  for (int64_t j = 0; j < h; ++j) {
    const float a = round_as<T>(to_f<T>(x[j]) * to_f<T>(c[j]));
    const float b = round_as<T>((-to_f<T>(x[j + h])) * to_f<T>(s[j]));
    out[j] = from_f<T>(a + b);
  }
  for (int64_t j = h; j < d; ++j) {
    const float a = round_as<T>(to_f<T>(x[j]) * to_f<T>(c[j]));
    const float b = round_as<T>(to_f<T>(x[j - h]) * to_f<T>(s[j]));
    out[j] = from_f<T>(a + b);
  }
}

// q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] (any row and head strides, unit stride within a head);
// cos/sin [T, D]; caches kc [S, KVH, D], vc [S, KVH, Dv] contiguous; slots [T]; one dtype throughout.
// Writes the rotated q into `out` [T, H, D]; the rotated k and v go to rows slots[t] of the caches.
void rope_store_into(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor kc, torch::Tensor vc, torch::Tensor slots, torch::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "rope_store: fp32 or bf16 only");
  for (auto* t : {&k, &v, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "rope_store: q, k, v, cos, sin and the caches in one dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rope_store: q, k, v must be [T, heads, dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "rope_store: a head must be contiguous");
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), Dv = v.size(2);
  TORCH_CHECK(D % 2 == 0 && k.size(2) == D && k.size(0) == T_ && v.size(0) == T_ && v.size(1) == KVH,
              "rope_store: q, k, v shapes disagree");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T_ && cos.size(1) == D &&
              sin.sizes() == cos.sizes(), "rope_store: cos/sin must be contiguous [T, head_dim]");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.size(1) == KVH && kc.size(2) == D &&
              vc.size(1) == KVH && vc.size(2) == Dv, "rope_store: cache shapes disagree with k/v");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.is_contiguous() && slots.numel() == T_,
              "rope_store: slots must be [T] int64");
  check_out(out, {T_, H, D}, q, "rope_store");
  const int64_t* SL = slots.data_ptr<int64_t>();
  const int64_t S = kc.size(0);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(SL[t] >= 0 && SL[t] < S, "rope_store: slot ", SL[t], " outside the cache's ", S, " rows");
  SVRMAD_DISPATCH(q, {
    const T *Q = data<T>(q), *K = data<T>(k), *V = data<T>(v), *C = data<T>(cos), *Sn = data<T>(sin);
    T *O = data<T>(out), *KC = data<T>(kc), *VC = data<T>(vc);
    at::parallel_for(0, T_, 32, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const T *c = C + t * D, *s = Sn + t * D;
        for (int64_t h = 0; h < H; ++h)
          rope_head<T>(Q + t * q.stride(0) + h * q.stride(1), c, s, O + (t * H + h) * D, D);
        for (int64_t h = 0; h < KVH; ++h) {
          rope_head<T>(K + t * k.stride(0) + h * k.stride(1), c, s, KC + (SL[t] * KVH + h) * D, D);
          const T* vs = V + t * v.stride(0) + h * v.stride(1);
          std::copy(vs, vs + Dv, VC + (SL[t] * KVH + h) * Dv);
        }
      }
    });
  })
}

torch::Tensor rope_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  TORCH_CHECK(q.dim() == 3, "rope_store: q, k, v must be [T, heads, dim]");
  auto out = torch::empty(q.sizes(), q.options());
  rope_store_into(q, k, v, cos, sin, kc, vc, slots, out);
  return out;
}

// SiLU(g) = g / (1 + e^-g) with the exponential torch's vectorised SiLU takes (Sleef's, 1 ulp; the same bits
// at 8 and 16 lanes), eight at a time
static inline __m256 silu8(__m256 g) {
  const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

#if defined(SVRMAD_X86_TARGETS) && defined(__AVX512F__)
// silu_mul's loop sixteen lanes at a time, in a build for AVX-512 (sleef.h declares the sixteen-lane
// exponential there) on a CPU whose isa_level() allows it: each lane does what a lane of the eight-lane loop
// does (Sleef's exponential gives the same bits at 8 and 16 lanes; the division and the rounding are exact
// per lane), so the same bits with half the instructions
#define SVRMAD_SILU16 1
template <typename T> static inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<uint16_t>(const uint16_t* p) { return load_bf16x16(p); }
template <typename T> static inline __m512 round16(__m512 v);
template <> inline __m512 round16<float>(__m512 v) { return v; }
template <> inline __m512 round16<uint16_t>(__m512 v) { return round_bf16x16(v); }
template <typename T> static inline void store16(T* p, __m512 v);
template <> inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <> inline void store16<uint16_t>(uint16_t* p, __m512 v) { store_bf16x16(p, v); }
static inline __m512 silu16(__m512 g) {
  const __m512 e = Sleef_expf16_u10avx512f(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
#endif

// out = silu(gate) * up, rows of I: gate [R, I] and up [R, I] with any row stride (the two halves of one
// fused gate/up output), out contiguous. `vec`: the elements torch's vectorised loop takes at once on this
// machine; the last I % vec of a row it computes with std::exp instead, and so does this. In bf16 the SiLU
// is rounded to bf16 before the product, as F.silu's output is.
void silu_mul_into(torch::Tensor gate, torch::Tensor up, int64_t vec, torch::Tensor out) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16, "silu_mul: fp32 or bf16 only");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type(), "silu_mul: gate and up in one dtype");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: gate and up must be [rows, I] with contiguous rows");
  TORCH_CHECK(vec >= 1, "silu_mul: vec must be positive");
  const int64_t R = gate.size(0), I = gate.size(1), full = I - I % vec;
  check_out(out, {R, I}, gate, "silu_mul");
  SVRMAD_DISPATCH(gate, {
    const T *G = data<T>(gate), *U = data<T>(up);
    T* O = data<T>(out);
    const int64_t gs = gate.stride(0), us = up.stride(0);
#ifdef SVRMAD_SILU16
    const bool wide = isa_level() >= ISA_AVX512;
#endif
    at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T *g = G + r * gs, *u = U + r * us;
        T* o = O + r * I;
        int64_t j = 0;
#ifdef SVRMAD_SILU16
        if (wide)
          for (; j + 16 <= full; j += 16)
            store16<T>(o + j, _mm512_mul_ps(round16<T>(silu16(load16<T>(g + j))), load16<T>(u + j)));
#endif
        for (; j + 8 <= full; j += 8)  // the tail's arithmetic, eight lanes at once
          store8<T>(o + j, _mm256_mul_ps(round8<T>(silu8(load8<T>(g + j))), load8<T>(u + j)));
        for (; j < I; ++j) {
          const float x = to_f<T>(g[j]);
          o[j] = from_f<T>(round_as<T>(x / (1.0f + std::exp(-x))) * to_f<T>(u[j]));
        }
      }
    });
  })
}

torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up, int64_t vec) {
  TORCH_CHECK(gate.dim() == 2, "silu_mul: gate and up must be [rows, I] with contiguous rows");
  auto out = torch::empty(gate.sizes(), gate.options());
  silu_mul_into(gate, up, vec, out);
  return out;
}

// ---- The row selections of sampling and the token statistics (engine/sampler.py, engine/stats.py) ----
//
// torch.topk on the CPU, where k * 64 <= V (aten TopKImpl.h), copies a row into (value, index) pairs and
// runs std::partial_sort with "NaN first, then greater": a heap of the first k pairs, each later pair that
// compares before the heap's top taking its place (libstdc++'s __heap_select), then the heap sorted. Its
// order among equal values is that algorithm's, and bf16 logits tie often near the top. `topk_rows` runs
// the same heap operations on the same pairs in the same order through the same std:: algorithms
// (std::pop_heap over k + 1 pairs is __heap_select's replacement step), so it returns torch's values and
// indices, ties included. It is fast because it skips, sixteen at a time, the values the heap would not
// take (none greater than its top, none NaN): those leave the heap as it was. torch also writes the
// 786 KB of pairs of a 49,152-token row first; this writes the k + 1 of the heap.
using Scored = std::pair<float, int64_t>;

struct FirstOf {  // torch's comparator: a NaN before any number, then the greater value
  bool operator()(const Scored& x, const Scored& y) const {
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
  }
};

// whether any of x[0..16) could enter a heap whose top is `top`: greater than it, or NaN
static inline bool any_enters(const float* x, float top) {
  const __m256 t = _mm256_set1_ps(top);
  const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8);
  const __m256 hit = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, t, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)),
                                  _mm256_or_ps(_mm256_cmp_ps(b, t, _CMP_GT_OQ), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
  return _mm256_movemask_ps(hit) != 0;
}

static void topk_row(const float* x, int64_t V, int64_t k, Scored* heap, float* vals, int64_t* idx) {
  const FirstOf first;
  for (int64_t j = 0; j < k; ++j) heap[j] = Scored(x[j], j);
  std::make_heap(heap, heap + k, first);
  auto offer = [&](int64_t j) {
    const Scored p(x[j], j);
    if (first(p, heap[0])) {  // __pop_heap(heap, heap + k, p): p sifted in from the top, the top let go
      heap[k] = p;
      std::pop_heap(heap, heap + k + 1, first);
    }
  };
  int64_t j = k;
  for (; j + 16 <= V; j += 16)
    if (any_enters(x + j, heap[0].first))
      for (int64_t i = j; i < j + 16; ++i) offer(i);
  for (; j < V; ++j) offer(j);
  std::sort_heap(heap, heap + k, first);
  for (int64_t i = 0; i < k; ++i) {
    vals[i] = heap[i].first;
    idx[i] = heap[i].second;
  }
}

// torch.topk(x, k, dim=-1) of a contiguous fp32 [R, V] with 0 < k and k * 64 <= V: (values [R, k], indices [R, k])
std::vector<torch::Tensor> topk_rows(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "topk_rows: x must be a contiguous fp32 [rows, V] tensor");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k > 0 && k * 64 <= V, "topk_rows: k must be in [1, V / 64] (torch sorts otherwise)");
  auto vals = torch::empty({R, k}, x.options());
  auto idx = torch::empty({R, k}, x.options().dtype(torch::kInt64));
  const float* X = x.data_ptr<float>();
  float* Vo = vals.data_ptr<float>();
  int64_t* Io = idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Scored> heap(k + 1);
    for (int64_t r = r0; r < r1; ++r) topk_row(X + r * V, V, k, heap.data(), Vo + r * k, Io + r * k);
  });
  return {vals, idx};
}

// torch.argmax(x, -1) of a contiguous fp32 [R, V]: the first NaN's index where a row has one, else the
// first index of its greatest value (aten's ArgMaxOps: ties go to the lower index)
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: x must be a contiguous fp32 [rows, V] tensor, V > 0");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(torch::kInt64));
  const float* X = x.data_ptr<float>();
  int64_t* O = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = X + r * V;
      __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(row + j);
        best = _mm256_max_ps(best, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, best);
      float m = -INFINITY;
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (float l : lanes) m = std::max(m, l);
      for (; j < V; ++j) {
        has_nan = has_nan || std::isnan(row[j]);
        if (row[j] > m) m = row[j];
      }
      int64_t at = 0;
      for (int64_t i = 0; i < V; ++i)
        if (has_nan ? std::isnan(row[i]) : row[i] == m) {
          at = i;
          break;
        }
      O[r] = at;
    }
  });
  return out;
}

// ---- A step's sampling, statistics and packing in one call (engine/sampler.py `sample_packed`) ----
//
// The draw is sampler.sample_rows' torch ops, one for one and in their order, called from here: each the same
// ATen kernel on the same inputs, so the tokens are theirs (the selections are topk_rows and argmax_rows, as
// cpu_ops.topk and cpu_ops.argmax call them). The statistics are one pass of our own over each row
// (`row_stats`), within float rounding of stats.stats_from_logits.

// cpu_ops.topk: the compiled selection where torch takes its partial sort (k * 64 <= V), torch's own else
static std::tuple<torch::Tensor, torch::Tensor> select_top(const torch::Tensor& x, int64_t k) {
  if (k * 64 <= x.size(1)) {
    auto vi = topk_rows(x.contiguous(), k);
    return {vi[0], vi[1]};
  }
  return x.topk(k, -1);
}

// sampler.draw's arithmetic after the temperature (the rows' top-K, masks, softmax, CDF and draw)
static torch::Tensor draw_rows(const torch::Tensor& lg, const torch::Tensor& ks, const torch::Tensor& ps,
                               const torch::Tensor& u, int64_t K) {
  torch::Tensor vals, idx;
  if (K < lg.size(1)) {
    std::tie(vals, idx) = select_top(lg, K);
  } else {
    std::tie(vals, idx) = lg.sort(-1, true);
  }
  auto ranks = torch::arange(vals.size(1), ks.options());
  vals = vals.masked_fill(ranks.unsqueeze(0).ge(ks.unsqueeze(1)), -INFINITY);
  auto probs = torch::softmax(vals, -1);
  auto cum = probs.cumsum(-1);
  probs = probs.masked_fill((cum - probs).ge(ps.unsqueeze(1)), 0.0);
  cum = probs.cumsum(-1);
  auto target = (u * cum.select(1, -1).to(torch::kFloat64)).to(cum.scalar_type()).unsqueeze(1);
  auto pos = torch::searchsorted(cum, target, /*out_int32=*/false, /*right=*/true).clamp_max(vals.size(1) - 1);
  pos = torch::minimum(pos, probs.gt(0).sum(-1, /*keepdim=*/true) - 1).clamp_min(0);
  return idx.gather(1, pos).squeeze(1);
}

// The statistics of one row, from one read for its maximum and one for its exponentials: lse = m + log(s), s =
// sum e^(x - m); the log-prob of x is (x - m) - log(s), as torch's log_softmax writes it; the entropy, -sum p
// log p, is log(s) - t / s with t = sum e^(x - m) (x - m) (the Triton kernels' identity, kernels/sample_pack.py).
// Sixteen lanes of sums in a fixed order, then each lane in order: a row's figures do not depend on its batch
// mates or the threads. With torch's ops for these (log_softmax, exp, the product, three sums, the packing's
// casts, two [rows, vocab] buffers) the call took ~0.21 ms for a 49,152-token row in cache, ~0.09 now with the
// draw (~0.66 -> ~0.43 ms on the engine's worker, where the row comes from the LM head). The sums
// run in another order than torch's: log-probs and entropies agree with stats.stats_from_logits within float
// rounding, the top ids exactly (the top-k of the logits, whose order the log-probs keep). A row holding NaN or
// an infinity gets a NaN entropy, as torch's ops give it, and the step fails its request (engine/step.py).
struct RowStats {
  float m, log_s, entropy;
};

static RowStats row_stats(const float* x, int64_t V) {
  __m256 mx = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.f);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    mx = _mm256_max_ps(mx, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, v), inf, _CMP_NLT_UQ));  // |v| = inf, or NaN
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = -INFINITY;
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (float l : lanes) m = std::max(m, l);
  for (int64_t i = j; i < V; ++i) {
    finite = finite && std::isfinite(x[i]);
    m = std::max(m, x[i]);
  }
  if (!finite) return {m, NAN, NAN};
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, t[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  j = 0;
  for (; j + 16 <= V; j += 16)
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * h), mv), e = exp_neg8(d);
      s[h] = _mm256_add_ps(s[h], e);
      t[h] = _mm256_fmadd_ps(e, d, t[h]);
    }
  double S = static_cast<double>(sum_lanes_in_order(s[0])) + sum_lanes_in_order(s[1]);
  double Tt = static_cast<double>(sum_lanes_in_order(t[0])) + sum_lanes_in_order(t[1]);
  for (; j < V; ++j) {
    const float d = x[j] - m, e = std::exp(d);
    S += e;
    Tt += static_cast<double>(e) * d;
  }
  const double log_s = std::log(S);
  return {m, static_cast<float>(log_s), static_cast<float>(log_s - Tt / S)};
}

// stats.pack(tokens, stats.stats_from_logits(logits, tokens, topk)) by row_stats: [R, 3 + 2k] float64, row by row
static torch::Tensor stats_packed(const torch::Tensor& logits, const torch::Tensor& toks, int64_t topk) {
  const int64_t R = logits.size(0), V = logits.size(1), k = std::min(topk, V);
  torch::Tensor top_v, top_i;
  if (k > 0) {  // the log-probs' top-k is the logits' (the same order)
    std::tie(top_v, top_i) = select_top(logits, k);
    top_v = top_v.contiguous(), top_i = top_i.contiguous();
  }
  auto out = torch::empty({R, 3 + 2 * k}, logits.options().dtype(torch::kFloat64));
  const float* X = logits.data_ptr<float>();
  const int64_t* tok = toks.data_ptr<int64_t>();
  const float* TV = k > 0 ? top_v.data_ptr<float>() : nullptr;
  const int64_t* TI = k > 0 ? top_i.data_ptr<int64_t>() : nullptr;
  double* O = out.data_ptr<double>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = X + r * V;
      const RowStats st = row_stats(x, V);
      const auto logp = [&](float v) { return (v - st.m) - st.log_s; };  // torch's log_softmax's two steps
      double* o = O + r * (3 + 2 * k);
      o[0] = static_cast<double>(tok[r]);
      o[1] = logp(x[tok[r]]);
      o[2] = st.entropy;
      for (int64_t i = 0; i < k; ++i) {
        o[3 + i] = logp(TV[r * k + i]);
        o[3 + k + i] = static_cast<double>(TI[r * k + i]);
      }
    }
  });
  return out;
}

// sampler.sample_rows(logits, draws) and the statistics, packed: logits [R, V] fp32, `table` the draws' [5, R]
// float64 table (temperature, top-k, top-p, u, greedy), K and topk their widths
torch::Tensor sample_pack(torch::Tensor logits, torch::Tensor table, int64_t K, int64_t topk) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "sample_pack: logits must be a contiguous fp32 [rows, V] tensor, V > 0");
  const int64_t R = logits.size(0);
  TORCH_CHECK(table.scalar_type() == at::kDouble && table.dim() == 2 && table.size(0) == 5 && table.size(1) == R &&
                  table.device().is_cpu(), "sample_pack: table must be float64 [5, rows] on the CPU");
  TORCH_CHECK(K > 0 && topk >= 0, "sample_pack: K must be positive and topk not negative");
  auto t = table.contiguous();
  const double* T = t.data_ptr<double>();
  bool all_greedy = true, any_greedy = false, all_unit = true;
  for (int64_t r = 0; r < R; ++r) {
    const bool g = T[4 * R + r] != 0;
    all_greedy = all_greedy && g;
    any_greedy = any_greedy || g;
    all_unit = all_unit && T[r] == 1;
  }
  torch::Tensor toks;
  if (all_greedy) {
    toks = argmax_rows(logits);
  } else {  // sampler.columns, then sampler.draw (x / 1 is x: no division where every temperature is 1)
    auto lg = all_unit ? logits : logits / t[0].to(torch::kFloat).unsqueeze(1);
    toks = draw_rows(lg, t[1].to(torch::kLong), t[2].to(torch::kFloat), t[3], K);
    if (any_greedy) toks = torch::where(t[4].ne(0), argmax_rows(logits), toks);
  }
  return stats_packed(logits, toks.contiguous(), topk);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rope_store", torch::wrap_pybind_function(rope_store), "rope_store");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("topk_rows", torch::wrap_pybind_function(topk_rows), "topk_rows");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("sample_pack", torch::wrap_pybind_function(sample_pack), "sample_pack");
  m.def("isa_level", []() { return isa_level(); }, "the run-time ISA level the ops take");
  m.def("set_isa_level", [](int level) { return set_isa_level(level); }, "caps it; returns the one before");
  m.def("addresses", []() {
    return std::vector<int64_t>{svrmad::address<svrmad::NormFn>(&rms_norm_into),
                                svrmad::address<svrmad::AddNormFn>(&add_rms_norm_into),
                                svrmad::address<svrmad::RopeFn>(&rope_store_into),
                                svrmad::address<svrmad::SiluMulFn>(&silu_mul_into)};
  }, "rms_norm's, add_rms_norm's, rope_store's and silu_mul's addresses (their `_into` forms, writing into outputs "
     "the caller keeps), for a C++ caller (cpu_stack.cpp)");
}
