// Structural validation of kv_compact's arguments, shared by the CPU and CUDA entry points.
// Value checks (the move lists) live with each kernel: host checks on the CPU, device asserts on
// CUDA.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "poss/arg_checks.h"

namespace poss {

struct KvCompactShape {
  int64_t layers, batch, heads, slots, dim, nodes;
};

inline KvCompactShape check_kv_compact_args(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                            const at::Tensor& prefix_len,
                                            const at::Tensor& accept_nodes,
                                            const at::Tensor& accept_len) {
  check_dim(k_cache, "k_cache", 5, "[L, B, Hkv, S, D]");
  TORCH_CHECK(at::isFloatingType(k_cache.scalar_type()),
              "k_cache must be a floating dtype (float32, bfloat16, float16), got ",
              k_cache.scalar_type());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ",
              shape_str(k_cache), ", got ", shape_str(v_cache));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache must have k_cache's dtype ",
              k_cache.scalar_type(), ", got ", v_cache.scalar_type());
  check_same_device(v_cache, "v_cache", k_cache, "k_cache");
  // Moved in place, so no .contiguous() copy: rows of D must be contiguous, the rest may be strided
  // (e.g. the K half of a combined [2L, ...] cache).
  TORCH_CHECK(k_cache.size(4) <= 1 || k_cache.stride(4) == 1,
              "k_cache must be contiguous in its last (D) dimension, got strides ",
              c10::str(k_cache.strides()));
  TORCH_CHECK(v_cache.size(4) <= 1 || v_cache.stride(4) == 1,
              "v_cache must be contiguous in its last (D) dimension, got strides ",
              c10::str(v_cache.strides()));
  check_separate_caches(k_cache, v_cache);
  const int64_t L = k_cache.size(0), B = k_cache.size(1), H = k_cache.size(2),
                S = k_cache.size(3), D = k_cache.size(4);
  check_dim(prefix_len, "prefix_len", 1, "[B] int32");
  check_dtype(prefix_len, "prefix_len", at::kInt);
  check_size(prefix_len, "prefix_len", 0, B, "B (k_cache.size(1))");
  check_dim(accept_nodes, "accept_nodes", 2, "[B, N] int32");
  check_dtype(accept_nodes, "accept_nodes", at::kInt);
  check_size(accept_nodes, "accept_nodes", 0, B, "B (k_cache.size(1))");
  TORCH_CHECK(accept_nodes.size(1) >= 1, "accept_nodes must have at least one column (the root), got shape ",
              shape_str(accept_nodes));
  check_dim(accept_len, "accept_len", 1, "[B] int32");
  check_dtype(accept_len, "accept_len", at::kInt);
  check_size(accept_len, "accept_len", 0, B, "B (k_cache.size(1))");
  check_same_device(prefix_len, "prefix_len", k_cache, "k_cache");
  check_same_device(accept_nodes, "accept_nodes", k_cache, "k_cache");
  check_same_device(accept_len, "accept_len", k_cache, "k_cache");
  return {L, B, H, S, D, accept_nodes.size(1)};
}

}  // namespace poss
