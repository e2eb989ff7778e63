// Pieces of poss::tree_attention shared by the CPU and the CUDA kernels: reading the tree
// (validation, chain detection, ancestor bitmasks), the visibility rule of a tree key, and the
// online-softmax / log-sum-exp algebra that both the key-tile loop and the split-K merge use.
//
// Key space of one request: cache slots [0, prefix_len) (the committed prefix, visible to every
// query) followed by the tree's own slots prefix_len + j, j = 0..N-1. Query node i sees tree key j
// iff j is i or an ancestor of i. A chain (parents[i] = i - 1 for every real node) is causal
// attention over the chunk: j <= i, with no mask stored.
#pragma once

#include <cmath>
#include <cstdint>

#include "poss/macros.h"
#include "poss/tree.h"

namespace poss {

// General (non-chain) trees keep one ancestor bitmask per node: kAttnMaskWords x 64 bits.
constexpr int32_t kAttnMaxTreeNodes = kMaxTreeNodes;
constexpr int32_t kAttnMaskWords = kAttnMaxTreeNodes / 64;

// Whether a scanned tree fits the attention kernels: chains have no size limit (no mask is stored).
POSS_HD bool attention_tree_fits(const TreeScan& scan) {
  return scan.chain || scan.n_real <= kAttnMaxTreeNodes;
}

// masks[i * kAttnMaskWords + w]: bit j of the row is set iff j is i or an ancestor of i.
// Topological order makes one forward pass enough: a node's row is its parent's row plus itself.
POSS_HD void build_ancestor_masks(const int32_t* parents, int32_t n_real, uint64_t* masks) {
  for (int32_t i = 0; i < n_real; ++i) {
    uint64_t* row = masks + static_cast<int64_t>(i) * kAttnMaskWords;
    const int32_t p = parents[i];
    for (int32_t w = 0; w < kAttnMaskWords; ++w) {
      row[w] = p >= 0 ? masks[static_cast<int64_t>(p) * kAttnMaskWords + w] : 0ull;
    }
    row[i >> 6] |= 1ull << (i & 63);
  }
}

// Whether query node i sees tree key j. `mask_row` is node i's ancestor row (unused for chains).
POSS_HD bool tree_key_visible(bool chain, const uint64_t* mask_row, int32_t i, int32_t j) {
  return chain ? j <= i : ((mask_row[j >> 6] >> (j & 63)) & 1ull) != 0;
}

// Running state of one query row's softmax: m = max score seen, l = sum of exp(score - m).
// The row's output accumulator holds sum exp(score - m) * v, unnormalised.
struct SoftmaxState {
  float m;
  float l;
};

// exp(a - b) that is 0 when a = -inf (nothing seen yet), without forming inf - inf.
POSS_HD float exp_diff(float a, float b) {
#if defined(__CUDA_ARCH__)
  return a == -INFINITY ? 0.0f : __expf(a - b);
#else
  return a == -INFINITY ? 0.0f : std::exp(a - b);
#endif
}

// Folds a tile whose row maximum is `tile_max` and whose exp-sum (relative to the new maximum)
// will be `tile_sum` into the state. Returns the factor the old accumulator must be scaled by.
// Two-step use: new_max() before exponentiating the tile, then absorb() with the tile's sum.
POSS_HD float softmax_new_max(SoftmaxState s, float tile_max) {
  return s.m > tile_max ? s.m : tile_max;
}
POSS_HD float softmax_absorb(SoftmaxState& s, float new_max, float tile_sum) {
  const float corr = exp_diff(s.m, new_max);
  s.l = s.l * corr + tile_sum;
  s.m = new_max;
  return corr;
}

// Log-sum-exp merge of partial results over disjoint key sets (split-K / cascade): with
// m = max_k m_k, partial k contributes weight exp(m_k - m) to both l and its unnormalised output,
// so out = sum_k w_k o_k / sum_k w_k l_k. Call with the merged maximum first found by merge_max.
POSS_HD float merge_max(float m, SoftmaxState part) { return part.m > m ? part.m : m; }
POSS_HD float merge_weight(SoftmaxState part, float m) { return exp_diff(part.m, m); }

}  // namespace poss
