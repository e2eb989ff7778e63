// Host-side validation of the decoder-layer ops, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include "poss/arg_checks.h"

namespace poss {

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kHalf,
              name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

inline void check_rms_args(const at::Tensor& x, const at::Tensor& weight) {
  check_float_dtype(x, "x");
  TORCH_CHECK(x.dim() >= 1, "x must have at least 1 dimension, got a scalar");
  check_dim(weight, "weight", 1, "[H]");
  check_size(weight, "weight", 0, x.size(-1), "x.size(-1)");
  check_dtype(weight, "weight", x.scalar_type());
  check_same_device(weight, "weight", x, "x");
}

inline void check_swiglu_args(const at::Tensor& gate_up) {
  check_float_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "gate_up must be [..., 2F] (gate then up), got shape ", shape_str(gate_up));
}

// Returns head_dim.
inline int64_t check_rope_qkv_args(const at::Tensor& qkv, const at::Tensor& positions,
                                   const at::Tensor& inv_freq, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& start,
                                   int64_t num_heads, int64_t num_kv_heads) {
  check_float_dtype(qkv, "qkv");
  check_dim(qkv, "qkv", 3, "[B, T, (Hq + 2 Hkv) D]");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads must be a positive multiple of num_kv_heads, got ", num_heads, " and ",
              num_kv_heads);
  check_dim(k_cache, "k_cache", 4, "[B, Hkv, S, D]");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = k_cache.size(3);
  TORCH_CHECK(D % 2 == 0, "k_cache head dim must be even for RoPE, got ", D);
  check_size(qkv, "qkv", 2, (num_heads + 2 * num_kv_heads) * D, "(num_heads + 2 num_kv_heads) * D");
  check_dtype(k_cache, "k_cache", qkv.scalar_type());
  check_size(k_cache, "k_cache", 0, B, "B");
  check_size(k_cache, "k_cache", 1, num_kv_heads, "num_kv_heads");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ",
              shape_str(k_cache), ", got ", shape_str(v_cache));
  check_dtype(v_cache, "v_cache", qkv.scalar_type());
  check_separate_caches(k_cache, v_cache);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous");
  check_dtype(positions, "positions", at::kLong);
  check_dim(positions, "positions", 2, "[B, T]");
  check_size(positions, "positions", 0, B, "B");
  check_size(positions, "positions", 1, T, "T");
  check_dtype(inv_freq, "inv_freq", at::kFloat);
  check_dim(inv_freq, "inv_freq", 1, "[D / 2]");
  check_size(inv_freq, "inv_freq", 0, D / 2, "D / 2");
  check_dtype(start, "start", at::kInt);
  check_dim(start, "start", 1, "[B]");
  check_size(start, "start", 0, B, "B");
  check_same_device(positions, "positions", qkv, "qkv");
  check_same_device(inv_freq, "inv_freq", qkv, "qkv");
  check_same_device(k_cache, "k_cache", qkv, "qkv");
  check_same_device(v_cache, "v_cache", qkv, "qkv");
  check_same_device(start, "start", qkv, "qkv");
  return D;
}

}  // namespace poss
