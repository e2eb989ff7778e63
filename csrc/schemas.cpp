// Every poss op's contract, in one place. Per-device kernels register their implementations in
// csrc/cpu/ and csrc/cuda/; fake (meta) kernels live next to the Python wrappers in poss_ext/ops.py.
//
// Tree encoding shared by all ops: per request b, N nodes in topological order; node 0 is the root
// (parents[b, 0] = -1), 0 <= parents[b, i] < i for real nodes, padding nodes (-2) come last.
#include <torch/library.h>

TORCH_LIBRARY(poss, m) {
  // Batched acceptance of a draft tree against the target's logits (greedy or exact sampling).
  m.def(
      "tree_verify(Tensor parents, Tensor tokens, Tensor logits, Tensor? temperature=None, "
      "Tensor? top_k=None, Tensor? top_p=None, Tensor? uniforms=None) "
      "-> (Tensor accept_nodes, Tensor accept_len, Tensor next_token)");

  // The EAGLE-2 dynamic tree: the top (num_nodes - 1) draft candidates, closed under ancestors,
  // in topological order behind the root.
  m.def(
      "build_tree(Tensor cand_tokens, Tensor cand_scores, Tensor cand_parents, Tensor root_token, "
      "int num_nodes) -> (Tensor tokens, Tensor parents, Tensor depth)");

  // Attention of the last Nq tree nodes over a KV cache prefix plus their ancestors in the tree.
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor prefix_len, Tensor parents, "
      "float scale) -> Tensor");

  // Moves the accepted path's KV to contiguous slots behind the prefix, for every layer, in place.
  m.def(
      "kv_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor prefix_len, Tensor accept_nodes, "
      "Tensor accept_len) -> ()");
}
