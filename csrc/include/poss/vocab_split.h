// The vocabulary split of tree_verify, written once for the CPU and the CUDA kernels.
//
// Every vocabulary-wide step of the acceptance walk (acceptance.h: the argmax, the row maximum, the
// top-k and top-p thresholds, the sums, the inverse-CDF draw) runs as two passes:
//   1. each chunk of V (VocabChunks) computes a partial result over its own elements: a maximum, an
//      argmax, a sum, or a 256-bin radix histogram (count or mass);
//   2. a small combine reads the C partials in chunk order and gives every worker the same answer.
// The CPU kernel runs the chunks one after the other or with at::parallel_for; the CUDA kernel runs
// one thread block per (request, chunk) and combines after a barrier among the request's blocks.
// Chunking never changes which tokens are kept or drawn beyond floating-point rounding of the mass
// sums (the order of the additions): maxima, argmaxes and counts are exact in any order, and the
// thresholds are exact order statistics (RadixSelect). The combine rules live here so both devices
// take the same one.
#pragma once

#include <cmath>
#include <cstdint>

#include "poss/macros.h"
#include "poss/selection.h"

namespace poss {

// Why 4096: a CUDA block of 512 threads then reads 8 elements per pass, enough work to cover the
// barrier that follows, and V = 128,256 (Llama-3) splits into 32 chunks. Why at most 64: every
// worker reads all C partials in the combine (64 x 256 histogram bins at most per radix round), and
// beyond ~64 blocks per row a 1-request batch already spreads over half an H100/H200's SMs.
constexpr int64_t kVocabChunkLen = 4096;
constexpr int32_t kMaxVocabChunks = 64;

// Radix selection: 4 rounds of 8 bits over the 32-bit ordered keys (selection.h).
constexpr int kRadixBits = 8;
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kRadixRounds = 32 / kRadixBits;

// Chunk c covers tokens [lo(c), hi(c)); every chunk but the last holds `len` tokens, none is empty.
struct VocabChunks {
  int64_t V;
  int64_t len;
  int32_t count;

  POSS_HD int64_t lo(int32_t c) const { return static_cast<int64_t>(c) * len; }
  POSS_HD int64_t hi(int32_t c) const {
    const int64_t h = (static_cast<int64_t>(c) + 1) * len;
    return h < V ? h : V;
  }
};

// The split of a row of V tokens. chunk_len > 0 forces a chunk length (tests; see
// poss_ext.ops.force_vocab_chunk_len), 0 takes kVocabChunkLen. The count is then bounded by
// kMaxVocabChunks and by max_chunks (on CUDA: the blocks that can be resident at once, divided by
// the batch), growing the chunks to cover V.
inline VocabChunks plan_vocab_chunks(int64_t V, int64_t chunk_len, int64_t max_chunks) {
  int64_t len = chunk_len > 0 ? chunk_len : kVocabChunkLen;
  if (V < 1) return {V, 1, 0};
  int64_t bound = max_chunks < kMaxVocabChunks ? max_chunks : kMaxVocabChunks;
  if (bound < 1) bound = 1;
  int64_t count = (V + len - 1) / len;
  if (count > bound) {
    len = (V + bound - 1) / bound;
    count = (V + len - 1) / len;
  }
  return {V, len, static_cast<int32_t>(count)};
}

// ---- Partial results and their combines -------------------------------------------------------

// Greedy: the largest logit, ties to the lowest id. index -1 = nothing seen.
struct ArgMaxPartial {
  float value;
  int64_t index;
};

POSS_HD ArgMaxPartial better_argmax(ArgMaxPartial a, ArgMaxPartial b) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  if (a.value > b.value || (a.value == b.value && a.index < b.index)) return a;
  return b;
}

// Sums combine in chunk order, in double, so every worker gets the same bits.
POSS_HD double combine_sums(const double* sums, int32_t count) {
  double total = 0.0;
  for (int32_t c = 0; c < count; ++c) total += sums[c];
  return total;
}

// Finds the largest key t with weight({x : key(x) >= t}) >= target over the whole row, where the
// weight counts tokens (top-k, target = k) or sums their mass (top-p, target = top_p * total).
// Each round the chunks histogram the keys that share the decided prefix by their next 8 bits; the
// combined histogram (the sum of the chunks' histograms) picks the bin where the weight from the top
// reaches the target. After 4 rounds the key is decided, and it is an element's key: the k-th
// largest logit, or the lightest token of the smallest heaviest set reaching the mass.
struct RadixSelect {
  double target;
  uint32_t prefix = 0;  // the decided high bits of t
  int round = 0;        // 8 * round bits are decided
  double above = 0.0;   // weight of the elements whose keys lie above the decided prefix
  bool reached = true;  // false: the whole row weighs less than the target

  POSS_HD explicit RadixSelect(double target_) : target(target_) {}

  POSS_HD bool done() const { return round == kRadixRounds || !reached; }
  // Whether a key shares the decided prefix (every key does in round 0).
  POSS_HD bool matches(uint32_t key) const {
    if (round == 0) return true;
    const int shift = 32 - kRadixBits * round;
    return (key >> shift) == (prefix >> shift);
  }
  POSS_HD int bin(uint32_t key) const {
    return static_cast<int>((key >> (32 - kRadixBits * (round + 1))) & (kRadixBins - 1));
  }
  // hist[kRadixBins]: the combined weight per bin of the matching keys.
  POSS_HD void advance(const double* hist) {
    int b = kRadixBins - 1;
    for (; b >= 0; --b) {
      if (above + hist[b] >= target) break;
      above += hist[b];
    }
    if (b < 0) {
      reached = false;
      return;
    }
    prefix |= static_cast<uint32_t>(b) << (32 - kRadixBits * (round + 1));
    ++round;
  }
  // The threshold as a float; -inf (keep everything) when the target was not reached.
  POSS_HD float threshold() const { return reached ? key_to_float(prefix) : -INFINITY; }
};

// The draw's chunk: the first chunk whose running mass passes target (= u * total), and the mass
// before it (*before). Rounding can leave the target past every chunk: then the last chunk with
// mass. -1 when no chunk has mass.
POSS_HD int32_t draw_chunk(const double* sums, int32_t count, double target, double* before) {
  double cum = 0.0;
  int32_t last = -1;
  double last_before = 0.0;
  for (int32_t c = 0; c < count; ++c) {
    if (!(sums[c] > 0.0)) continue;
    if (cum + sums[c] > target) {
      *before = cum;
      return c;
    }
    last = c;
    last_before = cum;
    cum += sums[c];
  }
  *before = last_before;
  return last;
}

// A forced chunk length for tree_verify on every device (0 = by shape); tests split small
// vocabularies with it. Defined in csrc/cpu/tree_verify.cpp.
int64_t forced_vocab_chunk_len();
void force_vocab_chunk_len(int64_t len);

}  // namespace poss
