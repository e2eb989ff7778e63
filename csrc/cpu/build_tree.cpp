// CPU kernel of poss::build_tree: parallel over requests. Per request one front-to-back pass gives
// every candidate's path (parents precede children), a linear-time selection finds the kept keys,
// and only the T kept indices are sorted. The rule itself is in poss/build_tree.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "poss/build_tree.h"
#include "poss/build_tree_args.h"

namespace poss {
namespace {

void check_request(CandidateView c, int64_t b) {
  for (int32_t i = 0; i < c.m; ++i) {
    switch (check_candidate(c, i)) {
      case CandidateError::kOk: break;
      case CandidateError::kParentOutOfRange:
        TORCH_CHECK(false, "cand_parents[", b, ", ", i, "] = ", c.parents[i], " must be in [-1, ",
                    i, ") (-1 = child of the root, else an earlier candidate) or -2 (empty slot)");
      case CandidateError::kParentEmpty:
        TORCH_CHECK(false, "cand_parents[", b, ", ", i, "] = ", c.parents[i],
                    " points to an empty candidate slot (its parent is -2)");
      case CandidateError::kNaNScore:
        TORCH_CHECK(false, "cand_scores[", b, ", ", i, "] is NaN; scores must be comparable");
    }
  }
}

// One request. `path`, `keys` and `node_of` are per-thread scratch of size M.
void build_one(CandidateView c, int64_t root, int64_t num_nodes, TreeOut out,
               std::vector<PathInfo>& path, std::vector<uint64_t>& keys,
               std::vector<int32_t>& node_of) {
  keys.clear();
  for (int32_t i = 0; i < c.m; ++i) {
    const int32_t p = c.parents[i];
    if (p == kEmptyCandidate) continue;
    path[i] = extend_path(p < 0 ? root_path() : path[p], c.scores[i]);
    keys.push_back(selection_key(path[i].min_score, i));
  }
  const int32_t kept = kept_count(static_cast<int32_t>(keys.size()), num_nodes);
  std::nth_element(keys.begin(), keys.begin() + kept, keys.end(), std::greater<uint64_t>());
  // Candidate-index order is topological: a parent's index is below its child's.
  std::sort(keys.begin(), keys.begin() + kept, [](uint64_t a, uint64_t b) {
    return key_index(a) < key_index(b);
  });
  out.root(root);
  for (int32_t n = 0; n < kept; ++n) {
    const int32_t i = key_index(keys[n]);
    node_of[i] = n + 1;
    out.node(n + 1, c.tokens[i], c.parents[i], node_of.data(), path[i].depth);
  }
  for (int64_t n = kept + 1; n < num_nodes; ++n) out.padding(static_cast<int32_t>(n));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_tree_cpu(const at::Tensor& cand_tokens_in,
                                                              const at::Tensor& cand_scores_in,
                                                              const at::Tensor& cand_parents_in,
                                                              const at::Tensor& root_token_in,
                                                              int64_t num_nodes) {
  const auto [B, M] = check_build_tree_args(cand_tokens_in, cand_scores_in, cand_parents_in,
                                            root_token_in, num_nodes);
  const at::Tensor cand_tokens = cand_tokens_in.contiguous(),
                   cand_scores = cand_scores_in.contiguous(),
                   cand_parents = cand_parents_in.contiguous(),
                   root_token = root_token_in.contiguous();
  const auto opts = cand_tokens.options();
  at::Tensor tokens = at::empty({B, num_nodes}, opts);
  at::Tensor parents = at::empty({B, num_nodes}, opts.dtype(at::kInt));
  at::Tensor depth = at::empty({B, num_nodes}, opts.dtype(at::kInt));

  const auto* tok = cand_tokens.data_ptr<int64_t>();
  const auto* sc = cand_scores.data_ptr<float>();
  const auto* par = cand_parents.data_ptr<int32_t>();
  const auto* root = root_token.data_ptr<int64_t>();
  auto* out_tok = tokens.data_ptr<int64_t>();
  auto* out_par = parents.data_ptr<int32_t>();
  auto* out_dep = depth.data_ptr<int32_t>();
  const int32_t m = static_cast<int32_t>(M);

  // A request is a few microseconds of work (M = 510): let each task take several.
  at::parallel_for(0, B, 8, [&](int64_t begin, int64_t end) {
    std::vector<PathInfo> path(M);
    std::vector<uint64_t> keys;
    keys.reserve(M);
    std::vector<int32_t> node_of(M);
    for (int64_t b = begin; b < end; ++b) {
      const CandidateView c{tok + b * M, sc + b * M, par + b * M, m};
      check_request(c, b);
      const TreeOut out{out_tok + b * num_nodes, out_par + b * num_nodes, out_dep + b * num_nodes};
      build_one(c, root[b], num_nodes, out, path, keys, node_of);
    }
  });
  return {tokens, parents, depth};
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("build_tree", &build_tree_cpu); }

}  // namespace poss
