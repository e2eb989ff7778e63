// The row-exact CPU path of poss::tree_attention (csrc/cpu/tree_attention_exact.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace poss {

// One request served by the row-exact path.
struct ExactRequest {
  int64_t b;
  int64_t prefix;         // prefix_len[b]
  int32_t n_real;         // real tree nodes
  bool chain;
  const uint64_t* masks;  // [n_real, kAttnMaskWords] ancestor rows; null for chains
};

// Writes out[b, :, i - (N - Nq), :] for every listed request b and query node i in
// [N - Nq, n_real). q, out: [B, Hq, Nq, D] contiguous; k, v: [B, Hkv, S, D] with unit stride on D.
void tree_attention_exact(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          const std::vector<ExactRequest>& requests, int64_t N, double scale);

// SIMD lanes of the row-exact score, exp and P.V loops on this CPU: 16 (AVX512F) or 8. Both give
// the same bits; POSS_ATTENTION_LANES=8 (read once) forces 8.
int64_t cpu_exact_attention_lanes();

}  // namespace poss
