// Argument checks and the ATen path of poss::linear, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "poss/arg_checks.h"

namespace poss {

// x [..., K], weight [N, K], bias [N], residual [..., N]: one floating dtype, one device.
inline void check_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "x must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x must be [..., K], got a 0-D tensor");
  check_dim(weight, "weight", 2, "[N, K]");
  check_size(weight, "weight", 1, x.size(-1), "x.size(-1) (K)");
  check_dtype(weight, "weight", x.scalar_type());
  check_same_device(weight, "weight", x, "x");
  const int64_t N = weight.size(0);
  if (bias) {
    check_dim(*bias, "bias", 1, "[N]");
    check_size(*bias, "bias", 0, N, "weight.size(0) (N)");
    check_dtype(*bias, "bias", x.scalar_type());
    check_same_device(*bias, "bias", x, "x");
  }
  if (residual) {
    auto want = x.sizes().vec();
    want.back() = N;
    TORCH_CHECK(residual->sizes() == at::IntArrayRef(want), "residual must be [..., N] = ", at::IntArrayRef(want),
                ", got shape ", shape_str(*residual));
    check_dtype(*residual, "residual", x.scalar_type());
    check_same_device(*residual, "residual", x, "x");
  }
}

// Rows of x [..., K]: with K = 0 (or N = 0 for residual), reshape({-1, 0}) cannot infer them.
inline int64_t linear_rows(const at::Tensor& x) {
  return c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
}

// The vendor GEMM (oneDNN / MKL on CPU, cuBLAS on CUDA); bias and residual ride in addmm's beta term.
inline at::Tensor linear_aten(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& residual) {
  const int64_t M = linear_rows(x), K = x.size(-1), N = weight.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const auto x2 = x.reshape({M, K});
  at::Tensor out;
  if (residual) {
    const auto add = bias ? residual->reshape({M, N}) + *bias : residual->reshape({M, N});
    out = at::addmm(add, x2, weight.t());
  } else if (bias) {
    out = at::addmm(*bias, x2, weight.t());
  } else {
    out = at::mm(x2, weight.t());
  }
  return out.view(out_shape);
}

// The kernel poss::linear uses for `dtype` on this CPU: "avx512-bf16" (bf16 on AVX512-BF16),
// "avx2-fma" (fp32 on AVX2 + FMA), both row-invariant (csrc/cpu/linear.cpp), or "aten" (the vendor
// GEMM). POSS_LINEAR (read once): "aten" forces the vendor GEMM, "avx2" the AVX2 kernels on an
// AVX512-BF16 CPU.
const char* cpu_linear_kernel(at::ScalarType dtype);

}  // namespace poss
