// Structural validation of build_tree's arguments, shared by the CPU and CUDA entry points.
// Value checks (parent ranges, NaN scores) live with each kernel: the CPU kernel checks on the
// host, the CUDA kernel with device-side asserts (no host sync).
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "poss/arg_checks.h"

namespace poss {

struct BuildTreeShape {
  int64_t batch, candidates;
};

inline BuildTreeShape check_build_tree_args(const at::Tensor& cand_tokens,
                                            const at::Tensor& cand_scores,
                                            const at::Tensor& cand_parents,
                                            const at::Tensor& root_token, int64_t num_nodes) {
  check_dim(cand_tokens, "cand_tokens", 2, "[B, M] int64");
  check_dtype(cand_tokens, "cand_tokens", at::kLong);
  const int64_t B = cand_tokens.size(0), M = cand_tokens.size(1);
  check_dim(cand_scores, "cand_scores", 2, "[B, M] float32");
  check_dtype(cand_scores, "cand_scores", at::kFloat);
  check_size(cand_scores, "cand_scores", 0, B, "B (cand_tokens.size(0))");
  check_size(cand_scores, "cand_scores", 1, M, "M (cand_tokens.size(1))");
  check_dim(cand_parents, "cand_parents", 2, "[B, M] int32");
  check_dtype(cand_parents, "cand_parents", at::kInt);
  check_size(cand_parents, "cand_parents", 0, B, "B (cand_tokens.size(0))");
  check_size(cand_parents, "cand_parents", 1, M, "M (cand_tokens.size(1))");
  check_dim(root_token, "root_token", 1, "[B] int64");
  check_dtype(root_token, "root_token", at::kLong);
  check_size(root_token, "root_token", 0, B, "B (cand_tokens.size(0))");
  check_same_device(cand_scores, "cand_scores", cand_tokens, "cand_tokens");
  check_same_device(cand_parents, "cand_parents", cand_tokens, "cand_tokens");
  check_same_device(root_token, "root_token", cand_tokens, "cand_tokens");
  TORCH_CHECK(num_nodes >= 1, "num_nodes must be >= 1 (the root counts), got ", num_nodes);
  TORCH_CHECK(num_nodes <= std::numeric_limits<int32_t>::max(),
              "num_nodes must fit in int32, got ", num_nodes);
  TORCH_CHECK(M < std::numeric_limits<int32_t>::max(),
              "cand_tokens.size(1) (M) must fit in int32, got ", M);
  return {B, M};
}

}  // namespace poss
