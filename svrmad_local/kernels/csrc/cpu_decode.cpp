// Decode attention on the CPU reading K/V in place through a paged cache's block tables: built by
// _cpu_build.py, called from cpu_decode.py (which says why it exists and what it measured).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernel_api.h"
#include "simd.h"

using namespace svrmad;

constexpr int64_t PF_AHEAD = 2;  // blocks ahead that prefetch_rows reads

// x[t] = e^(x[t] - m) in place for t in [t, n); returns their sum. `acc`: the eight-lane sum of the
// exponentials before t (exp_sub_sum512 continues here after its sixteen-lane part)
#ifdef SVRMAD_AVX2
static inline float exp_sub_sum(float* x, int64_t n, float m, int64_t t = 0, __m256 acc = _mm256_setzero_ps()) {
  const __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
    _mm256_storeu_ps(x + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
#else
static inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#endif
  for (; t < n; ++t) { x[t] = std::exp(x[t] - m); sum += x[t]; }
  return sum;
}

// the largest of x[0..n), starting from `m` (max is exact: any order gives the same value)
static inline float max_of(const float* x, int64_t n, float m) {
  int64_t t = 0;
#ifdef SVRMAD_AVX2
  __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
#endif
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
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

#ifdef SVRMAD_AVX2
// eight elements of a cache row as floats: fp32 as they are, bf16 widened (exact, so a bf16 cache gives
// the bits of its fp32 copy); the inner loops read a bf16 cache through this, in place
static inline __m256 row8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 row8(const c10::BFloat16* p) { return load_bf16x8(reinterpret_cast<const uint16_t*>(p)); }

// the cache dtypes the inner loops read in place (fp16 is widened into a buffer first, then takes the same loops)
template <typename T>
constexpr bool kReadsInPlace = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value;

// scores of 8 tokens (rows `stride` apart) for NHT <= 3 query heads of one KV group (q rows D apart, out
// rows `ostride` apart): each score is dots8's, lane for lane and through the same hsum8 tree, so the
// results are bit-identical; the heads share each row load and twelve FMA chains run at once where
// dots8 runs eight (in cache ~20% fewer cycles a token on a Zen 3: docs/kernels.md)
template <int NHT, typename R>
static inline void dots8_heads(const float* q, const R* rows, int64_t stride, int64_t D, float scale, float* out,
                               int64_t ostride) {
  __m256 sums[NHT][8];
  for (int half = 0; half < 2; ++half) {
    const R* r = rows + half * 4 * stride;
    __m256 acc[NHT][4];
    for (int h = 0; h < NHT; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int h = 0; h < NHT; ++h) {
        const __m256 qv = _mm256_loadu_ps(q + h * D + d);
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_fmadd_ps(row8(r + j * stride + d), qv, acc[h][j]);
      }
    }
    for (int h = 0; h < NHT; ++h)
      for (int j = 0; j < 4; ++j) sums[h][half * 4 + j] = acc[h][j];
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int h = 0; h < NHT; ++h) _mm256_storeu_ps(out + h * ostride, _mm256_mul_ps(hsum8(sums[h]), sv));
}

// acc[h][0..Dv) += w[h][p] * row_p for the tokens of a block, NHT <= 3 heads of one KV group sharing each
// row, a quarter of Dv (32) at a time so that the accumulators stay in registers: per output the same
// fmadds in the same token order as one head at a time, bit for bit
template <int NHT, typename R>
static inline void axpy_heads(const float* const* w, const R* rows, int64_t stride, int64_t cnt, int64_t Dv,
                              float* acc, int64_t astride) {
  for (int64_t c = 0; c < Dv; c += 32) {
    __m256 r[NHT][4];
    for (int h = 0; h < NHT; ++h)
      for (int j = 0; j < 4; ++j) r[h][j] = _mm256_loadu_ps(acc + h * astride + c + 8 * j);
    const R* row = rows + c;
    for (int64_t p = 0; p < cnt; ++p, row += stride) {
      __m256 wv[NHT];
      for (int h = 0; h < NHT; ++h) wv[h] = _mm256_set1_ps(w[h][p]);
      for (int j = 0; j < 4; ++j) {
        const __m256 x = row8(row + 8 * j);
        for (int h = 0; h < NHT; ++h) r[h][j] = _mm256_fmadd_ps(wv[h], x, r[h][j]);
      }
    }
    for (int h = 0; h < NHT; ++h)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + h * astride + c + 8 * j, r[h][j]);
  }
}
#endif

#ifdef SVRMAD_X86_TARGETS
SVRMAD_TARGET_BEGIN(SVRMAD_AVX512_FEATURES)
// sixteen lanes for the loops above where the CPU has AVX-512 (isa_level()): each lane does what a lane of
// the eight-lane loops does, in the same order, so the results are the same bits with half the instructions

// row8(a) in the low half, row8(b) in the high one
static inline __m512 rows16(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
static inline __m512 rows16(const c10::BFloat16* a, const c10::BFloat16* b) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// sixteen elements of one cache row as floats (row8 of p and of p + 8)
static inline __m512 row16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 row16(const c10::BFloat16* p) { return load_bf16x16(reinterpret_cast<const uint16_t*>(p)); }

// _mm256_hadd_ps on each half of a and b: [a1 + a0, a3 + a2, b1 + b0, b3 + b2] in every 128-bit lane
static inline __m512 hadd16(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0xDD), _mm512_shuffle_ps(a, b, 0x88));
}
// hsum8 of the eight halves of a[0..4) taken as (low halves, then high halves): hsum8's additions, two at a time
static inline __m256 hsum8x2(const __m512* a) {
  const __m512 u = hadd16(hadd16(a[0], a[1]), hadd16(a[2], a[3]));  // [hsum8's u0 | u1]
  const __m512 lo = _mm512_shuffle_f32x4(u, u, 0x08), hi = _mm512_shuffle_f32x4(u, u, 0x0D);  // 128-bit lanes 0, 2 and 1, 3
  return _mm512_castps512_ps256(_mm512_add_ps(lo, hi));
}

// exp_neg8 on sixteen lanes, the same operations lane for lane
static inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x));
  __m512 p = _mm512_set1_ps(EXP_TAYLOR[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_TAYLOR[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp_sub_sum sixteen at a time: the eight-lane sum takes each half in turn, as it took them there
static float exp_sub_sum512(float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(x + t), mv));
    _mm512_storeu_ps(x + t, e);
    acc = _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  return exp_sub_sum(x, n, m, t, acc);
}

// dots8_heads with tokens j and j + 4 in one vector's halves: the same eight chains a head, then the same hsum8
template <int NHT, typename R>
static void dots8_heads512(const float* q, const R* rows, int64_t stride, int64_t D, float scale, float* out,
                           int64_t ostride) {
  __m512 acc[NHT][4];
  for (int h = 0; h < NHT; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 x[4];
    for (int j = 0; j < 4; ++j) x[j] = rows16(rows + j * stride + d, rows + (j + 4) * stride + d);
    for (int h = 0; h < NHT; ++h) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + h * D + d));
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(x[j], qv, acc[h][j]);
    }
  }
  const __m256 sv = _mm256_set1_ps(scale);
  for (int h = 0; h < NHT; ++h) _mm256_storeu_ps(out + h * ostride, _mm256_mul_ps(hsum8x2(acc[h]), sv));
}

// axpy_heads 64 columns at a time (Dv a multiple of 64): each column's FMAs as there
template <int NHT, typename R>
static void axpy_heads512(const float* const* w, const R* rows, int64_t stride, int64_t cnt, int64_t Dv, float* acc,
                          int64_t astride) {
  for (int64_t c = 0; c < Dv; c += 64) {
    __m512 r[NHT][4];
    for (int h = 0; h < NHT; ++h)
      for (int j = 0; j < 4; ++j) r[h][j] = _mm512_loadu_ps(acc + h * astride + c + 16 * j);
    const R* row = rows + c;
    for (int64_t p = 0; p < cnt; ++p, row += stride) {
      __m512 wv[NHT];
      for (int h = 0; h < NHT; ++h) wv[h] = _mm512_set1_ps(w[h][p]);
      for (int j = 0; j < 4; ++j) {
        const __m512 x = row16(row + 16 * j);
        for (int h = 0; h < NHT; ++h) r[h][j] = _mm512_fmadd_ps(wv[h], x, r[h][j]);
      }
    }
    for (int h = 0; h < NHT; ++h)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + h * astride + c + 16 * j, r[h][j]);
  }
}
SVRMAD_TARGET_END
#endif

#ifdef SVRMAD_AVX2
// the loops above on the widest vectors the run may take (`wide`: AVX-512), the same bits either way
template <int NHT, typename R>
static inline void dots8_any(bool wide, const float* q, const R* rows, int64_t stride, int64_t D, float scale, float* out,
                             int64_t ostride) {
#ifdef SVRMAD_X86_TARGETS
  if (wide) return dots8_heads512<NHT>(q, rows, stride, D, scale, out, ostride);
#endif
  dots8_heads<NHT>(q, rows, stride, D, scale, out, ostride);
}
template <int NHT, typename R>
static inline void axpy_any(bool wide, const float* const* w, const R* rows, int64_t stride, int64_t cnt, int64_t Dv,
                            float* acc, int64_t astride) {
#ifdef SVRMAD_X86_TARGETS
  if (wide && Dv % 64 == 0) return axpy_heads512<NHT>(w, rows, stride, cnt, Dv, acc, astride);
#endif
  axpy_heads<NHT>(w, rows, stride, cnt, Dv, acc, astride);
}
#endif
static inline float exp_sum_any(bool wide, float* x, int64_t n, float m) {
#ifdef SVRMAD_X86_TARGETS
  if (wide) return exp_sub_sum512(x, n, m);
#endif
  return exp_sub_sum(x, n, m);
}

// pulls `rows` rows of `bytes` each, `stride` bytes apart, towards L2 (the rows of a block PF_AHEAD on,
// while this one computes: a block table scatters a context, so the hardware's prefetch stops at every
// block edge)
static inline void prefetch_rows(const void* base, int64_t rows, int64_t stride, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t r = 0; r < rows; ++r, p += stride)
    for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(p + o);
}

// The blocks a thread's run of items reads, in the order it reads them: the prefetch runs PF_AHEAD blocks
// ahead along this list, across the items' and the sequences' edges, so that a short sequence's first
// blocks are in flight too (a prefetch within each sequence never reached the first two blocks of one:
// two in three at 48 keys). The K rows go a block's rows at a time, each eight-key reduction fetching a
// share; the V rows a KV head at a time, as the V pass reaches each head (all of a block's V at its start
// read ~15% slower). 2-core AVX-512 EPYC, 30 layers' caches, bf16: 32 x 48 keys 7.8-10.1 -> 13.7-18.2 GB/s,
// 32 x 120 1.33x, 32 x 232 1.25x, 1,500-2,000 keys the same (bench_decode_read.py)
template <typename T>
struct Ahead {
  int64_t krow, vrow, vhead, kbytes, vbytes;  // the elements between rows and of a V head, the bytes read a row
  std::vector<const T*> k, v;           // a block's first row read, K and V: the passes read the blocks through these
  std::vector<int64_t> n;               // how many rows of it
  void add(const T* kp, const T* vp, int64_t cnt) {
    k.push_back(kp);
    v.push_back(vp);
    n.push_back(cnt);
  }
  // K rows [r0, r0 + 8) of block f, all from r0 on where `rest` (the caller's block ends before this one's)
  void keys(size_t f, int64_t r0, bool rest) const {
    if (f >= n.size() || r0 >= n[f]) return;
    prefetch_rows(k[f] + r0 * krow, rest ? n[f] - r0 : std::min<int64_t>(8, n[f] - r0), krow * sizeof(T), kbytes);
  }
  // the V rows of block f, of the item's KV head j (of all its heads where j < 0)
  void values(size_t f, int64_t j = -1) const {
    if (f >= n.size()) return;
    prefetch_rows(v[f] + std::max<int64_t>(j, 0) * vhead, n[f], vrow * sizeof(T),
                  j < 0 ? vbytes : static_cast<int64_t>(vhead * sizeof(T)));
  }
};

// rows [r0, r1) of a block (each `stride` elements apart, `width` of them read from each) as floats: in place
// where T is float (rows `stride` apart), else widened into buf (rows `width` apart: row_stride<T>). The same
// floats either way, so a bf16 cache gives the bits of its fp32 copy.
template <typename T>
static constexpr int64_t row_stride(int64_t stride, int64_t width) {
  return std::is_same<T, float>::value ? stride : width;
}
template <typename T>
static inline const float* rows_as_float(const T* base, int64_t r0, int64_t r1, int64_t stride, int64_t width,
                                         float* buf) {
  if constexpr (std::is_same<T, float>::value) {
    return base + r0 * stride;
  } else {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = base + r * stride;
      float* out = buf + (r - r0) * width;
      int64_t d = 0;
#ifdef SVRMAD_AVX2
      if constexpr (std::is_same<T, c10::BFloat16>::value)
        for (; d + 8 <= width; d += 8) _mm256_storeu_ps(out + d, load_bf16x8(reinterpret_cast<const uint16_t*>(row) + d));
#endif
      for (; d < width; ++d) out[d] = static_cast<float>(row[d]);
    }
    return buf;
  }
}

// keys one work item attends to, rounded to whole blocks: a constant, not a share of the threads, so a
// sequence's output is the same bits whatever the thread count, and one long sequence still keeps
// every thread busy (cpu_decode.py says what it measured; 64 and 256 measured no better)
constexpr int64_t CHUNK_TOKENS = 128;

// one work item's keys: sequence b's positions [lo, hi), with the KV heads [g0, g0 + per)
struct Item {
  int64_t chunk, b, lo, hi, g0;
};

template <typename T>
static void run(const T* q, const T* k, const T* v, const int64_t* table, const int64_t* lens, const float* sinks,
                T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t Dv, int64_t maxb, int64_t bs,
                float scale, int64_t window) {
  const bool wide = isa_level() >= ISA_AVX512;  // the sixteen-lane loops (the same bits)
  const int64_t G = H / KVH, C = bs * std::max<int64_t>(1, CHUNK_TOKENS / bs);
  // every sequence's keys cut at multiples of C; chunks of sequence b are first[b] .. first[b + 1]
  std::vector<int64_t> first(B + 1, 0), chunk_lo;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[b], start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    for (int64_t c = start / C; c * C < L; ++c) chunk_lo.push_back(std::max(c * C, start));
    first[b + 1] = static_cast<int64_t>(chunk_lo.size());
  }
  const int64_t N = first[B];
  // Whole rows (all KV heads: one contiguous read a token) when there are chunks enough for the
  // threads, one KV head an item otherwise. Each thread walks a run of items in memory order (a
  // sequence's chunks one after another, so the prefetch runs on across their edges), the runs cut
  // at equal shares of the keys: a step's sequences differ in length, equal counts would not do.
  const int64_t per = N >= 4 * at::get_num_threads() ? KVH : 1, parts = KVH / per;
  std::vector<Item> items;
  std::vector<int64_t> cum{0};
  items.reserve(N * parts);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t part = 0; part < parts; ++part)
      for (int64_t c = first[b]; c < first[b + 1]; ++c) {
        const int64_t lo = chunk_lo[c], hi = std::min((lo / C + 1) * C, lens[b]);
        items.push_back({c, b, lo, hi, part * per});
        cum.push_back(cum.back() + hi - lo);
      }
  // per chunk and query head: the largest score m, the sum of e^(s - m), and sum e^(s - m) v
  std::vector<float> mx(N * H), den(N * H), part_acc(N * H * Dv);
  const int64_t NT = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size())));
  at::parallel_for(0, NT, 1, [&](int64_t tlo, int64_t thi) {
    // this run: the items whose first key falls in the keys' shares tlo .. thi
    const auto at_share = [&](int64_t t) {
      return std::lower_bound(cum.begin(), cum.end() - 1, (cum.back() * t + NT - 1) / NT) - cum.begin();
    };
    const int64_t i0 = at_share(tlo), i1 = at_share(thi);
    std::vector<float> qf(per * G * D), scores(per * G * C), kbuf(bs * per * D), vbuf(bs * per * Dv);
    Ahead<T> ahead{KVH * D, KVH * Dv, Dv, static_cast<int64_t>(per * D * sizeof(T)), static_cast<int64_t>(per * Dv * sizeof(T))};
    std::vector<int64_t> at_block;  // each item's first block in `ahead`
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      at_block.push_back(static_cast<int64_t>(ahead.n.size()));
      for (int64_t p0 = it.lo - it.lo % bs; p0 < it.hi; p0 += bs) {
        const int64_t p1 = std::max(p0, it.lo), row = table[it.b * maxb + p0 / bs] * bs + p1 - p0;
        ahead.add(k + (row * KVH + it.g0) * D, v + (row * KVH + it.g0) * Dv, std::min(p0 + bs, it.hi) - p1);
      }
    }
    for (int64_t f = 0; f < PF_AHEAD; ++f) ahead.keys(f, 0, true), ahead.values(f);  // the first blocks at once
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int64_t b = it.b, g0 = it.g0, s = it.lo, e = it.hi, n = e - s;
      const int64_t NH = per * G, h0 = g0 * G;  // this item's query heads: h0 .. h0 + NH
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<float>(q[(b * H + h0 + h) * D + d]);
      for (int64_t p0 = s - s % bs, f = at_block[i - i0]; p0 < e; p0 += bs, ++f) {
        const int64_t p1 = std::max(p0, s), pe = std::min(p0 + bs, e);
        const T* kb = ahead.k[f] - (p1 - p0) * KVH * D;  // the block's first row (the list holds row p1's)
        const int64_t ld = row_stride<T>(KVH * D, per * D);  // a group's rows of this item's heads as floats
        for (int64_t p = p1; p < pe; p += 8) {  // eight tokens a reduction
          const int64_t cnt = std::min<int64_t>(8, pe - p), t = p - s;
          ahead.keys(f + PF_AHEAD, p - p1, p + 8 >= pe);  // a share of the K rows PF_AHEAD blocks on
#ifdef SVRMAD_AVX2
          if (cnt == 8 && D % 8 == 0) {  // the heads of each KV group share the row loads
            const auto heads = [&](const auto* rows, int64_t stride) {  // rows: this token's, in place or widened
              for (int64_t h = 0; h < NH;) {
                const int64_t take = std::min<int64_t>(3, G - h % G);
                const float* qh = qf.data() + h * D;
                const auto* rh = rows + (h / G) * D;
                float* oh = scores.data() + h * C + t;
                if (take == 3) dots8_any<3>(wide, qh, rh, stride, D, scale, oh, C);
                else if (take == 2) dots8_any<2>(wide, qh, rh, stride, D, scale, oh, C);
                else dots8_any<1>(wide, qh, rh, stride, D, scale, oh, C);
                h += take;
              }
            };
            if constexpr (kReadsInPlace<T>) heads(kb + (p - p0) * KVH * D, KVH * D);  // bf16 widened in registers
            else heads(rows_as_float(kb, p - p0, p - p0 + 8, KVH * D, per * D, kbuf.data()), ld);
            continue;
          }
#endif
          // fewer than eight tokens (or no AVX2): their rows as floats, one head at a time
          const float* rows = rows_as_float(kb, p - p0, p - p0 + cnt, KVH * D, per * D, kbuf.data());
          for (int64_t h = 0; h < NH; ++h)
            dots8(qf.data() + h * D, rows + (h / G) * D, ld, cnt, D, scale, scores.data() + h * C + t);
        }
      }
      for (int64_t h = 0; h < NH; ++h) {  // the sink joins every chunk's max, so one chunk needs no rescaling
        float* sh = scores.data() + h * C;
        const float m = max_of(sh, n, sinks ? sinks[h0 + h] : -std::numeric_limits<float>::infinity());
        mx[it.chunk * H + h0 + h] = m;
        den[it.chunk * H + h0 + h] = exp_sum_any(wide, sh, n, m);
      }
      float* acc = part_acc.data() + (it.chunk * H + h0) * Dv;
      std::fill(acc, acc + NH * Dv, 0.f);
      for (int64_t p0 = s - s % bs, f = at_block[i - i0]; p0 < e; p0 += bs, ++f) {
        const int64_t p1 = std::max(p0, s), pe = std::min(p0 + bs, e);
        const T* vb = ahead.v[f] - (p1 - p0) * KVH * Dv;
        const int64_t ld = row_stride<T>(KVH * Dv, per * Dv);
#ifdef SVRMAD_AVX2
        if (Dv % 32 == 0) {  // the heads of a KV group share each row; accumulators in registers
          const auto heads = [&](const auto* rows, int64_t stride) {  // rows [p1, pe): in place or widened
            for (int64_t h = 0; h < NH;) {
              const int64_t take = std::min<int64_t>(3, G - h % G);
              if (h % G == 0) ahead.values(f + PF_AHEAD, h / G);  // this KV head's rows PF_AHEAD blocks on
              const float* w[3];
              for (int64_t j = 0; j < take; ++j) w[j] = scores.data() + (h + j) * C + (p1 - s);
              const auto* row = rows + (h / G) * Dv;
              float* a = acc + h * Dv;
              if (take == 3) axpy_any<3>(wide, w, row, stride, pe - p1, Dv, a, Dv);
              else if (take == 2) axpy_any<2>(wide, w, row, stride, pe - p1, Dv, a, Dv);
              else axpy_any<1>(wide, w, row, stride, pe - p1, Dv, a, Dv);
              h += take;
            }
          };
          if constexpr (kReadsInPlace<T>) heads(vb + (p1 - p0) * KVH * Dv, KVH * Dv);
          else heads(rows_as_float(vb, p1 - p0, pe - p0, KVH * Dv, per * Dv, vbuf.data()), ld);
          continue;
        }
#endif
        ahead.values(f + PF_AHEAD);
        const float* vrows = rows_as_float(vb, p1 - p0, pe - p0, KVH * Dv, per * Dv, vbuf.data());
        for (int64_t p = p1; p < pe; ++p) {
          const float* vp = vrows + (p - p1) * ld;
          const int64_t t = p - s;
          for (int64_t h = 0; h < NH; ++h) axpyf(scores[h * C + t], vp + (h / G) * Dv, acc + h * Dv, Dv);
        }
      }
    }
  });
  // each sequence's chunks joined in position order: a lone chunk's weight is e^0 = 1 exactly, so a
  // context of up to C keys gets the bits of attending to it in one piece. A few microseconds of
  // work a step: on the calling thread below 64 heads (waking the others cost more, in cache)
  at::parallel_for(0, B * H, 64, [&](int64_t lo, int64_t hi) {
    std::vector<float> o(Dv);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H, c0 = first[b], c1 = first[b + 1];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = c0; c < c1; ++c) m = std::max(m, mx[c * H + h]);
      float total = sinks ? std::exp(sinks[h] - m) : 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t c = c0; c < c1; ++c) {
        const float w = std::exp(mx[c * H + h] - m);
        total += w * den[c * H + h];
        axpyf(w, part_acc.data() + (c * H + h) * Dv, o.data(), Dv);
      }
      for (int64_t d = 0; d < Dv; ++d) out[bh * Dv + d] = static_cast<T>(o[d] / total);
    }
  });
}

// into `out` [B, H, Dv] (contiguous, q's dtype): the compiled decode step (cpu_stack.cpp) keeps it between steps
void paged_decode_into(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table, torch::Tensor lens,
                       int64_t block_size, double scale, int64_t window, c10::optional<torch::Tensor> sinks,
                       torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [B,H,D], k/v [slots,KVH,D]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous q, k, v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  auto tab = table.to(torch::kLong).contiguous();
  auto len = lens.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), Dv = v.size(2);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3 && out.size(0) == B && out.size(1) == H && out.size(2) == Dv &&
              out.scalar_type() == q.scalar_type(), "the output must be a contiguous [B, H, Dv] tensor of q's dtype");
  torch::Tensor sk;
  if (sinks.has_value()) sk = sinks->to(torch::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), tab.data_ptr<int64_t>(),
                  len.data_ptr<int64_t>(), sinks.has_value() ? sk.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(),
                  B, H, KVH, D, Dv, tab.size(1), block_size, static_cast<float>(scale), window);
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor table, torch::Tensor lens,
                           int64_t block_size, double scale, int64_t window, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && v.dim() == 3, "q [B,H,D], k/v [slots,KVH,D]");
  auto out = torch::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  paged_decode_into(q, k, v, table, lens, block_size, scale, window, sinks, out);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("addresses", []() { return std::vector<int64_t>{svrmad::address<svrmad::DecodeFn>(&paged_decode_into)}; },
        "paged_decode_into's address, for a C++ caller (cpu_stack.cpp)");
  m.def("isa_level", []() { return isa_level(); }, "the run-time ISA level the kernel takes");
  m.def("set_isa_level", [](int level) { return set_isa_level(level); }, "caps it; returns the one before");
}
