// Host-side errors for a tree that breaks the shared encoding: one message per TreeError, naming
// the argument and the offending entry. Used by every CPU kernel that reads `parents` / `tokens`.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "poss/tree.h"

namespace poss {

inline void check_tree_scan(const TreeScan& scan, int64_t b, const int32_t* parents,
                            const int64_t* tokens = nullptr, int64_t vocab = 0) {
  const int64_t i = scan.node;
  switch (scan.error) {
    case TreeError::kOk:
      return;
    case TreeError::kRootParent:
      TORCH_CHECK(false, "parents[", b, ", 0] must be -1 (the root), got ", parents[0]);
    case TreeError::kParentOutOfRange:
      TORCH_CHECK(false, "parents[", b, ", ", i, "] = ", parents[i], " must be in [0, ", i,
                  ") (topological order) or -2 (padding)");
    case TreeError::kPaddingNotTrailing:
      TORCH_CHECK(false, "parents[", b, ", ", i, "] = ", parents[i],
                  " is a real node after padding; padding nodes (-2) must come last");
    case TreeError::kTokenOutOfRange:
      TORCH_CHECK(false, "tokens[", b, ", ", i, "] = ", tokens[i], " must be in [0, ", vocab,
                  ") (the vocabulary of logits)");
  }
}

}  // namespace poss
