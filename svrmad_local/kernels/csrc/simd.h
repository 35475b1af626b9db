// The AVX2/FMA helpers the CPU kernels share (cpu_decode.cpp, cpu_linear.cpp, cpu_ops.cpp).
//
// SVRMAD_AVX2 is defined where the build's flags allow AVX2 and FMA (_cpu_build.ISA_FLAGS: -mavx2 -mfma
// on an AVX2 or AVX-512 machine); a kernel that has a scalar path keeps it under #else. Each helper is a
// fixed order of operations: a kernel's results depend on it bit for bit, so change one only together
// with the tests that compare against the references.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#define SVRMAD_AVX2 1
#include <immintrin.h>
#endif

// a software prefetch of p's line towards L2 that the compiler keeps: GCC counts no side effect in
// __builtin_prefetch, so it may delete a loop made of nothing else as one that does no work (at -O1 and up
// it deleted the decode kernel's, and with them the prefetch it measured); an asm statement it must keep
static inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Code above AVX2 (AVX-512, avx512_bf16, AMX) is compiled in sections of its own, for those features
// only, whatever the build's flags (SVRMAD_TARGET_BEGIN ... SVRMAD_TARGET_END), and runs only where the
// CPU has them (isa_level()): one build serves every x86 machine, and a compiler too old for the
// sections (GCC < 11, clang < 12) builds the AVX2 code alone (-DSVRMAD_NO_X86_TARGETS builds that too: the
// compile-only check of tests/test_kernels_csrc.py).
#if defined(SVRMAD_AVX2) && defined(__x86_64__) && !defined(SVRMAD_NO_X86_TARGETS) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SVRMAD_X86_TARGETS 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(SVRMAD_X86_TARGETS) && defined(__clang__)
#define SVRMAD_TARGET_BEGIN(features) _Pragma("clang attribute push(__attribute__((target(\"" features "\"))), apply_to = function)")
#define SVRMAD_TARGET_END _Pragma("clang attribute pop")
#elif defined(SVRMAD_X86_TARGETS)
#define SVRMAD_PRAGMA(x) _Pragma(#x)
#define SVRMAD_TARGET_BEGIN(features) _Pragma("GCC push_options") SVRMAD_PRAGMA(GCC target(features))
#define SVRMAD_TARGET_END _Pragma("GCC pop_options")
#endif
#define SVRMAD_AVX512_FEATURES "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq"
#define SVRMAD_BF16_FEATURES SVRMAD_AVX512_FEATURES ",avx512bf16"
#define SVRMAD_AMX_FEATURES SVRMAD_BF16_FEATURES ",amx-tile,amx-bf16"

namespace svrmad {

// ---- the run-time ISA level: what this CPU offers above AVX2, capped by SVRMAD_CPU_ISA ----
// 0 AVX2 (the code every machine runs), 1 AVX-512, 2 avx512_bf16, 3 AMX (bf16 tiles). SVRMAD_CPU_ISA=avx2 |
// avx512 | avx512_bf16 | amx caps it (the tests run the lower paths on a machine that has the higher);
// cpu_linear.py checks its value. Each kernel module holds its own level; set_isa_level changes it.
enum IsaLevel : int { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_AVX512_BF16 = 2, ISA_AMX = 3 };
static const char* const ISA_NAMES[] = {"avx2", "avx512", "avx512_bf16", "amx"};

static inline int detect_isa_level() {
  int level = ISA_AVX2;
#ifdef SVRMAD_X86_TARGETS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    level = ISA_AVX512;
    if (__builtin_cpu_supports("avx512bf16")) {
      level = ISA_AVX512_BF16;
      // the tiles' registers are given to a process only when it asks Linux for them
      constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
      if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
          syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
        level = ISA_AMX;
    }
  }
#endif
  const char* cap = std::getenv("SVRMAD_CPU_ISA");
  if (cap != nullptr)
    for (int l = 0; l < 4; ++l)
      if (std::strcmp(cap, ISA_NAMES[l]) == 0 && l < level) level = l;
  return level;
}

static inline int& isa_level_ref() {
  static int level = detect_isa_level();
  return level;
}
static inline int isa_level() { return isa_level_ref(); }
// caps the level at `level` (never above what the CPU has); returns the one before
static inline int set_isa_level(int level) {
  const int before = isa_level_ref();
  const int most = detect_isa_level();
  isa_level_ref() = level < most ? (level < 0 ? 0 : level) : most;
  return before;
}

// ---- bf16 as torch stores it: the high half of an fp32; rounded to nearest even, NaN kept quiet ----
static inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t float_to_bf16(float f) {  // c10::BFloat16's round_to_nearest_even, bit for bit
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

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
// (cpu_decode.cpp's exp_neg16 runs the same operations on sixteen lanes, from these constants)
constexpr float EXP_MIN = -87.f, EXP_LOG2E = 1.44269504088896341f;
constexpr float EXP_LN2_HI = 0.693359375f, EXP_LN2_LO = -2.12194440e-4f;  // ln2 in two parts: n * hi is exact
constexpr float EXP_TAYLOR[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // r^6's first, Horner
static inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x));
  __m256 p = _mm256_set1_ps(EXP_TAYLOR[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_TAYLOR[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#ifdef SVRMAD_AVX2
// eight bf16 (16 bytes) as eight floats (exact)
static inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// eight floats rounded to bf16 as float_to_bf16 does (nearest even, NaN -> 0x7FC0), widened back to floats
// (exact): a bf16 op's result that the next op reads in fp32
static inline __m256 round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan));
}
// the same eight rounded values stored as bf16 into p[0..8)
static inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16x8(v)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

#ifdef SVRMAD_X86_TARGETS
SVRMAD_TARGET_BEGIN(SVRMAD_AVX512_FEATURES)
// load_bf16x8, round_bf16x8 and store_bf16x8 on sixteen lanes: each lane's operations as theirs, the same bits
static inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
static inline __m512 round_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
}
static inline void store_bf16x16(uint16_t* p, __m512 v) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16x16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
SVRMAD_TARGET_END
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
