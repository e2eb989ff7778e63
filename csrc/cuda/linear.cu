// poss::linear on CUDA: cuBLAS through ATen (no row-invariance promise on this device).
#include <torch/library.h>

#include "poss/linear_args.h"

namespace poss {
namespace {

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  check_linear(x, weight, bias, residual);
  return linear_aten(x, weight, bias, residual);
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) { m.impl("linear", &linear_cuda); }

}  // namespace poss
