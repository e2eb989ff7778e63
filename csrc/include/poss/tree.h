// The tree encoding shared by every poss op, and the helpers that read it. Host and device code
// both include this file, so the CPU tests exercise the same logic the GPU runs.
//
// Per request: N nodes in topological order. Node 0 is the root (the last committed token),
// parents[0] = -1 and 0 <= parents[i] < i for every real node i >= 1. Padding nodes carry
// parents = -2 and come only after the real nodes.
#pragma once

#include <cstdint>

#include "poss/limits.h"
#include "poss/macros.h"

namespace poss {

// A read-only view of one request's tree.
struct TreeView {
  const int32_t* parents;  // [n]
  const int64_t* tokens;   // [n]
  int32_t n;
};

enum class TreeError : int32_t {
  kOk = 0,
  kRootParent,          // parents[0] != -1
  kParentOutOfRange,    // a real node's parent is not in [0, i)
  kPaddingNotTrailing,  // a real node follows a padding node
  kTokenOutOfRange,     // a real node's token is not in [0, vocab)
};

// What one pass over a request's parents row finds.
struct TreeScan {
  TreeError error;
  int32_t node;    // the first offending node (error != kOk)
  int32_t n_real;  // real nodes; padding follows them
  bool chain;      // parents[i] = i - 1 for every real node i >= 1
};

// Validates the parents encoding and classifies the tree, in one pass.
POSS_HD TreeScan scan_parents(const int32_t* parents, int32_t n) {
  if (n < 1 || parents[0] != kRootParent) return {TreeError::kRootParent, 0, 0, false};
  int32_t n_real = 1;
  bool chain = true, padding = false;
  for (int32_t i = 1; i < n; ++i) {
    const int32_t p = parents[i];
    if (p == kPadParent) {
      padding = true;
      continue;
    }
    if (padding) return {TreeError::kPaddingNotTrailing, i, 0, false};
    if (p < 0 || p >= i) return {TreeError::kParentOutOfRange, i, 0, false};
    chain = chain && p == i - 1;
    n_real = i + 1;
  }
  return {TreeError::kOk, -1, n_real, chain};
}

// scan_parents plus the tokens of the real nodes in [0, vocab).
POSS_HD TreeScan validate_tree(TreeView t, int64_t vocab) {
  TreeScan scan = scan_parents(t.parents, t.n);
  for (int32_t i = 0; scan.error == TreeError::kOk && i < scan.n_real; ++i) {
    if (t.tokens[i] < 0 || t.tokens[i] >= vocab) scan = {TreeError::kTokenOutOfRange, i, 0, false};
  }
  return scan;
}

// The next child of `parent` after node `after`, in node order; -1 when there is none.
// Children always have larger ids than their parent, so start the scan at parent + 1.
POSS_HD int32_t next_child(TreeView t, int32_t parent, int32_t after) {
  for (int32_t j = (after > parent ? after : parent) + 1; j < t.n; ++j) {
    if (t.parents[j] == parent) return j;
  }
  return -1;
}

POSS_HD int32_t first_child(TreeView t, int32_t parent) { return next_child(t, parent, parent); }

}  // namespace poss
