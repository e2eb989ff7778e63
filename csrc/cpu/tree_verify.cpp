// CPU kernel of poss::tree_verify: parallel over requests; each row is split into vocabulary chunks
// (poss/vocab_split.h) processed in parallel and combined in chunk order, vectorised within a chunk.
// Only the rows on the walked path are read; no probability tensor is materialised.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "poss/acceptance.h"
#include "poss/selection.h"
#include "poss/tree.h"
#include "poss/tree_checks.h"
#include "poss/tree_verify_args.h"
#include "poss/vocab_split.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace poss {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 256;  // elements per float partial sum inside a chunk; chunk sums are double

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

// The sum of w[0..n): float sums of kBlock elements, accumulated in double.
double chunk_sum(const float* w, int64_t n) {
  double total = 0.0;
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, n - lo);
    total += at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, w + lo, len);
  }
  return total;
}

// Runs f(c, lo, hi) for every chunk. Chunks may run in parallel (each writes only its own partial
// slot), and the combines read the slots in chunk order, so the bits do not depend on threads.
template <class F>
void for_each_chunk(const VocabChunks& chunks, F f) {
  at::parallel_for(0, chunks.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      f(static_cast<int32_t>(c), chunks.lo(static_cast<int32_t>(c)), chunks.hi(static_cast<int32_t>(c)));
    }
  });
}

// Scratch of the split radix selection, reused across rows.
struct SelectScratch {
  std::vector<double> hists;  // [C * kRadixBins] the chunks' histograms
  std::vector<float> cand;    // [V] chunk c's candidates from round 1 on, at [lo(c), lo(c) + n[c])
  std::vector<int64_t> n;     // [C]
};

// Why the histograms may be summed in any order and still give the same bits: the elements of one
// round-0 bin share the sign and the top 7 exponent bits, so every one is a multiple of the bin's
// unit 2^(2k - 150) below 2^25 units (later rounds' bins are narrower still). A bin's sum over n
// elements stays below 2^25 * n units, exactly representable in a double (or an int64) while
// n < 2^28: then every order of the additions gives the exact sum, and round 0 may count in
// integers. (Larger chunks take the double path, whose order is the one every chunking used.)
constexpr int64_t kExactChunkMax = int64_t{1} << 28;

// Round 0 of the mass selection over x[lo..hi), every x a finite float >= +0: the exact sum of each
// top-byte bin, as int64 multiples of the bin's unit (four interleaved accumulators, so that runs
// of one bin do not chain every addition on the previous one). Returns false, leaving h untouched,
// when an element is negative, infinite or NaN (the caller then sums in double).
bool mass_round0_exact(const float* x, int64_t lo, int64_t hi, double* h) {
  constexpr int kLanes = 4;
  int64_t acc[kLanes][kRadixBins / 2] = {};  // bins 0x80..0xff: the non-negative floats
  uint32_t largest = 0;                      // largest bit pattern: >= 0x7f800000 = not finite or < 0
  auto add = [&](int64_t* a, uint32_t bits) {
    const uint32_t e = (bits >> 23) & 0xffu;
    // A subnormal (e = 0) has no implicit bit and the unit of e = 1.
    const uint64_t mant = (bits & 0x7fffffu) | (e ? 0x800000u : 0u);
    const uint32_t shift = e ? (e & 1u) : 1u;  // the bin covers exponents 2k and 2k + 1
    a[(bits >> 24) & 0x7fu] += static_cast<int64_t>(mant << shift);
    largest = std::max(largest, bits);
  };
  int64_t i = lo;
  for (; i + kLanes <= hi; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      uint32_t bits;
      std::memcpy(&bits, x + i + l, sizeof(bits));
      add(acc[l], bits);
    }
  }
  for (; i < hi; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    add(acc[0], bits);
  }
  if (largest >= 0x7f800000u) return false;
  std::fill(h, h + kRadixBins / 2, 0.0);  // negative floats: none
  for (int k = 0; k < kRadixBins / 2; ++k) {
    const int64_t units = (acc[0][k] + acc[1][k]) + (acc[2][k] + acc[3][k]);
    h[kRadixBins / 2 + k] = std::ldexp(static_cast<double>(units), 2 * k - 150);
  }
  return true;
}

// Round 0 in double, for any floats (counts, or masses the exact path refused).
template <bool kMass>
void round0_double(const float* x, int64_t lo, int64_t hi, double* h) {
  constexpr int kLanes = 4;
  double lanes[kLanes][kRadixBins] = {};
  int64_t i = lo;
  for (; i + kLanes <= hi; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lanes[l][ordered_key(x[i + l]) >> (32 - kRadixBits)] += kMass ? x[i + l] : 1.0;
    }
  }
  for (; i < hi; ++i) lanes[0][ordered_key(x[i]) >> (32 - kRadixBits)] += kMass ? x[i] : 1.0;
  for (int b = 0; b < kRadixBins; ++b) h[b] = (lanes[0][b] + lanes[1][b]) + (lanes[2][b] + lanes[3][b]);
}

// Copies the elements of src[0..n) whose keys share the top `bits` bits of `prefix` to dst, in
// order, and returns how many. dst may be src (dst never passes the element being read).
int64_t keep_matching(const float* src, int64_t n, uint32_t prefix, int bits, float* dst) {
  const int shift = 32 - bits;
  const uint32_t want = prefix >> shift;
  int64_t kept = 0, i = 0;
#if defined(__AVX2__)
  // Eight keys at a time (ordered_key in lanes); the rare matches leave through the mask.
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i vwant = _mm256_set1_epi32(static_cast<int>(want));
  const __m128i vshift = _mm_cvtsi32_si128(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i key = _mm256_xor_si256(raw, _mm256_or_si256(_mm256_srai_epi32(raw, 31), sign));
    const __m256i eq = _mm256_cmpeq_epi32(_mm256_srl_epi32(key, vshift), vwant);
    for (unsigned mask = _mm256_movemask_ps(_mm256_castsi256_ps(eq)); mask; mask &= mask - 1) {
      dst[kept++] = src[i + __builtin_ctz(mask)];
    }
  }
#endif
  for (; i < n; ++i) {
    if ((ordered_key(src[i]) >> shift) == want) dst[kept++] = src[i];
  }
  return kept;
}

// The split radix selection (RadixSelect) over x[0..V): count (kMass = false) or mass weights.
// Round 0 histograms the chunk (in integers where that is exact); round 1 keeps the chunk's
// elements that share the prefix as candidates, and every later round filters those. The bin sums
// and the candidates' histograms add in the chunk's order, so the bits are the ones of the plain
// sequential rounds.
template <bool kMass>
float select_threshold(const VocabChunks& chunks, const float* x, double target, SelectScratch& s) {
  s.hists.assign(static_cast<size_t>(chunks.count) * kRadixBins, 0.0);
  s.cand.resize(chunks.V);
  s.n.assign(chunks.count, 0);
  RadixSelect sel(target);
  double combined[kRadixBins];
  while (!sel.done()) {
    for_each_chunk(chunks, [&](int32_t c, int64_t lo, int64_t hi) {
      double* h = s.hists.data() + static_cast<size_t>(c) * kRadixBins;
      if (sel.round == 0) {
        if (!kMass || hi - lo >= kExactChunkMax || !mass_round0_exact(x, lo, hi, h)) round0_double<kMass>(x, lo, hi, h);
        return;
      }
      // Round 1 reads the chunk, later rounds the candidates; either way the matches are kept.
      const float* src = sel.round == 1 ? x + lo : s.cand.data() + lo;
      const int64_t n = sel.round == 1 ? hi - lo : s.n[c];
      float* keep = s.cand.data() + lo;
      const int64_t kept = keep_matching(src, n, sel.prefix, kRadixBits * sel.round, keep);
      std::fill(h, h + kRadixBins, 0.0);
      for (int64_t i = 0; i < kept; ++i) h[sel.bin(ordered_key(keep[i]))] += kMass ? keep[i] : 1.0;
      s.n[c] = kept;
    });
    for (int b = 0; b < kRadixBins; ++b) {
      double sum = 0.0;
      for (int32_t c = 0; c < chunks.count; ++c) sum += s.hists[static_cast<size_t>(c) * kRadixBins + b];
      combined[b] = sum;
    }
    sel.advance(combined);
  }
  return sel.threshold();
}

template <typename scalar_t>
struct CpuGreedyRow {
  const scalar_t* logits;  // [N, V] rows of one request
  int64_t V;
  int64_t request;
  VocabChunks chunks;
  float* buf;                         // [V] scratch for non-fp32 rows
  std::vector<ArgMaxPartial>& parts;  // [C]

  int64_t argmax(int32_t node) {
    parts.resize(chunks.count);
    for_each_chunk(chunks, [&](int32_t c, int64_t lo, int64_t hi) {
      const float* x = row_as_float(logits + node * V + lo, hi - lo, buf + lo);
      const float m = row_max(x, hi - lo);
      // index -2 marks a chunk holding NaN.
      parts[c] = std::isnan(m) ? ArgMaxPartial{m, -2}
                               : ArgMaxPartial{m, lo + first_index_of(x, hi - lo, m)};
    });
    ArgMaxPartial best{0.0f, -1};
    for (int32_t c = 0; c < chunks.count; ++c) {
      TORCH_CHECK(parts[c].index != -2, "tree_verify: logits[", request, ", ", node, "] contains NaN");
      best = better_argmax(best, parts[c]);
    }
    return best.index;
  }
};

template <typename scalar_t>
struct CpuSamplingRow {
  const scalar_t* logits;  // [N, V]
  int64_t V;
  int64_t request;
  VocabChunks chunks;
  float* w;                    // [V] processed, unnormalised target distribution of the current node
  SelectScratch& select;       // radix selection scratch
  std::vector<double>& sums;   // [C] partial sums
  std::vector<float>& maxes;   // [C] partial maxima

  // Per-chunk sums of w into `sums`, combined in chunk order.
  double total() {
    sums.resize(chunks.count);
    for_each_chunk(chunks, [&](int32_t c, int64_t lo, int64_t hi) { sums[c] = chunk_sum(w + lo, hi - lo); });
    return combine_sums(sums.data(), chunks.count);
  }

  // Largest element of x[0..V); NaN when any element is NaN.
  float split_max(const float* x) {
    maxes.resize(chunks.count);
    for_each_chunk(chunks, [&](int32_t c, int64_t lo, int64_t hi) { maxes[c] = row_max(x + lo, hi - lo); });
    float m = maxes[0];
    for (int32_t c = 1; c < chunks.count; ++c) {
      m = (std::isnan(m) || std::isnan(maxes[c])) ? std::numeric_limits<float>::quiet_NaN()
                                                  : std::max(m, maxes[c]);
    }
    return m;
  }

  double softmax_top_k(int32_t node, float temperature, int32_t top_k) {
    const scalar_t* src = logits + node * V;
    const float* x = w;  // fp32 rows are read in place; the others are converted into w
    if constexpr (std::is_same_v<scalar_t, float>) {
      x = src;
    } else {
      for_each_chunk(chunks, [&](int32_t, int64_t lo, int64_t hi) { at::vec::convert(src + lo, w + lo, hi - lo); });
    }
    const float m = split_max(x);
    TORCH_CHECK(std::isfinite(m), "tree_verify: logits[", request, ", ", node, "] ",
                std::isnan(m) ? "contains NaN" : "has no finite maximum",
                "; cannot form a sampling distribution");
    float keep_from = -std::numeric_limits<float>::infinity();
    if (top_k > 0 && top_k < V) keep_from = select_threshold<false>(chunks, x, top_k, select);
    const Vec vm(m), vscale(1.0f / temperature), vfloor(keep_from), zero(0.0f);
    for_each_chunk(chunks, [&](int32_t, int64_t lo, int64_t hi) {
      int64_t i = lo;
      for (; i + Vec::size() <= hi; i += Vec::size()) {
        const Vec xv = Vec::loadu(x + i);
        const Vec e = ((xv - vm) * vscale).exp();
        Vec::blendv(zero, e, xv >= vfloor).store(w + i);
      }
      for (; i < hi; ++i) w[i] = x[i] >= keep_from ? std::exp((x[i] - m) / temperature) : 0.0f;
    });
    return total();
  }

  float mass_floor(double target) { return select_threshold<true>(chunks, w, target, select); }

  float max_weight() { return split_max(w); }

  double keep_at_least(float floor) {
    const Vec vfloor(floor), zero(0.0f);
    for_each_chunk(chunks, [&](int32_t, int64_t lo, int64_t hi) {
      int64_t i = lo;
      for (; i + Vec::size() <= hi; i += Vec::size()) {
        const Vec wv = Vec::loadu(w + i);
        Vec::blendv(zero, wv, wv >= vfloor).store(w + i);
      }
      for (; i < hi; ++i) w[i] = w[i] >= floor ? w[i] : 0.0f;
    });
    return total();
  }

  double weight(int64_t token) const { return w[token]; }
  void remove(int64_t token) { w[token] = 0.0f; }

  // Inverse CDF in two passes: the chunk sums pick the chunk (draw_chunk), a scan of that chunk
  // picks the token.
  int64_t sample(float u) {
    const double mass = total();
    if (!(mass > 0.0)) return -1;
    const double target = static_cast<double>(u) * mass;
    double cum = 0.0;
    const int32_t c = draw_chunk(sums.data(), chunks.count, target, &cum);
    if (c < 0) return -1;
    int64_t last_positive = -1;
    for (int64_t x = chunks.lo(c); x < chunks.hi(c); ++x) {
      if (w[x] <= 0.0f) continue;
      cum += w[x];
      last_positive = x;
      if (cum > target) return x;
    }
    return last_positive;  // rounding left the target at the very end of the chunk's mass
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
    // Chunks by shape only (not by thread count), so the bits do not depend on the machine.
    const VocabChunks chunks = plan_vocab_chunks(V, forced_vocab_chunk_len(), kMaxVocabChunks);
    auto walk = [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(V);
      SelectScratch select;
      std::vector<double> sums;
      std::vector<float> maxes;
      std::vector<ArgMaxPartial> argmaxes;
      for (int64_t b = begin; b < end; ++b) {
        const TreeView tree{par + b * N, tok + b * N, static_cast<int32_t>(N)};
        const WalkOutput out{out_nodes + b * N, out_len + b, out_next + b, true};
        const scalar_t* rows = lg + b * N * V;
        if (is_greedy(temp[b])) {
          CpuGreedyRow<scalar_t> row{rows, V, b, chunks, scratch.data(), argmaxes};
          greedy_walk(tree, row, out);
        } else {
          CpuSamplingRow<scalar_t> row{rows, V, b, chunks, scratch.data(), select, sums, maxes};
          const SamplingParams sp{temp[b], tk[b], tp[b], mp[b]};
          sampling_walk(tree, row, u + b * (N + 1), sp, out);
        }
      }
    };
    // Fewer requests than threads: one request at a time, its chunks in parallel (for_each_chunk).
    // Otherwise the requests in parallel, and each request's chunks inline in its thread (ATen runs
    // a parallel_for nested in another inline).
    if (B < at::get_num_threads()) {
      walk(0, B);
    } else {
      at::parallel_for(0, B, 1, walk);
    }
  });
  return {accept_nodes, accept_len, next_token};
}

}  // namespace

namespace {
std::atomic<int64_t> forced_chunk_len{0};
}  // namespace

int64_t forced_vocab_chunk_len() { return forced_chunk_len.load(std::memory_order_relaxed); }

void force_vocab_chunk_len(int64_t len) {
  TORCH_CHECK(len >= 0, "force_vocab_chunk_len: len must be >= 0 (0 = by shape), got ", len);
  forced_chunk_len.store(len, std::memory_order_relaxed);
}

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("tree_verify", &tree_verify_cpu); }

}  // namespace poss
