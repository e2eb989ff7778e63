// The selection rule of build_tree (EAGLE-2 steps 4-6, on the device), written once for the CPU
// and the CUDA kernels.
//
// Candidates of one request: M slots; slot i holds a token, a cumulative draft score and a parent
// (-1 = the root, else a candidate j < i; -2 = the slot is empty, which is how a request with
// fewer candidates than its batch neighbours is expressed).
//
// The rule. Each candidate gets a rank key:
//   key(i) = (path_min(i) descending, i ascending),   path_min(i) = min score on the path from
//                                                      the root's child down to i (i included).
// The first min(num_nodes - 1, #candidates) candidates in key order are kept, in candidate-index
// order (parents precede children), behind the root.
//
// Why this equals EAGLE-2. EAGLE-2 keeps the top-T raw scores (torch.topk over the flattened score
// list) and sorts the kept indices. Its scores are cumulative log-probs, so they never increase
// along a path (fl(s + x) <= s for x <= 0, rounding is monotone). Then path_min(i) = score(i) and
// the two rules coincide, up to ties, which torch.topk breaks in no documented way; we break them
// toward the lower index.
// Why the result is closed under ancestors, whatever the scores and ties. path_min(parent) >=
// path_min(child), and parent < child, so a parent's key always ranks strictly ahead of its
// child's: whenever a child is within the first T keys, so is its parent. (EAGLE-2 itself can break
// here: on a score tie at the cut, torch.topk may keep a child and drop its equal-score parent,
// and on a non-monotone input a child may outscore its parent. Its searchsorted lookup then maps
// the child to a wrong parent, SGLang prints "invalid eagle tree".)
//
// Output (shared tree encoding): node 0 = root (parent -1, depth 0), kept candidates at nodes
// 1..T in index order with parent = node of their parent candidate (0 for the root's children)
// and depth = their depth in the candidate beam; padding nodes after them: token 0, parent -2,
// depth 0 (a valid RoPE offset, so a padded row can be run through the target and ignored).
#pragma once

#include <cstdint>
#include <limits>

#include "poss/macros.h"
#include "poss/selection.h"
#include "poss/tree.h"

namespace poss {

// A read-only view of one request's candidates.
struct CandidateView {
  const int64_t* tokens;   // [m]
  const float* scores;     // [m]
  const int32_t* parents;  // [m]
  int32_t m;
};

enum class CandidateError : int32_t {
  kOk = 0,
  kParentOutOfRange,  // parent not in [-1, i) and not -2 (empty)
  kParentEmpty,       // parent is an empty slot
  kNaNScore,          // a real candidate's score is NaN
};

// Checks slot i; needs only slot i and its parent's emptiness, so each CUDA thread checks its own.
POSS_HD CandidateError check_candidate(CandidateView c, int32_t i) {
  const int32_t p = c.parents[i];
  if (p == kEmptyCandidate) return CandidateError::kOk;
  if (p < -1 || p >= i) return CandidateError::kParentOutOfRange;
  if (p >= 0 && c.parents[p] == kEmptyCandidate) return CandidateError::kParentEmpty;
  if (c.scores[i] != c.scores[i]) return CandidateError::kNaNScore;
  return CandidateError::kOk;
}

// What the selection needs to know about a candidate's path from the root.
struct PathInfo {
  float min_score;  // path_min above
  int32_t depth;    // 1 for a child of the root
};

// The path of a child of a node whose path is `parent`. The root's PathInfo is {+inf, 0}.
POSS_HD PathInfo extend_path(PathInfo parent, float score) {
  return {score < parent.min_score ? score : parent.min_score, parent.depth + 1};
}

POSS_HD PathInfo root_path() { return {std::numeric_limits<float>::infinity(), 0}; }

// PathInfo of candidate i by walking up its ancestors: O(depth), no state, for one CUDA thread per
// candidate. (The CPU kernel builds the same values front to back with extend_path, O(1) each.)
// min is associative and commutative, so folding bottom-up equals extend_path top-down.
// The walk only follows strictly decreasing indices, so it ends even on an invalid input that the
// device asserts would have flagged (e.g. with TORCH_DISABLE_GPU_ASSERTS).
POSS_HD PathInfo walk_path(CandidateView c, int32_t i) {
  PathInfo info{c.scores[i], 1};
  for (int32_t cur = i, p = c.parents[i]; p >= 0 && p < cur; cur = p, p = c.parents[p]) {
    const float s = c.scores[p];
    if (s < info.min_score) info.min_score = s;
    ++info.depth;
  }
  return info;
}

// The rank key: a larger key ranks first. Unique per slot, so the order is total and the kept set
// does not depend on how a sort or a selection breaks ties. -0 and +0 are one score: ordered_key
// tells them apart, and the CUDA kernel's bottom-up minimum can keep the other zero than the CPU's
// top-down one, which would rank a child scored +0 ahead of its parent scored -0.
POSS_HD uint64_t selection_key(float path_min, int32_t i) {
  if (path_min == 0.0f) path_min = 0.0f;
  return (static_cast<uint64_t>(ordered_key(path_min)) << 32) |
         static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(i));
}

POSS_HD int32_t key_index(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu));
}

// How many candidates are kept: everything when there are too few, else num_nodes - 1.
POSS_HD int32_t kept_count(int32_t candidates, int64_t num_nodes) {
  return num_nodes - 1 < candidates ? static_cast<int32_t>(num_nodes - 1) : candidates;
}

// One request's output rows.
struct TreeOut {
  int64_t* tokens;   // [num_nodes]
  int32_t* parents;  // [num_nodes]
  int32_t* depth;    // [num_nodes]

  POSS_HD void root(int64_t token) const {
    tokens[0] = token;
    parents[0] = kRootParent;
    depth[0] = 0;
  }
  // Candidate with `parent_cand` (-1 = root) kept at `node`; node_of[j] = the node of candidate j.
  POSS_HD void node(int32_t node, int64_t token, int32_t parent_cand, const int32_t* node_of,
                    int32_t d) const {
    tokens[node] = token;
    parents[node] = parent_cand < 0 ? 0 : node_of[parent_cand];
    depth[node] = d;
  }
  POSS_HD void padding(int32_t node) const {
    tokens[node] = 0;
    parents[node] = kPadParent;
    depth[node] = 0;
  }
};

}  // namespace poss
