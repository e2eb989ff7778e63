// The acceptance walk of tree_verify, written once for the CPU and the CUDA kernels.
//
// The walk is generic over a `Row` policy that owns the vocabulary-wide work on one row of target
// logits (an argmax, or the steps that build the processed distribution). Which steps run, and in
// which order, is decided here (processed_distribution), once for both devices. Both policies split
// each vocabulary-wide step into per-chunk partials and a combine (vocab_split.h). The CPU policy
// vectorises within a chunk; the CUDA policy runs a block per chunk, and every thread of every
// block of a request runs this same walk with the same combined values, so control flow stays
// uniform.
#pragma once

#include <cstdint>

#include "poss/macros.h"
#include "poss/tree.h"

namespace poss {

// Where one request's results go.
// Only the `writer` (thread 0 of a CUDA block; always true on the CPU) stores anything.
struct WalkOutput {
  int32_t* accept_nodes;  // [n]: root first, then the accepted nodes, then -1
  int32_t* accept_len;    // [1]: accepted draft tokens (root not counted)
  int64_t* next_token;    // [1]: the bonus / correction token
  bool writer;

  POSS_HD void finish(int32_t n, int32_t len, int64_t next) const {
    if (!writer) return;
    accept_nodes[0] = 0;
    for (int32_t i = len + 1; i < n; ++i) accept_nodes[i] = -1;
    *accept_len = len;
    *next_token = next;
  }
  POSS_HD void push(int32_t len, int32_t node) const {
    if (writer) accept_nodes[len] = node;
  }
};

// Per-request sampling parameters, already validated.
struct SamplingParams {
  float temperature;  // > 0
  int32_t top_k;      // 0 = off
  float top_p;        // in (0, 1]; 1 = off
  float min_p;        // in [0, 1]; 0 = off
};

POSS_HD bool is_greedy(float temperature) { return !(temperature > 0.0f); }

// min-p keeps the tokens whose weight is at least min_p times the largest weight. Weights are
// proportional to probabilities, so this is "p(x) >= min_p * max p", without normalising. The
// product is rounded to float, and a token is kept when its float weight is >= it.
POSS_HD float min_p_floor(float min_p, float max_weight) { return min_p * max_weight; }

// The processed target distribution at one node, unnormalised, in the order of Hugging Face's
// logits processors, each step applied to the survivors of the previous one:
//   1. temperature and top-k: w(x) = exp((logit(x) - max logit) / T) for the tokens whose logit is
//      >= the k-th largest logit (ties kept), else 0;
//   2. top-p: keep the smallest set of heaviest tokens whose mass reaches top_p of the total
//      (every token tied with the last one kept);
//   3. min-p: keep w(x) >= min_p_floor(min_p, max w).
// Renormalising is implicit: every later use divides by the returned total.
//   Row::softmax_top_k(node, temperature, top_k) -> double   writes w, returns its total
//   Row::mass_floor(target) -> float    largest t with sum of w over {w >= t} >= target
//   Row::max_weight() -> float          largest w
//   Row::keep_at_least(floor) -> double zero every w < floor, return the new total
template <class Row>
POSS_HD double processed_distribution(Row& row, int32_t node, SamplingParams sp) {
  double total = row.softmax_top_k(node, sp.temperature, sp.top_k);
  if (sp.top_p < 1.0f) total = row.keep_at_least(row.mass_floor(sp.top_p * total));
  if (sp.min_p > 0.0f) total = row.keep_at_least(min_p_floor(sp.min_p, row.max_weight()));
  return total;
}

// The accept test for a deterministic draft child (q(x) = 1): accept x with probability
// p(x) / remaining mass. A zero-mass child (already rejected or outside top-k/top-p) is never
// accepted, even when u = 0.
POSS_HD bool accept_child(float u, double w, double remaining) {
  return w > 0.0 && static_cast<double>(u) * remaining < w;
}

// Greedy: descend to the first child (node order) whose token equals the argmax of the current
// node's row; the argmax at the last accepted node is the next token.
//   Row::argmax(node) -> int64_t (ties to the lowest id)
template <class Row>
POSS_HD void greedy_walk(TreeView t, Row& row, WalkOutput out) {
  int32_t cur = 0, len = 0;
  int64_t best = row.argmax(cur);
  for (int32_t c = first_child(t, cur); c >= 0;) {
    if (t.tokens[c] == best) {
      out.push(++len, c);
      cur = c;
      best = row.argmax(cur);
      c = first_child(t, cur);
    } else {
      c = next_child(t, cur, c);
    }
  }
  out.finish(t.n, len, best);
}

// Sampling (EAGLE / SGLang "target only" rule for deterministic top-k drafts). At each node the
// row policy builds the processed distribution p (processed_distribution, unnormalised); children
// are tried in node order, each with its own uniform u[child]; a rejected child's mass is removed.
// With no child accepted (or at a leaf) the next token is drawn from what remains with u[n].
//   the steps of processed_distribution (above)
//   Row::weight(token) -> double           unnormalised mass of a token
//   Row::remove(token)                     zero a token's mass
//   Row::sample(u) -> int64_t              inverse-CDF draw over what is left; -1 if nothing is
template <class Row>
POSS_HD void sampling_walk(TreeView t, Row& row, const float* u, SamplingParams sp,
                           WalkOutput out) {
  int32_t cur = 0, len = 0;
  int64_t next = -1;
  for (;;) {
    double remaining = processed_distribution(row, cur, sp);
    int32_t accepted = -1;
    int64_t last_rejected = -1;
    for (int32_t c = first_child(t, cur); c >= 0; c = next_child(t, cur, c)) {
      const int64_t x = t.tokens[c];
      const double w = row.weight(x);
      if (accept_child(u[c], w, remaining)) {
        accepted = c;
        break;
      }
      if (w > 0.0) {
        remaining -= w;
        row.remove(x);
        last_rejected = x;
      }
    }
    if (accepted < 0) {
      next = row.sample(u[t.n]);
      // Only rounding can leave no mass after rejections: the last rejected sibling then held
      // all of it, and is the exact answer.
      if (next < 0) next = last_rejected;
      break;
    }
    out.push(++len, accepted);
    cur = accepted;
  }
  out.finish(t.n, len, next);
}

}  // namespace poss
