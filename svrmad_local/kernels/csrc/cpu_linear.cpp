// Linears from weights kept in 16-column panels, fp32 and bf16: built by _cpu_build.py, called from
// cpu_linear.py (which says why it exists, the layouts, and the fixed order of their arithmetic).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernel_api.h"
#include "simd.h"

#ifndef SVRMAD_AVX2
#error "the panel linear kernel needs AVX2 and FMA (-mavx2 -mfma)"
#endif

using svrmad::bf16_to_float;
using svrmad::float_to_bf16;

constexpr int NR = 16;   // output columns a panel: two AVX2 vectors
constexpr int MR = 6;    // input rows a micro-kernel call: 12 accumulators
constexpr int64_t MC = 96;  // input rows a pass over the weights (their rows stay in L2 meanwhile)
// Prefetch, as the rows of a pass walk a panel in tiles: the first tile asks for the k PF_K ahead of
// itself (8 KB) into L2 (with 2-12 rows a k, the FMAs pace the loads so slowly that the hardware's prefetch
// alone left the stream at ~19 GB/s of the machine's ~33; 4 KB ahead into L1, the rule before, left a
// step of 8 rows 1.65x slower on the 16-lane tiles and 1.11x on the 8-lane ones, 2-core avx512_bf16
// EPYC); the last of several tiles, which finds its panel in cache, pulls the next panel into L2
// meanwhile, so the memory does not idle through it.
constexpr int PF_NONE = 0, PF_AHEAD = 1, PF_NEXT = 2;
constexpr int64_t PF_K = 128;

// f(std::integral_constant<int, r>) for a run-time r in [1, MAX] (clamped): the micro-kernels take their
// row count as a template argument, so that their accumulators live in registers
template <int MAX, typename F>
static inline void with_rows(int64_t r, F&& f) {
  if constexpr (MAX > 1) {
    if (r < MAX) return with_rows<MAX - 1>(r, f);
  }
  f(std::integral_constant<int, MAX>{});
}

// a K-block's two accumulators into an output's running totals: the first block's as they are, each
// later block's added in order (the fixed order of the kernel's arithmetic)
static inline void add_block(__m256* tot, const __m256* acc, bool first) {
  tot[0] = first ? acc[0] : _mm256_add_ps(tot[0], acc[0]);
  tot[1] = first ? acc[1] : _mm256_add_ps(tot[1], acc[1]);
}

// 16 outputs held in two vectors, plus their bias, into y[0, nv) (bias points at y's first column's)
static inline void store_outputs(const __m256* tot, float* y, const float* bias, int64_t nv) {
  alignas(32) float out[NR];
  _mm256_store_ps(out, tot[0]);
  _mm256_store_ps(out + 8, tot[1]);
  for (int j = 0; j < nv; ++j) y[j] = bias ? out[j] + bias[j] : out[j];
}

// rows [0, R) of X against one panel: out[r][j] = sum_k X[r][k] * panel[k][j], one FMA chain a
// KBLOCK of k's, the chains added in order; then the bias
template <int R, int PF>
static void micro(const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias, float* Y,
                  int64_t N, int64_t n0, int64_t nv) {
  __m256 tot[R][2];
  for (int64_t kb = 0; kb < K; kb += kblock) {
    const int64_t ke = std::min(K, kb + kblock);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = kb; k < ke; ++k) {
      if (PF == PF_AHEAD && R > 1) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PF_K) * NR), _MM_HINT_T1);
      else if (PF == PF_NEXT) _mm_prefetch(reinterpret_cast<const char*>(panel + (K + k) * NR), _MM_HINT_T1);
      const __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(X + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) add_block(tot[r], acc[r], kb == 0);
  }
  for (int r = 0; r < R; ++r) store_outputs(tot[r], Y + r * N + n0, bias ? bias + n0 : nullptr, nv);
}

// one input row against NP adjacent panels (M = 1, a decode step at batch 1): the same arithmetic as
// micro<1> on each panel (one FMA chain a column and KBLOCK, the chains added in order, then the bias),
// but 2 * NP independent chains in flight instead of two: with two, the FMA latency paced the loads
// and the stream ran at ~28 GB/s of the ~32 a sum read (2-core AVX2 EPYC); with four panels, ~31
template <int NP>
static void micro_row(const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias, float* Y,
                      int64_t N, int64_t n0) {
  __m256 tot[NP][2];
  for (int64_t kb = 0; kb < K; kb += kblock) {
    const int64_t ke = std::min(K, kb + kblock);
    __m256 acc[NP][2];
    for (int p = 0; p < NP; ++p) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
    for (int64_t k = kb; k < ke; ++k) {
      const __m256 xb = _mm256_broadcast_ss(X + k);
      for (int p = 0; p < NP; ++p) {
        const float* w = panel + (p * K + k) * NR;
        acc[p][0] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w), acc[p][0]);
        acc[p][1] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + 8), acc[p][1]);
      }
    }
    for (int p = 0; p < NP; ++p) add_block(tot[p], acc[p], kb == 0);
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t c0 = n0 + p * NR;
    store_outputs(tot[p], Y + c0, bias ? bias + c0 : nullptr, std::min<int64_t>(NR, N - c0));
  }
}

// panels [p0, p1) of one row, `width` (4, 2 or 1) at a time, then fewer; panels wholly past N are skipped
static void row_panels(const float* X, int64_t K, const float* W, int64_t kblock, const float* bias, float* Y,
                       int64_t N, int64_t p0, int64_t p1, int64_t width) {
  p1 = std::min<int64_t>(p1, (N + NR - 1) / NR);
  int64_t p = p0;
  if (width >= 4)
    for (; p + 4 <= p1; p += 4) micro_row<4>(X, K, W + p * K * NR, kblock, bias, Y, N, p * NR);
  if (width >= 2)
    for (; p + 2 <= p1; p += 2) micro_row<2>(X, K, W + p * K * NR, kblock, bias, Y, N, p * NR);
  for (; p < p1; ++p) micro_row<1>(X, K, W + p * K * NR, kblock, bias, Y, N, p * NR);
}

template <int PF>
static void rows(int64_t R, const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias,
                 float* Y, int64_t N, int64_t n0, int64_t nv) {
  with_rows<MR>(R, [&](auto r) { micro<decltype(r)::value, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); });
}

#ifdef SVRMAD_X86_TARGETS
SVRMAD_TARGET_BEGIN(SVRMAD_AVX512_FEATURES)
constexpr int MR512 = 12;  // input rows a 16-lane micro-kernel call (12 accumulators, their totals, one weight row)

// micro's outputs with one 16-lane vector a row: lane j carries column j's FMA chain, the same operations
// in the same order as micro's two 8-lane halves, so the same bits; an instruction does twice the FMAs,
// which is what paces a step of many rows
template <int R, int PF>
static void micro512(const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias, float* Y,
                     int64_t N, int64_t n0, int64_t nv) {
  __m512 tot[R];
  for (int64_t kb = 0; kb < K; kb += kblock) {
    const int64_t ke = std::min(K, kb + kblock);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = kb; k < ke; ++k) {
      if (PF == PF_AHEAD && R > 1) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PF_K) * NR), _MM_HINT_T1);
      else if (PF == PF_NEXT) _mm_prefetch(reinterpret_cast<const char*>(panel + (K + k) * NR), _MM_HINT_T1);
      const __m512 w = _mm512_loadu_ps(panel + k * NR);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(X[r * K + k]), w, acc[r]);
    }
    for (int r = 0; r < R; ++r) tot[r] = kb == 0 ? acc[r] : _mm512_add_ps(tot[r], acc[r]);
  }
  alignas(64) float out[NR];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out, tot[r]);
    float* y = Y + r * N + n0;
    for (int j = 0; j < nv; ++j) y[j] = bias ? out[j] + bias[n0 + j] : out[j];
  }
}

template <int PF>
static void rows512(int64_t R, const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias,
                    float* Y, int64_t N, int64_t n0, int64_t nv) {
  with_rows<MR512>(R, [&](auto r) { micro512<decltype(r)::value, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); });
}
SVRMAD_TARGET_END
#endif

// x [M, K], panels [P, K, 16] -> y [M, n]; `row_width`: panels at once where M = 1 (row_panels)
static void panel_linear_f32(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                             int64_t kblock, int64_t row_width, torch::Tensor& y) {
  TORCH_CHECK(panels.size(2) == NR && x.size(1) == panels.size(1), "x [M, K] and panels [P, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fp32 panels take fp32 inputs");
  TORCH_CHECK(panels.is_contiguous() && n <= panels.size(0) * NR && kblock > 0, "contiguous panels covering n columns");
  x = x.contiguous();
  torch::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const float* X = x.data_ptr<float>();
  const float* W = panels.data_ptr<float>();
  const float* B = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  if (M == 1) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { row_panels(X, K, W, kblock, B, Y, n, p0, p1, row_width); });
    return;
  }
  // rows a tile, and the tiles' micro-kernels (first of a pass, middle, last): 16-lane ones where the CPU has them
  int64_t mr = MR;
  auto first = rows<PF_AHEAD>, middle = rows<PF_NONE>, last = rows<PF_NEXT>;
#ifdef SVRMAD_X86_TARGETS
  if (svrmad::isa_level() >= svrmad::ISA_AVX512) mr = MR512, first = rows512<PF_AHEAD>, middle = rows512<PF_NONE>,
                                                 last = rows512<PF_NEXT>;
#endif
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t me = std::min(M, mc + MC);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR, nv = std::min<int64_t>(NR, n - n0);
        if (nv <= 0) continue;
        for (int64_t m = mc; m < me; m += mr) {
          auto tile = m == mc ? first : m + mr >= me ? last : middle;
          tile(std::min<int64_t>(mr, me - m), X + m * K, K, W + p * K * NR, kblock, B, Y + m * n, n, n0, nv);
        }
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------------
// bf16 panels. W [N, K] as [P, K2p, 32] bf16: pair-row kp of panel p holds columns 16p..16p+15 as 16
// dwords, each the pair (W[n][2kp] in the low half, W[n][2kp + 1] in the high half), which is the operand
// layout of avx512_bf16's dot product and of an AMX bf16 B tile (16 pair-rows of 64 bytes). K2p: ceil(K/2)
// pairs rounded up to a multiple of 16 with zero rows (a whole number of B tiles).
//
// The arithmetic of every path but AMX: per output, acc = 0; for each pair kp in order, acc += x[2kp+1] *
// w[2kp+1], then acc += x[2kp] * w[2kp] (each product exact in fp32, each sum rounded to nearest), denormal
// inputs and sums read and written as zero; then y = bf16(acc + bias). That is what vdpbf16ps computes, lane
// by lane, and the AVX2 path computes the same with two FMAs a pair under MXCSR's DAZ and FTZ: the same
// bits on every machine and at any batch size. AMX tiles sum their products in an order of their own
// (measured: neither pairwise order, nor a pair or a tile summed exactly), so where the CPU has them every
// call takes them (from amx_min_rows rows, 1 by default: one row streams the weights as fast there, and a
// row's bits stay the same at any batch size): the bits of an AMX machine are its own.
constexpr int64_t PAIRS_TILE = 16;  // pair-rows of a B tile
constexpr int BF16_ROWS_DP = 8, BF16_ROWS_EMU = 4;  // rows a micro-kernel call, avx512_bf16 and AVX2
// A call of several rows walks each panel once from memory (its first row tile) and again from cache (the
// others). With 8 rows a pair-row, the products pace the loads so slowly that the hardware's prefetch
// alone left the stream at 12-17 GB/s where a sum read 30-45 (2-core avx512_bf16 EPYC): the first tile
// asks for the pair-row PF_PAIRS (8 KB) ahead into L2 (into L1 was slower), past a panel's end into the
// next one's start. Only where the data comes from, never the arithmetic.
constexpr int64_t PF_PAIRS = 128;
static int64_t g_amx_min_rows = 1;                  // calls of at least this many rows take the AMX tiles

// acc[r][c] (fp32, row stride `lda`) + bias -> y[r][c] in bf16, for rows < R and columns < nv: eight at a
// time, rounded as float_to_bf16 rounds
static inline void store_rows_bf16(const float* acc, int64_t lda, int64_t R, const float* bias, uint16_t* Y,
                                   int64_t ldy, int64_t nv) {
  for (int64_t r = 0; r < R; ++r) {
    const float* a = acc + r * lda;
    uint16_t* y = Y + r * ldy;
    int64_t j = 0;
    for (; j + 8 <= nv; j += 8) {
      __m256 v = _mm256_loadu_ps(a + j);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
      svrmad::store_bf16x8(y + j, v);
    }
    for (; j < nv; ++j) y[j] = float_to_bf16(bias ? a[j] + bias[j] : a[j]);
  }
}

// the pair-row PF_PAIRS ahead of kp in each of NP panels, into L2
template <int NP>
static inline void prefetch_ahead(const uint16_t* W, int64_t pstride, int64_t kp) {
  for (int p = 0; p < NP; ++p)
    _mm_prefetch(reinterpret_cast<const char*>(W + p * pstride + (kp + PF_PAIRS) * 32), _MM_HINT_T1);
}

// R rows of X (pairs of bf16, row stride ldx elements) against NP panels `pstride` elements apart, AVX2:
// out[r][16p + j] (row stride 16 * NP)
template <int R, int NP, bool PF>
static void emu_tile(const uint16_t* X, int64_t ldx, int64_t K2, const uint16_t* W, int64_t pstride, float* out) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ and DAZ: denormals as vdpbf16ps reads and writes them
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][NP][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    if (PF) prefetch_ahead<NP>(W, pstride, kp);
    __m256 we[NP][2], wo[NP][2];
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + p * pstride + kp * 32 + h * 16));
        we[p][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        wo[p][h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
    for (int r = 0; r < R; ++r) {
      const __m256 xo = _mm256_set1_ps(bf16_to_float(X[r * ldx + 2 * kp + 1]));
      const __m256 xe = _mm256_set1_ps(bf16_to_float(X[r * ldx + 2 * kp]));
      for (int p = 0; p < NP; ++p)
        for (int h = 0; h < 2; ++h) {
          acc[r][p][h] = _mm256_fmadd_ps(xo, wo[p][h], acc[r][p][h]);
          acc[r][p][h] = _mm256_fmadd_ps(xe, we[p][h], acc[r][p][h]);
        }
    }
  }
  _mm_setcsr(csr);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * 16 * NP + p * 16 + h * 8, acc[r][p][h]);
}

#ifdef SVRMAD_X86_TARGETS
SVRMAD_TARGET_BEGIN(SVRMAD_BF16_FEATURES)
// emu_tile's outputs with vdpbf16ps: one instruction a pair and 16 columns
template <int R, int NP, bool PF>
static void dp_tile(const uint16_t* X, int64_t ldx, int64_t K2, const uint16_t* W, int64_t pstride, float* out) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    if (PF) prefetch_ahead<NP>(W, pstride, kp);
    __m512i w[NP];
    for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_si512(W + p * pstride + kp * 32);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, X + r * ldx + 2 * kp, 4);
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(pair));
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)w[p], (__m512bh)xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + r * 16 * NP + p * 16, acc[r][p]);
}
SVRMAD_TARGET_END

SVRMAD_TARGET_BEGIN(SVRMAD_AMX_FEATURES)
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// panels [q0, q1) of W (each `pstride` elements) against X [Mp, Kp] (Kp a multiple of 32, zeros past K; Mp
// a multiple of 16 with zero rows past M, or M itself below 16: the tiles then hold M rows). Tiles 0-3
// accumulate a block of 32 rows x 32 columns (two panels), 4-5 hold two 16-row slices of X, 6-7 two panels'
// pair-rows; a last block of 16 rows or fewer takes tiles 0, 1 and 4 only. The weights stream once per
// block of rows (once in all at decode sizes), PF_TILES tiles ahead of the loads.
constexpr int64_t PF_TILES = 4;
// rows of X a pass over this thread's panels where they fit in AMX_PANEL_BYTES (a layer's GEMMs; not an LM
// head's 57 MB, which would then stream from memory once a block): the block (64 x K bf16, 74 KB at K =
// 576) stays in L2 while every panel pair reads it, where all of X (2.4 MB at 2,048 rows) came from L3 once
// a pair: a 2,048-row prefill's GEMMs +25-30% on a 2-core Xeon. The same tiles summed in the same order,
// so the same bits.
constexpr int64_t AMX_ROWS = 64, AMX_PANEL_BYTES = 4 << 20;

// store_rows_bf16 sixteen columns at a time (a whole panel; fewer take store_rows_bf16): store_bf16x16 does
// round_bf16x8's operations on each lane, so the same bits; the epilogue of a 32 x 32 block at K = 576 took about a third
// as long as its tiles' products
static inline void store_rows_bf16_16(const float* acc, int64_t lda, int64_t R, const float* bias, uint16_t* Y,
                                      int64_t ldy, int64_t nv) {
  if (nv < 16) return store_rows_bf16(acc, lda, R, bias, Y, ldy, nv);
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    __m512 v = _mm512_loadu_ps(acc + r * lda);
    if (bias) v = _mm512_add_ps(v, b);
    svrmad::store_bf16x16(Y + r * ldy, v);
  }
}
static void amx_panels(const uint16_t* X, int64_t Mp, int64_t Kp, const uint16_t* W, int64_t pstride, int64_t q0,
                       int64_t q1, const float* bias, uint16_t* Y, int64_t M, int64_t n) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(std::min<int64_t>(16, Mp));  // a decode step's rows
  _tile_loadconfig(&cfg);
  alignas(64) float C[32 * 32];
  const int64_t ktiles = Kp / 32, tile = PAIRS_TILE * 32;  // a B tile: 16 pair-rows of 32 bf16 (1 KB)
  const int64_t block = (q1 - q0) * pstride * 2 <= AMX_PANEL_BYTES ? AMX_ROWS : Mp;
  for (int64_t mb = 0; mb < Mp; mb += block) {  // a block of rows against every panel pair
    for (int64_t p = q0; p < q1; p += 2) {
      const int64_t p1 = std::min(p + 1, q1 - 1);  // an odd last panel runs twice, its copy unused
      const uint16_t *B0 = W + p * pstride, *B1 = W + p1 * pstride;
      for (int64_t m0 = mb; m0 < std::min(Mp, mb + block); m0 += 32) {
        const bool two = m0 + 16 < Mp;  // two 16-row slices of X in this block, or one
        const uint16_t* A = X + m0 * Kp;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t kt = 0; kt < ktiles; ++kt) {
          if (m0 == mb)  // a row block's first pass over the weights: from memory, or from L3
            for (int64_t o = 0; o < tile; o += 32) {
              _mm_prefetch(reinterpret_cast<const char*>(B0 + (kt + PF_TILES) * tile + o), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(B1 + (kt + PF_TILES) * tile + o), _MM_HINT_T0);
            }
          _tile_loadd(4, A + kt * 32, Kp * 2);
          _tile_loadd(6, B0 + kt * tile, 64);
          _tile_loadd(7, B1 + kt * tile, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, A + 16 * Kp + kt * 32, Kp * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, C, 128);
        _tile_stored(1, C + 16, 128);
        if (two) {
          _tile_stored(2, C + 16 * 32, 128);
          _tile_stored(3, C + 16 * 32 + 16, 128);
        }
        const int64_t rows = std::min<int64_t>(two ? 32 : 16, M - m0);
        if (rows <= 0) break;
        for (int64_t half = 0; half < (p1 > p ? 2 : 1); ++half) {
          const int64_t c0 = (p + half) * NR, nv = std::min<int64_t>(NR, n - c0);
          if (nv > 0) store_rows_bf16_16(C + half * 16, 32, rows, bias ? bias + c0 : nullptr, Y + m0 * n + c0, n, nv);
        }
      }
    }
  }
  _tile_release();
}
SVRMAD_TARGET_END
#endif

// rows [m, m + R) of X against one panel or NP adjacent ones, on the run-time level's instructions; PF: the
// panels come from memory (prefetch_ahead)
template <int R, int NP, bool PF = false>
static void bf16_tile(int level, const uint16_t* X, int64_t ldx, int64_t K2, const uint16_t* W, int64_t pstride,
                      float* out) {
#ifdef SVRMAD_X86_TARGETS
  if (level >= svrmad::ISA_AVX512_BF16) return dp_tile<R, NP, PF>(X, ldx, K2, W, pstride, out);
#endif
  emu_tile<R, NP, PF>(X, ldx, K2, W, pstride, out);
}

template <bool PF>
static void bf16_rows(int level, int64_t R, const uint16_t* X, int64_t ldx, int64_t K2, const uint16_t* W,
                      int64_t pstride, float* out) {
  with_rows<BF16_ROWS_DP>(R, [&](auto r) { bf16_tile<decltype(r)::value, 1, PF>(level, X, ldx, K2, W, pstride, out); });
}

// x [M, K] bf16, panels [P, K2p, 32] bf16 -> y [M, n] bf16 (see above)
static void panel_linear_bf16(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                              int64_t row_width, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K2p = panels.size(1), K2 = (K + 1) / 2;
  TORCH_CHECK(panels.size(2) == 32 && K2 <= K2p && K2p % PAIRS_TILE == 0 && K2p - K2 < PAIRS_TILE,
              "x [M, K] and bf16 panels [P, ceil(K / 32) * 16, 32]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16 panels take bf16 inputs");
  std::vector<float> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() >= n, "a bias of n values");
    auto b = bias->to(at::kFloat).contiguous();
    bias_f.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
  }
  const float* B = bias.has_value() ? bias_f.data() : nullptr;
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  const int64_t pstride = K2p * 32, Pn = std::min<int64_t>(P, (n + NR - 1) / NR);
  const int level = svrmad::isa_level();
#ifdef SVRMAD_X86_TARGETS
  if (level >= svrmad::ISA_AMX && M >= g_amx_min_rows) {
    const int64_t Mp = M < 16 ? M : (M + 15) / 16 * 16, Kp = K2p * 2;
    x = x.contiguous();
    const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    if (Mp != M || Kp != K) {  // X as whole tiles, zeros around it (no torch op: ~121 calls a step)
      thread_local std::vector<uint16_t> padded;
      padded.resize(Mp * Kp);
      for (int64_t m = 0; m < Mp; ++m) {
        uint16_t* row = padded.data() + m * Kp;
        if (m < M) std::memcpy(row, X + m * K, K * sizeof(uint16_t));
        std::memset(row + (m < M ? K : 0), 0, (m < M ? Kp - K : Kp) * sizeof(uint16_t));
      }
      X = padded.data();
    }
    const int64_t pairs = (Pn + 1) / 2;
    at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
      amx_panels(X, Mp, Kp, W, pstride, 2 * q0, std::min(Pn, 2 * q1), B, Y, M, n);
    });
    return;
  }
#endif
  x = x.contiguous();
  if (K % 2) x = torch::constant_pad_nd(x, {0, 1});  // the last pair's high half: a zero
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t ldx = x.size(1);
  if (M == 1) {
    // vdpbf16ps walks one panel at a time whatever row_width asks: its one chain a pair-row keeps pace with
    // the stream, and one contiguous stream read 8-20% faster than four (2-core avx512_bf16 EPYC); the
    // AVX2 path's two FMAs a pair need the panels side by side for chains enough
    if (level >= svrmad::ISA_AVX512_BF16) row_width = 1;
    at::parallel_for(0, Pn, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float out[4 * NR];
      for (int64_t p = p0; p < p1;) {
        const int64_t np = row_width >= 4 && p + 4 <= p1 ? 4 : row_width >= 2 && p + 2 <= p1 ? 2 : 1;
        if (np == 4) bf16_tile<1, 4>(level, X, ldx, K2, W + p * pstride, pstride, out);
        else if (np == 2) bf16_tile<1, 2>(level, X, ldx, K2, W + p * pstride, pstride, out);
        else bf16_tile<1, 1>(level, X, ldx, K2, W + p * pstride, pstride, out);
        for (int64_t j = 0; j < np; ++j) {
          const int64_t c0 = (p + j) * NR, nv = std::min<int64_t>(NR, n - c0);
          store_rows_bf16(out + j * NR, 0, 1, B ? B + c0 : nullptr, Y + c0, n, nv);
        }
        p += np;
      }
    });
    return;
  }
  const int64_t rows_tile = level >= svrmad::ISA_AVX512_BF16 ? BF16_ROWS_DP : BF16_ROWS_EMU;
  at::parallel_for(0, Pn, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float out[BF16_ROWS_DP * NR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * NR, nv = std::min<int64_t>(NR, n - c0);
      for (int64_t m = 0; m < M; m += rows_tile) {
        const int64_t R = std::min(rows_tile, M - m);
        (m == 0 ? bf16_rows<true> : bf16_rows<false>)(level, R, X + m * ldx, ldx, K2, W + p * pstride, pstride, out);
        store_rows_bf16(out, NR, R, B ? B + c0 : nullptr, Y + m * n + c0, n, nv);
      }
    }
  });
}

// x [M, K] against panels of its dtype (fp32 [P, K, 16] or bf16 [P, K2p, 32]) -> y [M, n], written into `y` (a
// contiguous [M, n] tensor of x's dtype): the compiled decode step (cpu_stack.cpp) keeps its outputs between
// steps rather than have a tensor made for each of its ~121 calls
void panel_linear_into(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                       int64_t kblock, int64_t row_width, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3, "x [M, K] and panels [P, K, 16]");
  TORCH_CHECK(panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16,
              "fp32 or bf16 panels only");
  TORCH_CHECK(panels.is_contiguous() && n >= 0 && n <= panels.size(0) * NR && kblock > 0,
              "contiguous panels covering n columns");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == n &&
              y.scalar_type() == x.scalar_type(), "the output must be a contiguous [M, n] tensor of x's dtype");
  if (panels.scalar_type() == at::kBFloat16) return panel_linear_bf16(x.contiguous(), panels, n, bias, row_width, y);
  panel_linear_f32(x, panels, n, bias, kblock, row_width, y);
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                           int64_t kblock, int64_t row_width) {
  TORCH_CHECK(x.dim() == 2, "x [M, K] and panels [P, K, 16]");
  auto y = torch::empty({x.size(0), n}, x.options());
  panel_linear_into(x, panels, n, bias, kblock, row_width, y);
  return y;
}

// rows `ids` (any shape) of the dense weight the panels hold, an embedding lookup from a tied LM head's panels:
// a copy of the values cpu_linear.py's `rows_of` names, in one call where its indexing took ~6 torch ops
// (~0.13 ms of a batch-1 bf16 step on a 2-core Xeon). fp32 panels [P, K, 16] hold W[c, k] at [c / 16, k, c % 16]
// and give K values a row; bf16 panels [P, K2p, 32] hold W[c, k] at [c / 16, k / 2, (c % 16) * 2 + k % 2] and
// give the first `k` of a row (k < 0: all 2 * K2p).
torch::Tensor panel_rows(torch::Tensor panels, torch::Tensor ids, int64_t k) {
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() &&
              (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "panel_rows: contiguous fp32 or bf16 panels");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "panel_rows: int64 ids");
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  const int64_t P = panels.size(0), D1 = panels.size(1), rows = P * NR, width = bf16 ? 2 * D1 : D1;
  TORCH_CHECK(panels.size(2) == (bf16 ? 2 * NR : NR), "panel_rows: panels of 16 columns");
  const int64_t K = bf16 && k >= 0 ? k : width;
  TORCH_CHECK(K <= width, "panel_rows: ", K, " values a row, the panels hold ", width);
  const auto idx = ids.contiguous();
  const int64_t* I = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    TORCH_CHECK(I[i] >= 0 && I[i] < rows, "panel_rows: id ", I[i], " outside the panels' ", rows, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  auto out = torch::empty(shape, panels.options());
  const int64_t lane = bf16 ? 2 * NR : NR;
  if (bf16) {
    const uint16_t* W = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
    uint16_t* O = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < idx.numel(); ++i) {
      const uint16_t* src = W + (I[i] / NR) * D1 * lane + (I[i] % NR) * 2;
      for (int64_t c = 0; c < K; ++c) O[i * K + c] = src[(c / 2) * lane + c % 2];
    }
  } else {
    const float* W = panels.data_ptr<float>();
    float* O = out.data_ptr<float>();
    for (int64_t i = 0; i < idx.numel(); ++i) {
      const float* src = W + (I[i] / NR) * D1 * lane + I[i] % NR;
      for (int64_t c = 0; c < K; ++c) O[i * K + c] = src[c * lane];
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", torch::wrap_pybind_function(panel_linear), "panel_linear");
  m.def("panel_rows", torch::wrap_pybind_function(panel_rows), "rows of the dense weight, read from the panels");
  m.def("addresses", []() { return std::vector<int64_t>{svrmad::address<svrmad::LinearFn>(&panel_linear_into)}; },
        "panel_linear_into's address, for a C++ caller (cpu_stack.cpp)");
  m.def("isa_level", []() { return svrmad::isa_level(); }, "the run-time ISA level the kernel takes");
  m.def("set_isa_level", [](int level) { return svrmad::set_isa_level(level); }, "caps it; returns the one before");
  m.def("set_amx_min_rows", [](int64_t rows) {
    const int64_t before = g_amx_min_rows;
    g_amx_min_rows = std::max<int64_t>(1, rows);
    return before;
  }, "calls of at least this many rows take the AMX tiles; returns the setting before");
}
