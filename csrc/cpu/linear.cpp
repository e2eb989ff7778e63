// CPU kernels of poss::linear: out = x @ W^T + bias + residual, for bf16 on CPUs with AVX512-BF16,
// for bf16 on CPUs with only AVX2 + FMA, and for fp32 on AVX2 + FMA (every other dtype or CPU: the
// vendor GEMM).
//
// Why our own GEMM: decoding streams every weight once per token, and at one row (a decode step)
// or a handful (a small draft tree) the vendor GEMM reaches under half the core's read bandwidth.
// The second reason is exactness: the vendor picks a different kernel, and so a different
// summation order, for different row counts, so a token's logits inside a tree verify differ in
// the last bits from a decode step's and greedy paths part at near-ties. Here every output element
// is one fixed sequence, whatever the number of rows, the tile it falls in, or the thread count:
// SIMD lanes accumulate over K in chunks of one vector (the last chunk zero-masked), then one
// horizontal sum in a fixed order, then + bias, + residual, and (bf16) one rounding.
//   bf16 (AVX512-BF16): 16 fp32 lanes, VDPBF16PS over 32 bf16 pairs per step;
//   bf16 (AVX2):          8 fp32 lanes, FMA over 8 bf16 weights widened to fp32 per step;
//   fp32 (AVX2):          8 fp32 lanes, FMA over 8 floats per step.
// The AVX2 bf16 kernel is for CPUs without hardware bf16: a decode step streams half the bytes of
// fp32 and widening a bf16 is exact (a 16-bit shift), so the FMAs are fp32's. x is widened once per
// call (it is M x K, tiny next to the weights), the weights as they stream.
//
// Tiling: threads split the N weight rows in blocks of 64 (a block stays in L2 while every group
// of x rows passes over it); a micro-kernel holds MR x NR accumulators in registers (NR wider for
// one or two x rows, where the weight stream is all there is) and prefetches the weights ahead of
// its stream.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "poss/linear_args.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define POSS_X86_KERNELS 1
#define POSS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define POSS_AVX2FMA __attribute__((target("avx2,fma")))
#endif

namespace poss {
namespace {

constexpr int64_t kRowBlock = 64;  // weight rows per thread work unit

// A micro-kernel's NR weight rows are one contiguous block that it consumes NR vectors per k step.
// Prefetching a fixed distance ahead of that stream, linearly, one line per 64 bytes consumed,
// keeps enough reads in flight: at one x row it streamed 15-30 % faster than prefetching the next
// micro-kernel's rows at the same k (AVX512-BF16 EPYC, one core; 8 KB beat 4, 6, 12 and 16 KB).
// The prefetches are non-temporal (_MM_HINT_NTA): a weight is read once per forward, so its lines
// should not evict what the round reads again, the KV cache, the activations, the draft's weights.
// On the AVX512-BF16 EPYC (one thread, bf16, 16 MT-Bench prompts x 256 tokens, the hint switched in
// one process, four alternations) our AR loop ran at 99.4 tok/s against 89.4 with L2 prefetches
// (_MM_HINT_T1), and PosS-2 at 2/1+6 at 213.7 against 192.6 (medians; every pair 8-12 % apart):
// the draft and commit phases, which run after the weight stream, took 0.25 and 0.1 ms less. fp32
// and the AVX2 bf16 kernel (POSS_LINEAR=avx2) on the same CPU gained 0-6 %. A weight stream alone
// (bench_weight_stream.py) runs about as fast either way. (Into L2 had streamed up to 1.3x faster
// than into L1 at 4-6 x rows.)
constexpr int64_t kPrefetchBytes = 8192;

#ifndef POSS_LINEAR_MAX_ROWS
#define POSS_LINEAR_MAX_ROWS 12
#endif

#ifdef POSS_X86_KERNELS

// Prefetch for the k step that starts at element k of a micro-kernel over NR rows of `w`: the line(s)
// `offset` bytes past what this step reads (a hint: addresses past the weights are harmless), non-temporal.
template <int NR, int kVecBytes, typename T>
inline void prefetch_ahead(const T* w, int64_t k, int64_t offset) {
  const char* p = reinterpret_cast<const char*>(w) + offset + k * static_cast<int64_t>(sizeof(T)) * NR;
#pragma GCC unroll 8
  for (int l = 0; l < NR * kVecBytes / 64; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_NTA);
}

template <typename T>
struct Epilogue {
  const T* bias;      // [N] or null
  const T* residual;  // [M, N] or null
  T* out;             // [M, N]
  int64_t N;

  // The element's fp32 dot product -> + bias, + residual, stored (rounded once for bf16).
  void store(int64_t m, int64_t n, float v) const {
    if (bias) v += static_cast<float>(bias[n]);
    if (residual) v += static_cast<float>(residual[m * N + n]);
    out[m * N + n] = static_cast<T>(v);
  }
};

// ---- bf16 x bf16 -> fp32 lanes (AVX512-BF16) ----

// The 16 lanes summed as a fixed pairwise tree: lane l with l ^ 8, then with l ^ 4, l ^ 2, l ^ 1 (the
// order of _mm512_reduce_add_ps). In registers: a store and scalar adds cost as much as a short
// row's whole k loop. The zero-masked shuffles are the plain ones (all 16 lanes kept) without the
// GCC 12 -Wuninitialized false positive of their unmasked forms.
POSS_AVX512BF16 inline float hsum512(__m512 v) {
  constexpr __mmask16 all = 0xFFFF;
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(all, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(all, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(v);
}

// Eight fp32 lanes -> their bf16 bits in the low 16 bits of each 32-bit lane, rounded as c10 does
// (c10::detail::round_to_nearest_even), bit for bit: NaN -> 0x7FC0, else (bits + 0x7FFF + bit 16) >> 16.
// AVX2 only, so that both kernels' epilogues inline it.
__attribute__((target("avx2"), always_inline)) inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// Tried and not kept (AVX512-BF16 EPYC, one core, 2026-12-04): the horizontal sums of 16 accumulators
// at once, by the same pairwise tree (bit for bit; 15 adds per 16 sums instead of 64). In eight
// alternated runs of bench/bench_weight_stream.py's shapes it streamed no faster at any M from 1 to
// 32. With a weight that stays in L2 this kernel did 27 / 61 / 63 / 68 GMAC/s at M = 1 / 4 / 6 / 12 on a
// slow day of this shared machine, and 41 / 120 / 149 / 157 on a fast one (N 1536, K 576); VDPBF16PS alone
// peaks at 262 GMAC/s there (Zen 5: two a cycle), so streamed from memory the kernel is not bound by it.
// What did pay, on the same CPU: the rounding and storing of the results in vector lanes
// (store_row) instead of element by element, and prefetching into L2 rather than L1. Streamed from
// memory, SmolLM2-sized weights went from 9-10 to 16-20 GB/s at 4-6 rows (1-3 rows: unchanged, 15-19
// GB/s), so a 5-row tree verify costs about one decode step. In L2 the two epilogues run at the same
// speed; what held the stream up is not established.
struct Bf16Avx512 {
  using T = c10::BFloat16;   // the tensors' dtype (weights, bias, residual, out)
  using XT = c10::BFloat16;  // x as the micro-kernel reads it
  // Up to 6 rows: MR x 4 accumulators + MR x vectors + 1 weight vector. 7 to 12 rows: the NR weight
  // vectors stay in registers and each x row is loaded as it is used (9 x 3 + 3 + 1, 12 x 2 + 2 + 1),
  // so a tree of up to 12 rows streams the weights once instead of twice. At 12 rows this ran 5-15 %
  // faster than 8 x 3 then 4 x 4 (two passes) on SmolLM2's matrices, though at 22-24 GB/s against
  // 30-34 up to 8 rows: 12 x loads per k step for 24 multiply-adds (AVX512-BF16 EPYC, 2026-12-04).
  // 9 rows take 9 x 3 (27 accumulators + 3 + 1: 31 of the 32 registers, no spill in the k loop):
  // 32-33 GB/s against 30 with 9 x 2 (bench_weight_stream.py --rows 8 9 10, alternated twice).
  static constexpr int kMaxRows = POSS_LINEAR_MAX_ROWS;
  static constexpr int cols(int rows) { return rows <= 2 ? 8 : rows <= 6 ? 4 : rows <= 9 ? 3 : 2; }
  static constexpr bool kPrefetchNextBlock = false;  // not measured on an AVX512-BF16 CPU yet

  // Rows m0..m0+MR of x against weight rows n..n+NR (x rows have stride K, like the weight rows).
  template <int MR, int NR>
  POSS_AVX512BF16 static void micro(const T* xp, const T* wp, int64_t K, int64_t m0, int64_t n,
                                    const Epilogue<T>& e, int64_t prefetch) {
    const auto* x = reinterpret_cast<const uint16_t*>(xp);
    const auto* w = reinterpret_cast<const uint16_t*>(wp);
    __m512 acc[MR][NR];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    // The two loop orders differ in what stays in registers: the NR weight vectors (7-12 rows, whose
    // x vectors would not fit) or the MR x vectors (up to 6 rows, each weight vector used once).
    if constexpr (MR > 6) {
      for (; k + 32 <= K; k += 32) {
        __m512bh wv[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
        prefetch_ahead<NR, 64>(w, k, prefetch);
#pragma GCC unroll 12
        for (int i = 0; i < MR; ++i) {
          const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
#pragma GCC unroll 8
          for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
      }
    } else {
      for (; k + 32 <= K; k += 32) {
        __m512bh xv[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * K + k);
        prefetch_ahead<NR, 64>(w, k, prefetch);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * K + k);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
        }
      }
    }
    if (k < K) {
      const __mmask32 tail = static_cast<__mmask32>((1ull << (K - k)) - 1);
      __m512bh xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + i * K + k);
      for (int j = 0; j < NR; ++j) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + j * K + k);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
      }
    }
    static_assert(NR <= 8, "store_row writes at most 8 results of a row");
    alignas(32) float sums[MR][NR];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) sums[i][j] = hsum512(acc[i][j]);
    for (int i = 0; i < MR; ++i) store_row(e, m0 + i, n, sums[i], NR);
  }

  // One row's `nr` (<= 8) dot products -> + bias, + residual, rounded once to bf16 and stored: what
  // Epilogue::store does element by element, in 8 lanes. The scalar epilogue (a branchy rounding and
  // a 2-byte store per element) cost as much as the k loop: a 5-row pass over SmolLM2's weights took
  // 1.7x as long as with this one (AVX512-BF16 EPYC, one core).
  POSS_AVX512BF16 static void store_row(const Epilogue<T>& e, int64_t m, int64_t n, const float* s, int nr) {
    const __mmask8 lanes = static_cast<__mmask8>((1u << nr) - 1);
    __m256 v = _mm256_maskz_loadu_ps(lanes, s);
    if (e.bias) v = _mm256_add_ps(v, widen8_masked(lanes, e.bias + n));
    if (e.residual) v = _mm256_add_ps(v, widen8_masked(lanes, e.residual + m * e.N + n));
    _mm_mask_storeu_epi16(e.out + m * e.N + n, lanes, _mm256_cvtepi32_epi16(bf16_bits8(v)));
  }

  // `lanes` of eight bf16 at p, widened exactly to fp32 (the rest zero; masked lanes are never read).
  POSS_AVX512BF16 static __m256 widen8_masked(__mmask8 lanes, const T* p) {
    const __m128i h = _mm_maskz_loadu_epi16(lanes, p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

// ---- fp32 and bf16 weights on AVX2 + FMA: 8 fp32 lanes ----

POSS_AVX2FMA inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The weights as the AVX2 kernel reads them: eight per k step, as eight fp32 lanes.
struct F32Weights {
  using T = float;
  static constexpr int cols(int rows) { return rows <= 2 ? 4 : 2; }
  POSS_AVX2FMA static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
  POSS_AVX2FMA static __m256 load_tail(const T* p, int64_t, __m256i mask) { return _mm256_maskload_ps(p, mask); }
  // The first `lanes` (mask) of 8 results, stored as they are.
  POSS_AVX2FMA static void store(T* p, int64_t, __m256i mask, __m256 v) { _mm256_maskstore_ps(p, mask, v); }
};

// bf16 weights are widened to fp32 as they stream (x was widened once per call).
//
// Tried and not kept (AVX2 EPYC, one core, 2026-12-03): one 32-byte load per row per 16 weights split
// into even and odd elements by a shift and a mask (x packed to match, the AVX512 kernel's pair
// layout) streamed no faster: 13.4 / 11.0 / 6.5 / 3.7 GB/s at M = 1 / 5 / 8 / 16 against this
// kernel's 14.0 / 11.1 / 6.8 / 4.0. Past one row the FMAs and loads bound it, not the widening.

// Eight bf16 -> eight fp32, exactly: the 16 bits become the high half of each lane.
POSS_AVX2FMA inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

struct Bf16Weights {
  using T = c10::BFloat16;
  // One x row: two weight rows streamed 1.05x faster than four, eight 0.65x (AVX2 EPYC, one core).
  static constexpr int cols(int rows) { return rows == 1 ? 2 : rows == 2 ? 4 : 2; }
  POSS_AVX2FMA static __m256 load(const T* p) { return widen8(reinterpret_cast<const uint16_t*>(p)); }
  POSS_AVX2FMA static __m256 load_tail(const T* p, int64_t n, __m256i) {
    alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(uint16_t));
    return widen8(buf);
  }
  // The first n of 8 results, each rounded to bf16 (bf16_bits8).
  POSS_AVX2FMA static void store(T* p, int64_t n, __m256i, __m256 v) {
    const __m256i r = bf16_bits8(v);
    // 8 x 32 -> 8 x 16 bits (every value fits: no saturation), in lane order
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    alignas(16) uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), packed);
    std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(uint16_t));
  }
};

template <typename Weights>
struct Avx2Fma {
  using T = typename Weights::T;
  using XT = float;  // bf16 x is widened once per call: each k step then widens only the weights
  static constexpr int kMaxRows = 6;  // 6 x 2 accumulators + 2 weight vectors + 1 x vector
  static constexpr int cols(int rows) { return Weights::cols(rows); }
  static constexpr bool kPrefetchNextBlock = true;
  // A k step reads NR x 8 weights; NR / 2 lines (NR x 32 bytes) are prefetched every this many steps
  // (bf16: every second step, measured a little faster than NR lines every fourth).
  static constexpr int kPrefetchEvery = 32 / (8 * sizeof(T));

  template <int MR, int NR>
  POSS_AVX2FMA static void micro(const XT* x, const T* w, int64_t K, int64_t m0, int64_t n, const Epilogue<T>& e,
                                 int64_t prefetch) {
    __m256 acc[MR][NR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      // The NR weight vectors stay in registers and each x row is loaded once per k step: 6 x 2
      // accumulators + 2 weights + 1 x fit the 16 registers.
      __m256 wv[NR];
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) wv[j] = Weights::load(w + j * K + k);
      if (kPrefetchEvery == 1 || k % (8 * kPrefetchEvery) == 0) prefetch_ahead<NR, 32>(w, k, prefetch);
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * K + k);
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    if (k < K) {
      alignas(32) int32_t lanes[8];
      for (int l = 0; l < 8; ++l) lanes[l] = k + l < K ? -1 : 0;
      const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
      __m256 xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = _mm256_maskload_ps(x + i * K + k, tail);
      for (int j = 0; j < NR; ++j) {
        const __m256 wv = Weights::load_tail(w + j * K + k, K - k, tail);
        for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
      }
    }
    static_assert(NR <= 8, "store_row writes at most 8 results of a row");
    alignas(32) float sums[MR][8] = {};  // lanes past NR: zeros the stores leave out
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) sums[i][j] = hsum256(acc[i][j]);
    for (int i = 0; i < MR; ++i) store_row(e, m0 + i, n, sums[i], NR);
  }

  // One row's `nr` (<= 8) dot products -> + bias, + residual, stored (bf16: rounded once), in 8 lanes:
  // what Epilogue::store does element by element (as the AVX512-BF16 kernel's store_row).
  POSS_AVX2FMA static void store_row(const Epilogue<T>& e, int64_t m, int64_t n, const float* s, int nr) {
    alignas(32) int32_t lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = l < nr ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    __m256 v = _mm256_load_ps(s);
    if (e.bias) v = _mm256_add_ps(v, Weights::load_tail(e.bias + n, nr, mask));
    if (e.residual) v = _mm256_add_ps(v, Weights::load_tail(e.residual + m * e.N + n, nr, mask));
    Weights::store(e.out + m * e.N + n, nr, mask, v);
  }
};

using F32Avx2 = Avx2Fma<F32Weights>;
using Bf16Avx2 = Avx2Fma<Bf16Weights>;

// ---- the shared driver ----

// MR x rows (from row m0) against weight rows [n0, n1); each micro-kernel prefetches the weights
// `prefetch` bytes past the ones it reads.
template <typename Kern, int MR>
void row_group(const typename Kern::XT* x, const typename Kern::T* w, int64_t K, int64_t m0, int64_t n0,
               int64_t n1, const Epilogue<typename Kern::T>& e, int64_t prefetch) {
  constexpr int NR = Kern::cols(MR);
  const auto* xr = x + m0 * K;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) Kern::template micro<MR, NR>(xr, w + n * K, K, m0, n, e, prefetch);
  for (; n < n1; ++n) Kern::template micro<MR, 1>(xr, w + n * K, K, m0, n, e, prefetch);
}

// The last M % kMaxRows rows, in one pass of the right height.
template <typename Kern, int MR>
void tail_rows(int64_t rows, const typename Kern::XT* x, const typename Kern::T* w, int64_t K, int64_t m0,
               int64_t n0, int64_t n1, const Epilogue<typename Kern::T>& e, int64_t prefetch) {
  if constexpr (MR > 0) {
    if (rows == MR) return row_group<Kern, MR>(x, w, K, m0, n0, n1, e, prefetch);
    tail_rows<Kern, MR - 1>(rows, x, w, K, m0, n0, n1, e, prefetch);
  }
}

// x as the micro-kernel reads it: the rows themselves, or (bf16 on AVX2) widened to fp32 in a buffer
// of this thread's. Through aten (.to(float)), the conversion and its allocation cost ~4 us a call,
// 0.5 ms of a 15 ms decode step. The buffer starts on a cache line, as aten's would: from a
// 16-byte-aligned start, every other 32-byte load of x splits two lines, and a 16-row tree forward
// took 1.2x as long.
template <typename XT, typename T>
const XT* kernel_rows(const T* x, int64_t n) {
  if constexpr (std::is_same_v<XT, T>) {
    return x;
  } else {
    constexpr int64_t kLine = 64 / sizeof(XT);
    thread_local std::vector<XT> buffer;
    buffer.resize(n + kLine);
    const auto offset = reinterpret_cast<uintptr_t>(buffer.data()) % 64 / sizeof(XT);
    XT* widened = buffer.data() + (offset ? kLine - offset : 0);
    at::vec::convert(x, widened, n);
    return widened;
  }
}

template <typename Kern>
at::Tensor linear_kernel(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
  using T = typename Kern::T;
  using XT = typename Kern::XT;
  const int64_t K = x.size(-1), N = weight.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const at::Tensor x2 = x.reshape({linear_rows(x), K}).contiguous();
  const auto w = weight.contiguous();
  const int64_t M = x2.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(out_shape);
  at::Tensor b, r;
  if (bias) b = bias->contiguous();
  if (residual) r = residual->reshape({M, N}).contiguous();
  const Epilogue<T> e{bias ? b.const_data_ptr<T>() : nullptr, residual ? r.const_data_ptr<T>() : nullptr,
                      out.mutable_data_ptr<T>(), N};
  const XT* xp = kernel_rows<XT>(x2.const_data_ptr<T>(), M * K);
  const T* wp = w.const_data_ptr<T>();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // Threads pay once a call does ~0.1 M multiply-adds (a 576 x 576 bf16 weight at one row: ~40 us of
  // streaming). A decode step is all one-row calls, and one core does not reach the memory's
  // bandwidth: at M = 1 on 2 threads the weights stream 1.5x faster than on one (AVX2 EPYC,
  // scripts/step_breakdown.py). The split never changes a result.
  const int64_t grain = M * K * N >= (1 << 17) ? 1 : blocks;
  // The first pass of x rows over a block streams it from memory while the FMA units wait; the
  // later passes find it in L2 while memory waits. With kPrefetchNextBlock the later passes fetch
  // the thread's next block (the same rows, one block on: one line per k step for NR = 2), so a
  // tree's rows cost max(memory, compute) rather than their sum. Prefetches never change a result.
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kRowBlock, n1 = std::min(N, n0 + kRowBlock);
      const int64_t later = Kern::kPrefetchNextBlock && blk + 1 < b1
                                ? kRowBlock * K * static_cast<int64_t>(sizeof(T)) : kPrefetchBytes;
      int64_t m = 0;
      for (; m + Kern::kMaxRows <= M; m += Kern::kMaxRows)
        row_group<Kern, Kern::kMaxRows>(xp, wp, K, m, n0, n1, e, m == 0 ? kPrefetchBytes : later);
      tail_rows<Kern, Kern::kMaxRows - 1>(M - m, xp, wp, K, m, n0, n1, e, m == 0 ? kPrefetchBytes : later);
    }
  });
  return out.view(out_shape);
}

bool cpu_supports(const char* bf16_or_f32) {
  __builtin_cpu_init();
  if (std::strcmp(bf16_or_f32, "avx512-bf16") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#else

bool cpu_supports(const char*) { return false; }

#endif

// POSS_LINEAR (read once): "aten" forces the vendor GEMM, for comparisons; "avx2" the AVX2 kernels
// where AVX512-BF16 would run, so that they are tested and timed on such CPUs too.
bool forced(const char* name) {
  static const char* env = std::getenv("POSS_LINEAR");
  return env != nullptr && std::strcmp(env, name) == 0;
}

bool forced_aten() {
  static const bool aten = forced("aten");
  return aten;
}

bool use_bf16_kernel() {
  static const bool use = !forced_aten() && !forced("avx2") && cpu_supports("avx512-bf16");
  return use;
}

// bf16 on a CPU with AVX2 + FMA but not AVX512-BF16 (or with POSS_LINEAR=avx2).
bool use_bf16_avx2_kernel() {
  static const bool use = !forced_aten() && !use_bf16_kernel() && cpu_supports("f32");
  return use;
}

bool use_f32_kernel() {
  static const bool use = !forced_aten() && cpu_supports("f32");
  return use;
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual) {
  check_linear(x, weight, bias, residual);
#ifdef POSS_X86_KERNELS
  if (x.scalar_type() == at::kBFloat16 && use_bf16_kernel()) return linear_kernel<Bf16Avx512>(x, weight, bias, residual);
  if (x.scalar_type() == at::kBFloat16 && use_bf16_avx2_kernel())
    return linear_kernel<Bf16Avx2>(x, weight, bias, residual);
  if (x.scalar_type() == at::kFloat && use_f32_kernel()) return linear_kernel<F32Avx2>(x, weight, bias, residual);
#endif
  return linear_aten(x, weight, bias, residual);
}

}  // namespace

const char* cpu_linear_kernel(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return use_bf16_kernel() ? "avx512-bf16" : use_bf16_avx2_kernel() ? "avx2-bf16" : "aten";
  if (dtype == at::kFloat) return use_f32_kernel() ? "avx2-fma" : "aten";
  return "aten";
}

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace poss
