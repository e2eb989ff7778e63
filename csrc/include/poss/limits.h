// The limits and sentinel values of the poss ops, in one place. poss_ext/limits.py holds the same
// values for Python (tests/ops/test_op_limits.py reads this file and checks that they agree), so a
// change here is a change there.
#pragma once

#include <cstdint>
#include <string>

namespace poss {

// Tree encoding: the root's parent, and the parent of a padding node (padding follows real nodes).
constexpr int32_t kRootParent = -1;
constexpr int32_t kPadParent = -2;
// build_tree's candidates: the parent of an empty candidate slot (a request with fewer candidates
// than its batch neighbours).
constexpr int32_t kEmptyCandidate = -2;

// Real nodes of a general (non-chain) tree in tree_attention: each keeps a bitmask of its
// ancestors of this many bits. Chains store no mask and have no limit.
constexpr int32_t kMaxTreeNodes = 256;

// Candidates per request of build_tree on CUDA: they live in the block's shared memory (17 bytes
// each), and 2,048 stay under the 48 KiB every architecture grants without opt-in. The CPU
// kernel has no such limit.
constexpr int64_t kMaxCudaCandidates = 2048;

// Head dims (D) tree_attention and decoder_layer take: the CUDA kernel is instantiated per D.
constexpr int64_t kHeadDims[] = {64, 80, 96, 128, 256};

inline bool supported_head_dim(int64_t d) {
  for (const int64_t h : kHeadDims) {
    if (h == d) return true;
  }
  return false;
}

// "64, 80, 96, 128, 256", for error messages.
inline std::string head_dims_text() {
  std::string s;
  for (const int64_t h : kHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(h);
  return s;
}

}  // namespace poss
