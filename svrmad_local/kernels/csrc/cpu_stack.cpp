// A decode step's layers in one call: the layer loop of engine/decoder.py for dense Llama-shaped layers,
// written in C++ over the same compiled kernels, called in the same order on the same tensors, so the step
// computes the loop's bits. Built by _cpu_build.py, driven by kernels/cpu_stack.py.
//
// Why: at batch 1 the loop makes ~9 kernel calls a layer from Python, and a call from Python costs
// microseconds the kernel does not (argument parsing, views, closures): on a 2-core Xeon a third of a bf16
// decode step went around the kernels. Here a call is a C++ call.
//
// The kernels are the other modules' own functions (cpu_linear, cpu_ops, cpu_decode), reached through their
// addresses (each module's `addresses` entry, typed by kernel_api.h), not compiled again: one copy of each, with its settings (the
// ISA cap, the AMX row threshold) where the engine set them. Each writes into an output the stack keeps
// between steps (`Buffers`, made again when the step's row count changes): a layer made and freed ~11 tensors.
#include <torch/extension.h>
#include <cstdint>
#include <vector>

#include "kernel_api.h"

using Tensor = torch::Tensor;
using Opt = c10::optional<Tensor>;
using namespace svrmad;

struct Linear {  // panels and their output width (cpu_linear.py pack), the bias or none
  Tensor panels;
  int64_t n;
  Opt bias;
};

struct Layer {
  Tensor in_w, post_w;
  double in_eps, post_eps;
  Linear qkv, o, gate_up, down;
  Opt q_norm, k_norm;  // Qwen3's per-head norms
  double q_eps, k_eps;
  int64_t q_width, kv_width, head_dim, inter;  // q's and k's (= v's) columns of the qkv output; the MLP's width
  double scaling;
  int64_t window;  // -1: none
};

class Stack {
 public:
  // addresses: panel_linear, rms_norm, add_rms_norm, rope_store, silu_mul, paged_decode
  Stack(std::vector<int64_t> addresses, int64_t kblock, int64_t row_width, int64_t vec, Tensor final_w,
        double final_eps)
      : kblock_(kblock), row_width_(row_width), vec_(vec), final_w_(std::move(final_w)), final_eps_(final_eps) {
    TORCH_CHECK(addresses.size() == 6, "Stack: six kernel addresses");
    for (int64_t a : addresses) TORCH_CHECK(a != 0, "Stack: a kernel address is null");
    linear_ = reinterpret_cast<LinearFn>(addresses[0]);
    norm_ = reinterpret_cast<NormFn>(addresses[1]);
    add_norm_ = reinterpret_cast<AddNormFn>(addresses[2]);
    rope_ = reinterpret_cast<RopeFn>(addresses[3]);
    silu_mul_ = reinterpret_cast<SiluMulFn>(addresses[4]);
    decode_ = reinterpret_cast<DecodeFn>(addresses[5]);
  }

  void add_layer(Tensor in_w, double in_eps, Tensor post_w, double post_eps, Tensor qkv, int64_t qkv_n, Opt qkv_bias,
                 Tensor o, int64_t o_n, Opt o_bias, Tensor gate_up, int64_t gate_up_n, Opt gate_up_bias, Tensor down,
                 int64_t down_n, Opt down_bias, Opt q_norm, double q_eps, Opt k_norm, double k_eps, int64_t q_width,
                 int64_t kv_width, int64_t head_dim, double scaling, int64_t window) {
    TORCH_CHECK(q_width + 2 * kv_width == qkv_n && gate_up_n % 2 == 0 && head_dim > 0,
                "Stack.add_layer: q/k/v and gate/up widths disagree with their GEMMs");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "Stack.add_layer: q and k norms go together");
    TORCH_CHECK(q_width % head_dim == 0 && kv_width % head_dim == 0 && o_n == down_n && o_n == in_w.numel(),
                "Stack.add_layer: heads, o_proj and down disagree with the hidden width");
    TORCH_CHECK(layers_.empty() || (layers_[0].qkv.n == qkv_n && layers_[0].q_width == q_width &&
                                    layers_[0].head_dim == head_dim && layers_[0].gate_up.n == gate_up_n &&
                                    layers_[0].o.n == o_n),
                "Stack.add_layer: every layer of one width (their outputs share the stack's buffers)");
    layers_.push_back(Layer{in_w, post_w, in_eps, post_eps, {qkv, qkv_n, qkv_bias}, {o, o_n, o_bias},
                            {gate_up, gate_up_n, gate_up_bias}, {down, down_n, down_bias}, q_norm, k_norm, q_eps,
                            k_eps, q_width, kv_width, head_dim, gate_up_n / 2, scaling, window});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, H]: the embedded decode rows; cos/sin [T, head_dim]; slots [T]; table [T, blocks], lens [T] (the
  // decode kernel's, as engine/decoder.py passes them); the caches of every layer. Returns the final norm's
  // output [T, H]: what engine/decoder.Decoder returns for the same step.
  Tensor run(Tensor x, Tensor cos, Tensor sin, Tensor slots, Tensor table, Tensor lens, int64_t block_size,
             const std::vector<Tensor>& k_caches, const std::vector<Tensor>& v_caches) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size() && !layers_.empty(),
                "Stack.run: one K and one V cache a layer");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == layers_[0].o.n, "Stack.run: x must be [T, hidden]");
    const Buffers& b = buffers(x);
    b.res.copy_(x);  // the first layer's residual is its input
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      if (i == 0) norm_(b.res, L.in_w, L.in_eps, b.y);
      else add_norm_(b.h, b.res, L.in_w, L.in_eps, b.y, b.res);
      linear(b.y, L.qkv, b.qkv);
      Tensor q = columns(b.qkv, 0, L.q_width, L.head_dim);
      Tensor k = columns(b.qkv, L.q_width, L.kv_width, L.head_dim);
      const Tensor v = columns(b.qkv, L.q_width + L.kv_width, L.kv_width, L.head_dim);
      if (L.q_norm.has_value()) {  // in place, each head's values read before it is written
        q = q.reshape({-1, L.head_dim}).contiguous();
        k = k.reshape({-1, L.head_dim}).contiguous();
        norm_(q, *L.q_norm, L.q_eps, q);
        norm_(k, *L.k_norm, L.k_eps, k);
        q = q.view({b.q.size(0), -1, L.head_dim});
        k = k.view({b.q.size(0), -1, L.head_dim});
      }
      rope_(q, k, v, cos, sin, k_caches[i], v_caches[i], slots, b.q);
      decode_(b.q, k_caches[i], v_caches[i], table, lens, block_size, L.scaling, L.window, c10::nullopt, b.att);
      linear(rows(b.att), L.o, b.h);
      add_norm_(b.h, b.res, L.post_w, L.post_eps, b.y, b.res);
      linear(b.y, L.gate_up, b.gu);
      silu_mul_(columns(b.gu, 0, L.inter), columns(b.gu, L.inter, L.inter), vec_, b.m);
      linear(b.m, L.down, b.h);
    }
    auto out = torch::empty_like(b.y);  // the caller's: not a buffer the next step writes
    add_norm_(b.h, b.res, final_w_, final_eps_, out, b.res);
    return out;
  }

 private:
  // a step's activations for its T rows: the residual, a norm's output, the q/k/v GEMM's, the rotated q, the
  // attention's, o_proj's and down's, gate/up's and SiLU-and-multiply's. Kept while T stays (a run of decode
  // steps); `run` is called by the engine's one worker thread, never by two threads at once.
  struct Buffers {
    Tensor res, y, h, qkv, q, att, gu, m;
  };

  const Buffers& buffers(const Tensor& x) const {
    const int64_t T = x.size(0);
    if (!b_.res.defined() || b_.res.size(0) != T || b_.res.scalar_type() != x.scalar_type()) {
      const Layer& L = layers_[0];
      const auto o = x.options();
      const int64_t hidden = x.size(1), heads = L.q_width / L.head_dim;
      b_ = Buffers{torch::empty({T, hidden}, o), torch::empty({T, hidden}, o), torch::empty({T, hidden}, o),
                   torch::empty({T, L.qkv.n}, o), torch::empty({T, heads, L.head_dim}, o),
                   torch::empty({T, heads, L.head_dim}, o), torch::empty({T, L.gate_up.n}, o),
                   torch::empty({T, L.inter}, o)};
    }
    return b_;
  }

  // columns [c0, c0 + n) of a 2-d output, as [rows, n] or, with `head`, [rows, n / head, head]: one as_strided,
  // where narrow then view are two ops (~0.8 against ~0.3 us; ~5 such views a layer)
  static Tensor columns(const Tensor& t, int64_t c0, int64_t n, int64_t head = 0) {
    const int64_t ld = t.stride(0), off = t.storage_offset() + c0;
    if (head == 0) return t.as_strided({t.size(0), n}, {ld, 1}, off);
    return t.as_strided({t.size(0), n / head, head}, {ld, head, 1}, off);
  }

  // a contiguous [T, ...] output as [T, the rest] (the decode kernel's [T, heads, head_dim]), one op
  static Tensor rows(const Tensor& t) {
    TORCH_INTERNAL_ASSERT(t.is_contiguous());
    const int64_t n = t.numel() / t.size(0);
    return t.as_strided({t.size(0), n}, {n, 1}, t.storage_offset());
  }

  void linear(const Tensor& x, const Linear& m, const Tensor& y) const {
    linear_(x, m.panels, m.n, m.bias, kblock_, row_width_, y);
  }

  LinearFn linear_;
  NormFn norm_;
  AddNormFn add_norm_;
  RopeFn rope_;
  SiluMulFn silu_mul_;
  DecodeFn decode_;
  int64_t kblock_, row_width_, vec_;
  Tensor final_w_;
  double final_eps_;
  std::vector<Layer> layers_;
  mutable Buffers b_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<int64_t>, int64_t, int64_t, int64_t, Tensor, double>())
      .def("add_layer", &Stack::add_layer)
      .def("__len__", &Stack::size)
      .def("run", &Stack::run, py::call_guard<py::gil_scoped_release>());
}
