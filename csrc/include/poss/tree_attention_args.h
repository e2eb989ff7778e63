// Structural validation of tree_attention's arguments, shared by the CPU and CUDA entry points.
// Value checks (the tree encoding, prefix_len range) live with each kernel: on the host for the
// CPU, device-side asserts for CUDA (no host sync).
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "poss/arg_checks.h"
#include "poss/tree_attention.h"
#include "poss/tree_checks.h"

namespace poss {

struct TreeAttnShape {
  int64_t B, Hq, Hkv, Nq, N, S, D;
};

inline TreeAttnShape check_tree_attention_args(const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache,
                                               const at::Tensor& prefix_len,
                                               const at::Tensor& parents, double scale) {
  check_dim(q, "q", 4, "[B, Hq, Nq, D]");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "q must be float32, bfloat16 or float16, got ", dt);
  const int64_t B = q.size(0), Hq = q.size(1), Nq = q.size(2), D = q.size(3);
  TORCH_CHECK(supported_head_dim(D), "q.size(3) (head dim D) must be one of ", head_dims_text(),
              ", got shape ", shape_str(q));
  check_dim(k_cache, "k_cache", 4, "[B, Hkv, S, D]");
  check_dtype(k_cache, "k_cache", dt);
  check_size(k_cache, "k_cache", 0, B, "B (q.size(0))");
  check_size(k_cache, "k_cache", 3, D, "D (q.size(3))");
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "k_cache.size(1) (Hkv) must divide q.size(1) (Hq = ",
              Hq, "), got shape ", shape_str(k_cache));
  check_dim(v_cache, "v_cache", 4, "[B, Hkv, S, D]");
  check_dtype(v_cache, "v_cache", dt);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have the shape of k_cache ",
              shape_str(k_cache), ", got shape ", shape_str(v_cache));
  check_dim(prefix_len, "prefix_len", 1, "[B] int32");
  check_dtype(prefix_len, "prefix_len", at::kInt);
  check_size(prefix_len, "prefix_len", 0, B, "B (q.size(0))");
  check_dim(parents, "parents", 2, "[B, N] int32");
  check_dtype(parents, "parents", at::kInt);
  check_size(parents, "parents", 0, B, "B (q.size(0))");
  const int64_t N = parents.size(1);
  TORCH_CHECK(N >= 1, "parents must have at least one node (the root), got shape ",
              shape_str(parents));
  TORCH_CHECK(Nq <= N, "q.size(2) (Nq) must be <= N = parents.size(1) = ", N, ", got shape ",
              shape_str(q));
  TORCH_CHECK(N <= S, "k_cache.size(2) (S) must be >= N = parents.size(1) = ", N,
              ", got shape ", shape_str(k_cache));
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0, "scale must be finite and > 0, got ", scale);
  check_same_device(k_cache, "k_cache", q, "q");
  check_same_device(v_cache, "v_cache", q, "q");
  check_same_device(prefix_len, "prefix_len", q, "q");
  check_same_device(parents, "parents", q, "q");
  return {B, Hq, Hkv, Nq, N, S, D};
}

// Host check of request b's tree: the encoding, and a size the attention kernels take. Shared by
// tree_attention's CPU kernel and decoder_layer, which must check before it writes the KV cache.
inline TreeScan check_attention_tree(const int32_t* parents_row, int64_t N, int64_t b) {
  const TreeScan t = scan_parents(parents_row, static_cast<int32_t>(N));
  check_tree_scan(t, b, parents_row);
  TORCH_CHECK(attention_tree_fits(t), "parents[", b, "] is a general (non-chain) tree with ",
              t.n_real, " real nodes; at most ", kAttnMaxTreeNodes,
              " are supported (chains, parents[i] = i - 1, have no limit)");
  return t;
}

}  // namespace poss
