// The AVX2/FMA helpers the CPU kernels share (cpu_decode.cpp, cpu_linear.cpp, cpu_ops.cpp).
//
// SVRMAD_AVX2 is defined where the build's flags allow AVX2 and FMA (_cpu_build.ISA_FLAGS: -mavx2 -mfma
// on an AVX2 or AVX-512 machine); a kernel that has a scalar path keeps it under #else. Each helper is a
// fixed order of operations: a kernel's results depend on it bit for bit, so change one only together
// with the tests that compare against the references.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#define SVRMAD_AVX2 1
#include <immintrin.h>
#endif

namespace svrmad {

#ifdef SVRMAD_AVX2
// the sum of a vector's eight lanes, as a tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two
static inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// the sum of a vector's eight lanes in lane order, 0 + 1 + ... + 7 (one scalar chain)
static inline float sum_lanes_in_order(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += lanes[j];
  return s;
}

// the sums of eight vectors' lanes, as one vector [sum(a0), ..., sum(a7)]
static inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

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
#endif

// dot and axpy over float rows: explicit AVX2 where built for it (the compiler's reduction
// vectorisation was measured ~3x slower in the decode kernel), scalar otherwise
static inline float dotf(const float* a, const float* b, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#ifdef SVRMAD_AVX2
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
#ifdef SVRMAD_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
#endif
  for (; d < D; ++d) y[d] += w * x[d];
}

}  // namespace svrmad
