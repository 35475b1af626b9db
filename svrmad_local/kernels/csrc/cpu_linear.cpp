// fp32 linears from weights kept in 16-column panels, AVX2: built by _cpu_build.py, called from
// cpu_linear.py (which says why it exists, the layout, and the fixed order of its arithmetic).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "simd.h"

#ifndef SVRMAD_AVX2
#error "the panel linear kernel needs AVX2 and FMA (-mavx2 -mfma)"
#endif

constexpr int NR = 16;   // output columns a panel: two AVX2 vectors
constexpr int MR = 6;    // input rows a micro-kernel call: 12 accumulators
constexpr int64_t MC = 96;  // input rows a pass over the weights (their rows stay in L2 meanwhile)
// Prefetch, as the rows of a pass walk a panel in tiles: the first tile reads PF_K k's (4 KB) ahead of
// itself (with 2-6 rows a k, the FMAs pace the loads so slowly that the hardware's prefetch alone left
// the stream at ~19 GB/s of the machine's ~33); the last of several tiles, which finds its panel in
// cache, pulls the next panel into L2 meanwhile, so the memory does not idle through it.
constexpr int PF_NONE = 0, PF_AHEAD = 1, PF_NEXT = 2;
constexpr int64_t PF_K = 64;

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
      if (PF == PF_AHEAD && R > 1) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PF_K) * NR), _MM_HINT_T0);
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
  switch (R) {
    case 1: micro<1, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); break;
    case 2: micro<2, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); break;
    case 3: micro<3, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); break;
    case 4: micro<4, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); break;
    case 5: micro<5, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); break;
    default: micro<MR, PF>(X, K, panel, kblock, bias, Y, N, n0, nv); break;
  }
}

// x [M, K], panels [P, K, 16] -> y [M, n]; `row_width`: panels at once where M = 1 (row_panels)
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                           int64_t kblock, int64_t row_width) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR && x.size(1) == panels.size(1),
              "x [M, K] and panels [P, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(panels.is_contiguous() && n <= panels.size(0) * NR && kblock > 0, "contiguous panels covering n columns");
  x = x.contiguous();
  torch::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto y = torch::empty({M, n}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = panels.data_ptr<float>();
  const float* B = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  if (M == 1) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { row_panels(X, K, W, kblock, B, Y, n, p0, p1, row_width); });
    return y;
  }
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t me = std::min(M, mc + MC);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR, nv = std::min<int64_t>(NR, n - n0);
        if (nv <= 0) continue;
        for (int64_t m = mc; m < me; m += MR) {
          auto tile = m == mc ? rows<PF_AHEAD> : m + MR >= me ? rows<PF_NEXT> : rows<PF_NONE>;
          tile(std::min<int64_t>(MR, me - m), X + m * K, K, W + p * K * NR, kblock, B, Y + m * n, n, n0, nv);
        }
      }
    });
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", torch::wrap_pybind_function(panel_linear), "panel_linear");
}
