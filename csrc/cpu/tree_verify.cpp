// CPU kernel of poss::tree_verify: parallel over requests, vectorised scans over the vocabulary.
// Only the rows on the walked path are read; no probability tensor is materialised.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "poss/acceptance.h"
#include "poss/selection.h"
#include "poss/tree.h"
#include "poss/tree_checks.h"
#include "poss/tree_verify_args.h"

namespace poss {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 256;  // elements per partial sum; partial sums accumulate in double

// A row of logits as float: the row itself for fp32, else converted into `buf`.
template <typename scalar_t>
const float* row_as_float(const scalar_t* src, int64_t V, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    at::vec::convert(src, buf, V);
    return buf;
  }
}

float row_max(const float* x, int64_t V) {
  return at::vec::reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, V);
}

// First index holding `value` (the lowest id among ties).
int64_t first_index_of(const float* x, int64_t V, float value) {
  const Vec target(value);
  const int full = (1 << Vec::size()) - 1;
  int64_t i = 0;
  for (; i + Vec::size() <= V; i += Vec::size()) {
    const int differs = (Vec::loadu(x + i) == target).zero_mask();
    if (differs != full) return i + __builtin_ctz(~differs & full);
  }
  for (; i < V; ++i) {
    if (x[i] == value) return i;
  }
  return -1;
}

// Largest t among x[0..n) with weight({x >= t}) >= target, where weight counts elements
// (kMass = false) or sums them (kMass = true, x >= 0). A 12-bit radix histogram finds the bin
// that crosses the target; only that bin is sorted. Returns -inf when the target is not reached.
template <bool kMass>
float select_threshold(const float* x, int64_t n, double target, std::vector<float>& bin_vals) {
  constexpr int kBits = 12, kShift = 32 - kBits, kBins = 1 << kBits;
  std::vector<double> hist(kBins, 0.0);
  for (int64_t i = 0; i < n; ++i) hist[ordered_key(x[i]) >> kShift] += kMass ? x[i] : 1.0;
  double above = 0.0;
  int bin = kBins - 1;
  for (; bin >= 0; --bin) {
    if (above + hist[bin] >= target) break;
    above += hist[bin];
  }
  if (bin < 0) return -std::numeric_limits<float>::infinity();
  bin_vals.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<int>(ordered_key(x[i]) >> kShift) == bin) bin_vals.push_back(x[i]);
  }
  std::sort(bin_vals.begin(), bin_vals.end(), std::greater<float>());
  for (float v : bin_vals) {
    above += kMass ? v : 1.0;
    if (above >= target) return v;
  }
  return bin_vals.back();
}

double block_sums(const float* w, int64_t V, std::vector<double>& sums) {
  sums.resize((V + kBlock - 1) / kBlock);
  double total = 0.0;
  for (size_t blk = 0; blk < sums.size(); ++blk) {
    const int64_t lo = blk * kBlock, len = std::min<int64_t>(kBlock, V - lo);
    sums[blk] = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, w + lo, len);
    total += sums[blk];
  }
  return total;
}

template <typename scalar_t>
struct CpuGreedyRow {
  const scalar_t* logits;  // [N, V] rows of one request
  int64_t V;
  int64_t request;
  float* buf;  // [V] scratch for non-fp32 rows

  int64_t argmax(int32_t node) {
    const float* x = row_as_float(logits + node * V, V, buf);
    const float m = row_max(x, V);
    TORCH_CHECK(!std::isnan(m), "tree_verify: logits[", request, ", ", node, "] contains NaN");
    return first_index_of(x, V, m);
  }
};

template <typename scalar_t>
struct CpuSamplingRow {
  const scalar_t* logits;  // [N, V]
  int64_t V;
  int64_t request;
  float* w;  // [V] processed, unnormalised target distribution of the current node
  std::vector<float>& bin_vals;
  std::vector<double>& sums;

  double softmax_top_k(int32_t node, float temperature, int32_t top_k) {
    const float* x = row_as_float(logits + node * V, V, w);
    const float m = row_max(x, V);
    TORCH_CHECK(std::isfinite(m), "tree_verify: logits[", request, ", ", node, "] ",
                std::isnan(m) ? "contains NaN" : "has no finite maximum",
                "; cannot form a sampling distribution");
    float keep_from = -std::numeric_limits<float>::infinity();
    if (top_k > 0 && top_k < V) keep_from = select_threshold<false>(x, V, top_k, bin_vals);
    const Vec vm(m), vscale(1.0f / temperature), vfloor(keep_from), zero(0.0f);
    int64_t i = 0;
    for (; i + Vec::size() <= V; i += Vec::size()) {
      const Vec xv = Vec::loadu(x + i);
      const Vec e = ((xv - vm) * vscale).exp();
      Vec::blendv(zero, e, xv >= vfloor).store(w + i);
    }
    for (; i < V; ++i) w[i] = x[i] >= keep_from ? std::exp((x[i] - m) / temperature) : 0.0f;
    return block_sums(w, V, sums);
  }

  float mass_floor(double target) { return select_threshold<true>(w, V, target, bin_vals); }

  float max_weight() const { return row_max(w, V); }

  double keep_at_least(float floor) {
    const Vec vfloor(floor), zero(0.0f);
    int64_t i = 0;
    for (; i + Vec::size() <= V; i += Vec::size()) {
      const Vec wv = Vec::loadu(w + i);
      Vec::blendv(zero, wv, wv >= vfloor).store(w + i);
    }
    for (; i < V; ++i) w[i] = w[i] >= floor ? w[i] : 0.0f;
    return block_sums(w, V, sums);
  }

  double weight(int64_t token) const { return w[token]; }
  void remove(int64_t token) { w[token] = 0.0f; }

  int64_t sample(float u) {
    const double total = block_sums(w, V, sums);
    if (!(total > 0.0)) return -1;
    const double target = static_cast<double>(u) * total;
    double cum = 0.0;
    int64_t last_positive = -1;
    for (size_t blk = 0; blk < sums.size(); ++blk) {
      if (cum + sums[blk] <= target && blk + 1 < sums.size()) {
        cum += sums[blk];
        continue;
      }
      const int64_t lo = blk * kBlock, hi = std::min<int64_t>(lo + kBlock, V);
      for (int64_t x = lo; x < hi; ++x) {
        if (w[x] <= 0.0f) continue;
        cum += w[x];
        last_positive = x;
        if (cum > target) return x;
      }
    }
    return last_positive;  // rounding left the target at the very end of the mass
  }
};

void check_values(const at::Tensor& parents, const at::Tensor& tokens, int64_t V,
                  const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                  const at::Tensor& min_p, const std::optional<at::Tensor>& uniforms,
                  bool sampling) {
  const int64_t B = parents.size(0), N = parents.size(1);
  const auto* par = parents.data_ptr<int32_t>();
  const auto* tok = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const TreeView tree{par + b * N, tok + b * N, static_cast<int32_t>(N)};
    check_tree_scan(validate_tree(tree, V), b, tree.parents, tree.tokens, V);
  }
  const auto* t = temperature.data_ptr<float>();
  const auto* k = top_k.data_ptr<int32_t>();
  const auto* p = top_p.data_ptr<float>();
  const auto* mp = min_p.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(std::isfinite(t[b]) && t[b] >= 0.0f, "temperature[", b, "] = ", t[b],
                " must be finite and >= 0 (0 = greedy)");
    TORCH_CHECK(k[b] >= 0, "top_k[", b, "] = ", k[b], " must be >= 0 (0 = off)");
    TORCH_CHECK(p[b] > 0.0f && p[b] <= 1.0f, "top_p[", b, "] = ", p[b],
                " must be in (0, 1] (1 = off)");
    TORCH_CHECK(mp[b] >= 0.0f && mp[b] <= 1.0f, "min_p[", b, "] = ", mp[b],
                " must be in [0, 1] (0 = off)");
  }
  if (sampling) {
    const auto* u = uniforms->data_ptr<float>();
    for (int64_t i = 0; i < uniforms->numel(); ++i) {
      TORCH_CHECK(u[i] >= 0.0f && u[i] < 1.0f, "uniforms[", i / (N + 1), ", ", i % (N + 1),
                  "] = ", u[i], " must be in [0, 1)");
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_cpu(
    const at::Tensor& parents_in, const at::Tensor& tokens_in, const at::Tensor& logits_in,
    const std::optional<at::Tensor>& temperature_in, const std::optional<at::Tensor>& top_k_in,
    const std::optional<at::Tensor>& top_p_in, const std::optional<at::Tensor>& uniforms_in,
    const std::optional<at::Tensor>& min_p_in) {
  const auto [B, N, V] = check_tree_verify_args(parents_in, tokens_in, logits_in, temperature_in,
                                                top_k_in, top_p_in, uniforms_in, min_p_in);
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous(),
                   logits = logits_in.contiguous();
  const auto opts = parents.options();
  const at::Tensor temperature =
      temperature_in ? temperature_in->contiguous() : at::zeros({B}, opts.dtype(at::kFloat));
  const at::Tensor top_k = top_k_in ? top_k_in->contiguous() : at::zeros({B}, opts);
  const at::Tensor top_p =
      top_p_in ? top_p_in->contiguous() : at::ones({B}, opts.dtype(at::kFloat));
  const at::Tensor min_p =
      min_p_in ? min_p_in->contiguous() : at::zeros({B}, opts.dtype(at::kFloat));
  std::optional<at::Tensor> uniforms;
  if (uniforms_in) uniforms = uniforms_in->contiguous();
  const bool sampling = uniforms.has_value();
  check_values(parents, tokens, V, temperature, top_k, top_p, min_p, uniforms, sampling);

  at::Tensor accept_nodes = at::empty({B, N}, opts);
  at::Tensor accept_len = at::empty({B}, opts);
  at::Tensor next_token = at::empty({B}, opts.dtype(at::kLong));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "tree_verify_cpu",
                                  [&] {
    const auto* lg = logits.data_ptr<scalar_t>();
    const auto* par = parents.data_ptr<int32_t>();
    const auto* tok = tokens.data_ptr<int64_t>();
    const auto* temp = temperature.data_ptr<float>();
    const auto* tk = top_k.data_ptr<int32_t>();
    const auto* tp = top_p.data_ptr<float>();
    const auto* mp = min_p.data_ptr<float>();
    const float* u = sampling ? uniforms->data_ptr<float>() : nullptr;
    auto* out_nodes = accept_nodes.data_ptr<int32_t>();
    auto* out_len = accept_len.data_ptr<int32_t>();
    auto* out_next = next_token.data_ptr<int64_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(V);
      std::vector<float> bin_vals;
      std::vector<double> sums;
      for (int64_t b = begin; b < end; ++b) {
        const TreeView tree{par + b * N, tok + b * N, static_cast<int32_t>(N)};
        const WalkOutput out{out_nodes + b * N, out_len + b, out_next + b, true};
        const scalar_t* rows = lg + b * N * V;
        if (is_greedy(temp[b])) {
          CpuGreedyRow<scalar_t> row{rows, V, b, scratch.data()};
          greedy_walk(tree, row, out);
        } else {
          CpuSamplingRow<scalar_t> row{rows, V, b, scratch.data(), bin_vals, sums};
          const SamplingParams sp{temp[b], tk[b], tp[b], mp[b]};
          sampling_walk(tree, row, u + b * (N + 1), sp, out);
        }
      }
    });
  });
  return {accept_nodes, accept_len, next_token};
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("tree_verify", &tree_verify_cpu); }

}  // namespace poss
