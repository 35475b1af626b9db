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

// rows [0, R) of X against NP adjacent panels: out[r][j] = sum_k X[r][k] * panel[k][j], one FMA chain a
// KBLOCK of k's, the chains added in order; then the bias. Columns from N on are not written. NP > 1
// only with one row (a decode step at batch 1, row_panels): 2 * NP independent chains in flight
// instead of two, the same arithmetic per output; with two, the FMA latency paced the loads and the
// stream ran at ~28 GB/s of the ~32 a sum read (2-core AVX2 EPYC), with four panels at ~31
template <int R, int NP, int PF>
static void micro(const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias, float* Y,
                  int64_t N, int64_t n0) {
  static_assert(NP == 1 || R == 1, "several panels of one row, or rows of one panel");
  static_assert(R * NP <= MR, "at most 12 accumulators");
  __m256 tot[R][NP][2];
  for (int64_t kb = 0; kb < K; kb += kblock) {
    const int64_t ke = std::min(K, kb + kblock);
    __m256 acc[R][NP][2];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int64_t k = kb; k < ke; ++k) {
      if (PF == PF_AHEAD && R > 1) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PF_K) * NR), _MM_HINT_T0);
      else if (PF == PF_NEXT) _mm_prefetch(reinterpret_cast<const char*>(panel + (K + k) * NR), _MM_HINT_T1);
      if constexpr (NP == 1) {  // rows of one panel: the panel's k loaded once, each row's x broadcast
        const __m256 w0 = _mm256_loadu_ps(panel + k * NR), w1 = _mm256_loadu_ps(panel + k * NR + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 xb = _mm256_broadcast_ss(X + r * K + k);
          acc[r][0][0] = _mm256_fmadd_ps(xb, w0, acc[r][0][0]);
          acc[r][0][1] = _mm256_fmadd_ps(xb, w1, acc[r][0][1]);
        }
      } else {  // one row of several panels: its x broadcast once, each panel's k loaded
        const __m256 xb = _mm256_broadcast_ss(X + k);
        for (int p = 0; p < NP; ++p) {
          const float* w = panel + (p * K + k) * NR;
          acc[0][p][0] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w), acc[0][p][0]);
          acc[0][p][1] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + 8), acc[0][p][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p)
        for (int h = 0; h < 2; ++h) tot[r][p][h] = kb == 0 ? acc[r][p][h] : _mm256_add_ps(tot[r][p][h], acc[r][p][h]);
  }
  alignas(32) float out[NR];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) {
      _mm256_store_ps(out, tot[r][p][0]);
      _mm256_store_ps(out + 8, tot[r][p][1]);
      const int64_t c0 = n0 + p * NR, nv = std::min<int64_t>(NR, N - c0);
      float* y = Y + r * N + c0;
      for (int j = 0; j < nv; ++j) y[j] = bias ? out[j] + bias[c0 + j] : out[j];
    }
}

// panels [p0, p1) of one row, `width` (4, 2 or 1) at a time, then fewer; panels wholly past N are skipped
static void row_panels(const float* X, int64_t K, const float* W, int64_t kblock, const float* bias, float* Y,
                       int64_t N, int64_t p0, int64_t p1, int64_t width) {
  p1 = std::min<int64_t>(p1, (N + NR - 1) / NR);
  int64_t p = p0;
  if (width >= 4)
    for (; p + 4 <= p1; p += 4) micro<1, 4, PF_NONE>(X, K, W + p * K * NR, kblock, bias, Y, N, p * NR);
  if (width >= 2)
    for (; p + 2 <= p1; p += 2) micro<1, 2, PF_NONE>(X, K, W + p * K * NR, kblock, bias, Y, N, p * NR);
  for (; p < p1; ++p) micro<1, 1, PF_NONE>(X, K, W + p * K * NR, kblock, bias, Y, N, p * NR);
}

template <int PF>
static void rows(int64_t R, const float* X, int64_t K, const float* panel, int64_t kblock, const float* bias,
                 float* Y, int64_t N, int64_t n0) {
  switch (R) {
    case 1: micro<1, 1, PF>(X, K, panel, kblock, bias, Y, N, n0); break;
    case 2: micro<2, 1, PF>(X, K, panel, kblock, bias, Y, N, n0); break;
    case 3: micro<3, 1, PF>(X, K, panel, kblock, bias, Y, N, n0); break;
    case 4: micro<4, 1, PF>(X, K, panel, kblock, bias, Y, N, n0); break;
    case 5: micro<5, 1, PF>(X, K, panel, kblock, bias, Y, N, n0); break;
    default: micro<MR, 1, PF>(X, K, panel, kblock, bias, Y, N, n0); break;
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
        const int64_t n0 = p * NR;
        if (n0 >= n) continue;
        for (int64_t m = mc; m < me; m += MR) {
          auto tile = m == mc ? rows<PF_AHEAD> : m + MR >= me ? rows<PF_NEXT> : rows<PF_NONE>;
          tile(std::min<int64_t>(MR, me - m), X + m * K, K, W + p * K * NR, kblock, B, Y + m * n, n, n0);
        }
      }
    });
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", torch::wrap_pybind_function(panel_linear), "panel_linear");
}
