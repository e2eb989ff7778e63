// Structural validation of tree_verify's arguments, shared by the CPU and CUDA entry points.
// Value checks (tree encoding, token range, parameter ranges) live with each kernel: the CPU
// kernel checks on the host, the CUDA kernel with device-side asserts (no host sync).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "poss/arg_checks.h"

namespace poss {

struct TreeVerifyShape {
  int64_t batch, nodes, vocab;
};

inline TreeVerifyShape check_tree_verify_args(const at::Tensor& parents, const at::Tensor& tokens,
                                              const at::Tensor& logits,
                                              const std::optional<at::Tensor>& temperature,
                                              const std::optional<at::Tensor>& top_k,
                                              const std::optional<at::Tensor>& top_p,
                                              const std::optional<at::Tensor>& uniforms,
                                              const std::optional<at::Tensor>& min_p) {
  check_dim(parents, "parents", 2, "[B, N] int32");
  check_dtype(parents, "parents", at::kInt);
  const int64_t B = parents.size(0), N = parents.size(1);
  TORCH_CHECK(N >= 1, "parents must have at least one node (the root), got shape ",
              shape_str(parents));
  check_dim(tokens, "tokens", 2, "[B, N] int64");
  check_dtype(tokens, "tokens", at::kLong);
  check_size(tokens, "tokens", 0, B, "B (parents.size(0))");
  check_size(tokens, "tokens", 1, N, "N (parents.size(1))");
  check_dim(logits, "logits", 3, "[B, N, V]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              "logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  check_size(logits, "logits", 0, B, "B (parents.size(0))");
  check_size(logits, "logits", 1, N, "N (parents.size(1))");
  const int64_t V = logits.size(2);
  TORCH_CHECK(V >= 1, "logits must have a vocabulary of at least 1, got shape ",
              shape_str(logits));
  check_same_device(tokens, "tokens", parents, "parents");
  check_same_device(logits, "logits", parents, "parents");

  auto check_per_request = [&](const std::optional<at::Tensor>& t, const char* name,
                               at::ScalarType dtype) {
    if (!t) return;
    check_dim(*t, name, 1, "[B]");
    check_dtype(*t, name, dtype);
    check_size(*t, name, 0, B, "B (parents.size(0))");
    check_same_device(*t, name, parents, "parents");
  };
  check_per_request(temperature, "temperature", at::kFloat);
  check_per_request(top_k, "top_k", at::kInt);
  check_per_request(top_p, "top_p", at::kFloat);
  check_per_request(min_p, "min_p", at::kFloat);
  if (uniforms) {
    check_dim(*uniforms, "uniforms", 2, "[B, N+1] float32");
    check_dtype(*uniforms, "uniforms", at::kFloat);
    check_size(*uniforms, "uniforms", 0, B, "B (parents.size(0))");
    check_size(*uniforms, "uniforms", 1, N + 1, "N + 1");
    check_same_device(*uniforms, "uniforms", parents, "parents");
  } else if (temperature) {
    // Only here does the op read a device value on the host: a missing-argument error path.
    TORCH_CHECK(!temperature->gt(0).any().item<bool>(),
                "uniforms ([B, N+1] float32 in [0, 1)) is required when any temperature > 0");
  }
  return {B, N, V};
}

}  // namespace poss
