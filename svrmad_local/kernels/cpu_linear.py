"""fp32 linears on the CPU from weights kept in 16-column panels: one read of the weights a step.

Why: at decode a step multiplies 1-32 rows by every weight of the model, so its linears are a
stream of the weights through memory. oneDNN on its packed layout streamed them at ~14 GB/s on a
2-core AVX2 EPYC that reads ~20-25; this kernel, on weights stored the way it reads them, streams at
~21. Measured on the default's shapes over 30 layers and its LM head (distinct weights, so nothing
stays in cache), ms per step: M=1 39.0 -> 24.8, M=4 47.3 -> 30.3, M=8 61.5 -> 43.8, M=24 124 -> 105,
M=64 272 -> 243, M=512 1509 -> 1553 (benchmarks/bench_linear.py).

With 2-64 rows the FMAs pace the loads so slowly that the hardware's prefetch left the stream well
under the machine's bandwidth; the first row tile of a pass prefetches 64 k's (4 KB) ahead, and the last
of several tiles the next panel. On a 2-core AVX-512 EPYC (11-25, the same step, ms): M=4 20.9 -> 17.2,
M=8 28.8 -> 22.6, M=12 32.8 -> 21.9, M=24 47.2 -> 34.0, M=64 96.9 -> 85.0, M=512 717 -> 683; M=1
prefetches nothing (it streams at bandwidth).

The layout: weight W [N, K] as panels [ceil(N / 16), K, 16], panel p holding columns 16p..16p+15 of
W^T (zero-padded past N): each panel is one contiguous run, read once per block of input rows. The
kernel keeps 6 rows x 16 columns of outputs in AVX2 registers and walks k in order.

Its arithmetic is fixed: each output is one FMA chain over k, restarted every KBLOCK = 1024 k's, the
chains summed in order, then the bias added. Nothing depends on how many rows are in the call or
where a row sits, so a row's output is bitwise the same at any batch size (a decode step equals the
full-sequence reference). That order is also the one oneDNN's fp32 AVX2 GEMM used on the machine we
measured (bitwise equal at every shape we tried), though no test relies on it: oneDNN is another
library, free to change its blocking by machine and version.
"""

from __future__ import annotations

import torch

from ._cpu_build import Kernel

NR = 16  # columns a panel
KBLOCK = 1024

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

constexpr int NR = 16;   // output columns a panel: two AVX2 vectors
constexpr int MR = 6;    // input rows a micro-kernel call: 12 accumulators
constexpr int64_t MC = 96;  // input rows a pass over the weights (their rows stay in L2 meanwhile)
// Prefetch, as the rows of a pass walk a panel in tiles: the first tile reads PF_K k's (4 KB) ahead of
// itself (with 2-6 rows a k, the FMAs pace the loads so slowly that the hardware's prefetch alone left
// the stream at ~19 GB/s of the machine's ~33); the last of several tiles, which finds its panel in
// cache, pulls the next panel into L2 meanwhile, so the memory does not idle through it.
constexpr int PF_NONE = 0, PF_AHEAD = 1, PF_NEXT = 2;
constexpr int64_t PF_K = 64;

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
    for (int r = 0; r < R; ++r) {
      tot[r][0] = kb == 0 ? acc[r][0] : _mm256_add_ps(tot[r][0], acc[r][0]);
      tot[r][1] = kb == 0 ? acc[r][1] : _mm256_add_ps(tot[r][1], acc[r][1]);
    }
  }
  alignas(32) float out[NR];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out, tot[r][0]);
    _mm256_store_ps(out + 8, tot[r][1]);
    float* y = Y + r * N + n0;
    for (int j = 0; j < nv; ++j) y[j] = bias ? out[j] + bias[n0 + j] : out[j];
  }
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

// x [M, K], panels [P, K, 16] -> y [M, n]
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t n, c10::optional<torch::Tensor> bias,
                           int64_t kblock) {
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
"""

_KERNEL = Kernel("svrmad_cpu_linear_v3", _SOURCE, ["panel_linear"], "SVRMAD_CPU_LINEAR", "panel linear kernel",
                 needs_avx2=True)


def available() -> bool:
    """Compiles on first call (seconds; cached across processes). SVRMAD_CPU_LINEAR=0 turns it off."""
    return _KERNEL.available()


def unavailable_reason() -> str | None:
    return _KERNEL.unavailable_reason()


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / 16), K, 16] (a new tensor; the caller drops the dense one)."""
    n, k = w.shape
    p = -(-n // NR)
    if p * NR != n:
        w = torch.cat([w, w.new_zeros(p * NR - n, k)])
    return w.reshape(p, NR, k).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """panels -> the dense [n, K] weight (a copy)."""
    p, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(p * NR, k)[:n].contiguous()


def rows_of(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the dense weight, read from the panels (an embedding lookup): a copy of exactly those values."""
    return panels[ids // NR, :, ids % NR]


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W[:n].T + bias, W held as `panels` (see pack)."""
    lead = x.shape[:-1]
    return _KERNEL.module().panel_linear(x.reshape(-1, x.shape[-1]), panels, n, bias, KBLOCK).view(*lead, n)
