// The signatures of the kernels that cpu_stack.cpp calls through their addresses. Each module's `addresses`
// casts its functions to these types, so a kernel whose signature changes fails to compile there instead
// of being called with the wrong arguments (and, as a header, this file is part of every kernel's build key).
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <vector>

namespace svrmad {
// each writes its result into the last argument(s), a contiguous tensor the caller made (and may keep)
using LinearFn = void (*)(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>, int64_t, int64_t,
                          torch::Tensor);
using NormFn = void (*)(torch::Tensor, torch::Tensor, double, torch::Tensor);
using AddNormFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, double, torch::Tensor, torch::Tensor);
using RopeFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                        torch::Tensor, torch::Tensor, torch::Tensor);
using SiluMulFn = void (*)(torch::Tensor, torch::Tensor, int64_t, torch::Tensor);
using DecodeFn = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double, int64_t,
                          c10::optional<torch::Tensor>, torch::Tensor);

template <typename Fn> inline int64_t address(Fn f) { return reinterpret_cast<int64_t>(f); }
}  // namespace svrmad
