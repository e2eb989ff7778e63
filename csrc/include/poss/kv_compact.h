// The move schedule of kv_compact, written once for the CPU and the CUDA kernels.
//
// Per request b, with P = prefix_len[b] and a_j = accept_nodes[b, j] for j = 0..accept_len[b]:
// slot P + a_j moves to slot P + j, in increasing j, in place.
//
// Why in-place, increasing-j copying is right even when moves overlap. The accepted ids are
// strictly increasing with a_0 >= 0, so a_j >= j for every j (induction: a_j > a_{j-1} >= j - 1).
// Step j writes slot P + j and reads slot P + a_j. That slot was written by an earlier step i < j
// only if P + a_j = P + i, i.e. a_j = i < j: impossible. So every step reads its source before
// anything has overwritten it, and the result equals a gather from a copy of the cache. (Example:
// path 0,1,3,4: step 2 moves slot P+3 to P+2, step 3 moves P+4 to P+3; P+3 is read at step 2,
// before step 3 overwrites it.) A slot is D contiguous elements, so a source and a destination
// are either the same slot (a_j = j: nothing to do) or disjoint.
// Each of the D columns of a slot moves independently of the others, so the CUDA kernel may give
// every column (or 16-byte group of columns) its own thread, as long as that thread walks j in
// increasing order.
#pragma once

#include <cstdint>

#include "poss/macros.h"

namespace poss {

enum class CompactError : int32_t {
  kOk = 0,
  kLenOutOfRange,   // accept_len not in [0, N)
  kPrefixNegative,  // prefix_len < 0
  kNodeNegative,    // accept_nodes[b, 0] < 0
  kNotIncreasing,   // accept_nodes[b, j] <= accept_nodes[b, j-1]
  kNodeOutOfRange,  // accept_nodes[b, j] >= N
  kSlotOutOfRange,  // prefix_len + accept_nodes[b, j] >= S
};

struct CompactCheck {
  CompactError error;
  int32_t j;  // the first offending path entry (-1 when the request-level fields are wrong)
};

// Validates request b's move list: nodes = accept_nodes[b, :], n = N, s = S.
POSS_HD CompactCheck check_compact(const int32_t* nodes, int32_t len, int32_t prefix, int32_t n,
                                   int64_t s) {
  if (len < 0 || len >= n) return {CompactError::kLenOutOfRange, -1};
  if (prefix < 0) return {CompactError::kPrefixNegative, -1};
  for (int32_t j = 0; j <= len; ++j) {
    const int32_t a = nodes[j];
    if (j == 0 && a < 0) return {CompactError::kNodeNegative, 0};
    if (j > 0 && a <= nodes[j - 1]) return {CompactError::kNotIncreasing, j};
    if (a >= n) return {CompactError::kNodeOutOfRange, j};
    if (static_cast<int64_t>(prefix) + a >= s) return {CompactError::kSlotOutOfRange, j};
  }
  return {CompactError::kOk, -1};
}

}  // namespace poss
