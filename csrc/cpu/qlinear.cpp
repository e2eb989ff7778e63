// CPU kernels of poss::qlinear: out = x @ W^T + bias + residual with W in a GGUF block format (q8_0,
// q4_0, q4_1; csrc/include/poss/qlinear_args.h), x in fp32, bf16 or fp16, accumulated in fp32.
//
// Why: a decode step streams every weight once, so its time is the weight bytes over the read
// bandwidth; a 4-bit block is 18-20 bytes per 32 weights against bf16's 64, and the shipped targets
// are GGUF files in these formats. The weights are read as the file stores them.
//
// Every output element is one fixed sequence of fp32 operations, whatever the number of rows in the
// call, the tile it falls in, the thread count, or the kernel (AVX512, AVX2, scalar: the same bits):
//   - each block's 32 weights are decoded to fp32 exactly (q * d, (q - 8) * d; q4_1: fma(q, d, m));
//   - 32 lanes, lane l accumulating fma(x[32 b + l], w[32 b + l], acc_l) over the blocks b in order;
//   - the lanes summed as a fixed pairwise tree: l with l + 16, then l + 8, l + 4, l + 2, l + 1;
//   - + bias, + residual, one rounding to x's dtype.
// AVX512 holds the 32 lanes in two vectors, AVX2 in four, the scalar kernel in an array; the tree's
// first two levels are vector adds and the rest the usual horizontal sum. Greedy speculation relies on
// this: a token's logits inside a tree verify must be bit-identical to a one-token decode step's.
//
// x is widened to fp32 once per call (it is M x K, tiny next to the weights). A micro-kernel decodes
// the blocks of NR weight rows once per k step and applies them to MR rows of x, so a small tree's
// rows share one pass over the weights.
//
// x_int8 = true: x is quantized instead, per row and block of 32 (the integer path, as llama.cpp's
// design), and a block's dot product is an exact integer, so no ISA changes a bit:
//   - x block: amax = max |x_l| (NaN if any is), dx = amax / 127 (fp32), q_l = rint(x_l / dx)
//     (fp32 division, round half to even) clamped to [-127, 127] (only a subnormal dx needs the clamp);
//     dx = 0 or non-finite: every q_l = 0 (a non-finite dx then makes the row NaN, as x's inf / NaN
//     would); sx = sum of the q_l;
//   - isum = sum_l qw_l * q_l in int32 (q8_0: qw int8; q4_0: qw - 8 in [-8, 7]; q4_1: qw in [0, 15]);
//   - the block's value v = (dw * dx) * float(isum), q4_1 + (m * dx) * float(sx), each op rounded
//     to fp32 (no FMA: a PyTorch reference reproduces it, poss_ext/reference.py qlinear_int8);
//   - 8 fp32 lanes, lane b % 8 accumulating acc += v over the blocks b in order; the lanes summed
//     l with l + 4, then l + 2, l + 1; + bias, + residual, one rounding to x's dtype.
// The scalar kernel computes isum with a plain loop. The SIMD kernels take 8 weight rows a pass,
// vector lane k = weight row k, against a tile of up to 16 rows of x (qlinear_rows8.inc; q8_0 in the
// file's layout instead takes one weight row and 8 of its blocks at a time, transposed so that lane k
// holds block k, up to 8 rows of x): AVX2 with maddubs + madd (q8_0 through the sign trick, |qw| <= 128
// times |q| <= 127, two products per int16 <= 32512; the 4-bit formats sum 16 products per int16,
// <= 30480, before one madd), AVX512-VNNI with vpdpbusd (q8_0 as qw + 128, then - 128 sx). Rows
// interleaved by 8 (qlinear_args.h) load whole vectors; the file's layout is gathered and transposed
// per block. An AVX512 CPU without VNNI runs the AVX2 int8 kernel. x's quantization and the
// 8-weight-row pass's stores run 8 lanes at a time (the same bits). AMX-INT8 (qlinear_amx.inc): the
// VNNI kernel, with tiles of 12+ rows of x against 16 interleaved weight rows as tile multiplies.
//
// Measured: docs/ops.md (bench/bench_qlinear.py, thread CPU time, per kernel, layout and row count).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "poss/qlinear_args.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#ifdef __linux__
#include <sys/syscall.h>  // arch_prctl, the AMX tile state (qlinear_amx.inc)
#include <unistd.h>
#endif
#define POSS_QX86 1
#define POSS_Q_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define POSS_Q_AVX2 __attribute__((target("avx2,fma,f16c")))
#define POSS_Q_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define POSS_Q_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#endif

namespace poss {
namespace {

constexpr int64_t kRowBlock = 64;  // weight rows per thread work unit (as poss::linear)
constexpr int kAmxMinRows = 12;    // rows of x from which the AMX tile pass beats VNNI (docs/ops.md)
// Non-temporal prefetch distance along a weight row's blocks: a weight is read once per forward.
constexpr int64_t kPrefetchBytes = 2048;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float half_bits_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// A block's scales as one number that reaches 0x7C00 exactly when one of them is inf or NaN (fp16
// exponent all ones): the kernels keep the running maximum and the call fails after the pass.
template <QFormat F>
inline uint32_t scale_bits(const uint8_t* blk) {
  const uint32_t d = load_u16(blk) & 0x7FFFu;
  if constexpr (F == QFormat::Q4_1) return std::max(d, static_cast<uint32_t>(load_u16(blk + 2) & 0x7FFFu));
  return d;
}
constexpr uint32_t kNonFiniteHalf = 0x7C00u;

template <QFormat F>
constexpr int64_t block_bytes() { return F == QFormat::Q8_0 ? 34 : F == QFormat::Q4_0 ? 18 : 20; }

// `groups` groups of 8 rows interleaved by 8 (qlinear_args.h), of nb blocks each, in the plain layout.
template <QFormat F>
void unpack_rows8(const uint8_t* src, int64_t groups, int64_t nb, uint8_t* dst) {
  constexpr int64_t bb = block_bytes<F>();
  constexpr int nscales = F == QFormat::Q4_1 ? 2 : 1;
  constexpr int nwords = F == QFormat::Q8_0 ? 8 : 4;
  const int64_t rb = nb * bb;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* rec = src + g * 8 * rb + b * 8 * bb;
      for (int k = 0; k < 8; ++k) {
        uint8_t* blk = dst + (g * 8 + k) * rb + b * bb;
        for (int s = 0; s < nscales; ++s) std::memcpy(blk + 2 * s, rec + 16 * s + 2 * k, 2);
        for (int j = 0; j < nwords; ++j) std::memcpy(blk + 2 * nscales + 4 * j, rec + 16 * nscales + 32 * j + 4 * k, 4);
      }
    }
}

// ---- scalar: the reference order, in plain C++ ----

template <QFormat F>
inline void decode_block(const uint8_t* blk, float* w) {
  const float d = half_bits_to_float(load_u16(blk));
  if constexpr (F == QFormat::Q8_0) {
    for (int l = 0; l < 32; ++l) w[l] = static_cast<float>(static_cast<int8_t>(blk[2 + l])) * d;
  } else if constexpr (F == QFormat::Q4_0) {
    for (int l = 0; l < 16; ++l) {
      w[l] = static_cast<float>((blk[2 + l] & 15) - 8) * d;
      w[l + 16] = static_cast<float>((blk[2 + l] >> 4) - 8) * d;
    }
  } else {
    const float m = half_bits_to_float(load_u16(blk + 2));
    for (int l = 0; l < 16; ++l) {
      w[l] = std::fma(static_cast<float>(blk[4 + l] & 15), d, m);
      w[l + 16] = std::fma(static_cast<float>(blk[4 + l] >> 4), d, m);
    }
  }
}

// The 32 lanes' pairwise tree (a is overwritten).
inline float reduce32(float* a) {
  for (int l = 0; l < 16; ++l) a[l] += a[l + 16];
  for (int l = 0; l < 8; ++l) a[l] += a[l + 8];
  for (int l = 0; l < 4; ++l) a[l] += a[l + 4];
  for (int l = 0; l < 2; ++l) a[l] += a[l + 2];
  return a[0] + a[1];
}

template <QFormat F>
struct ScalarKern {
  static constexpr bool kInt8 = false;
  static constexpr bool kTile16 = false;  // AmxI8Kern's 16-weight-row tile pass
  static constexpr bool kRows8 = false;  // reads rows interleaved by 8 (else the driver unpacks them)
  static constexpr int kMaxRows = 1;
  static constexpr int cols(int) { return 1; }
  template <int MR, int NR>
  static void micro(const float* x, int64_t, const uint8_t* w, int64_t, int64_t nb, float sums[MR][8],
                    uint32_t& maxbits) {
    static_assert(MR == 1 && NR == 1, "the scalar kernel computes one element at a time");
    float acc[32] = {}, wb[32];
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * block_bytes<F>();
      maxbits = std::max(maxbits, scale_bits<F>(blk));
      decode_block<F>(blk, wb);
      for (int l = 0; l < 32; ++l) acc[l] = std::fma(x[b * 32 + l], wb[l], acc[l]);
    }
    sums[0][0] = reduce32(acc);
  }
};

// ---- int8 activations: the quantized x, and the scalar kernel (the reference order) ----

constexpr int kI8Lanes = 8;  // fp32 lanes of the int8 path: block b into lane b % 8

// x quantized per row and block (header comment). Rows are padded to nbp = nb rounded up to 8 blocks
// with zero blocks (q = 0, dx = 0, sx = 0), so the AVX2 kernel reads whole groups of 8.
struct QuantX {
  const int8_t* q;   // [M, nbp * 32]
  const int8_t* qt;  // q with each group of 8 blocks transposed by 4-byte words (Avx2I8Kern::group)
  const float* d;    // [M, nbp]
  const int32_t* s;  // [M, nbp]
  int64_t nbp;
  // Block-major copies for the 8-weight-row pass (qlinear_rows8.inc), block b of row m at b * M + m:
  // the rows of a tile sit at fixed offsets from one pointer per block.
  const int32_t* bq;   // [nb, M, 8]: the block's quants as 8 4-byte words
  const float* bd;     // [nb, M]: dx
  const float* bsf;    // [nb, M]: sx as fp32 (exact: |sx| <= 32 * 127), q4_1's min term
  const int32_t* bs8;  // [nb, M]: 8 sx, q4_0's offset
  int64_t M;
};

// A value rounded to fp32 and hidden from the compiler, so that it cannot fuse the multiply that
// made it with the add that uses it (this file is built with -mfma, and GCC contracts a * b + c
// into an FMA by default): the int8 path's documented order has no FMA.
template <typename V>
inline V opaque(V v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(v));
#else
  volatile V keep = v;
  v = keep;
#endif
  return v;
}

// A block's dx from its largest |x| bit pattern; d = dx and s = 0 set. Returns 0 (the quants zeroed)
// when the block quantizes to zero: dx = 0, or non-finite (then d carries the NaN / inf into the row).
inline float block_scale(uint32_t amax_bits, int8_t* q, float& d, int32_t& s) {
  float amax;
  std::memcpy(&amax, &amax_bits, sizeof amax);
  const float dx = amax / 127.0f;
  d = dx;
  s = 0;
  if (!(dx > 0.0f) || !std::isfinite(dx)) {
    std::memset(q, 0, 32);
    return 0.0f;
  }
  return dx;
}

inline void quantize_block(const float* x, int8_t* q, float& d, int32_t& s) {
  // amax as the largest |x| bit pattern: a NaN's pattern exceeds inf's, which exceeds every finite one.
  uint32_t amax_bits = 0;
  for (int l = 0; l < 32; ++l) {
    uint32_t bits;
    std::memcpy(&bits, x + l, sizeof bits);
    amax_bits = std::max(amax_bits, bits & 0x7FFFFFFFu);
  }
  const float dx = block_scale(amax_bits, q, d, s);
  if (dx == 0.0f) return;
  for (int l = 0; l < 32; ++l) {
    // rint, not nearbyint: the same rounding (half to even), but inlined as one instruction where
    // nearbyint calls libm, which saves and restores the FP environment each time (35 us a row of 576).
    const float r = std::min(std::max(std::rint(x[l] / dx), -127.0f), 127.0f);
    q[l] = static_cast<int8_t>(r);
    s += q[l];
  }
}

#ifdef POSS_QX86
// quantize_block 8 lanes at a time, the same bits: the largest |x| bit pattern (max_epu32), one fp32
// division for dx, then per lane an IEEE division, round half to even (the default rounding mode,
// as rint), the clamp and the exact integer sum. x / dx is finite here (a NaN or inf x makes dx
// non-finite, the zero branch). With the vector stores below, a row of x of 1536 went from ~3.6 us of
// per-call work outside the weight pass to ~1.2 (thread CPU time, the Zen 3 EPYC).
POSS_Q_AVX2 inline void quantize_block_avx2(const float* x, int8_t* q, float& d, int32_t& s) {
  __m256 v[4];
  __m256i top = _mm256_setzero_si256();
  const __m256i abs_bits = _mm256_set1_epi32(0x7FFFFFFF);
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(v[k]), abs_bits));
  }
  __m128i t = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  t = _mm_max_epu32(t, _mm_srli_si128(t, 8));
  t = _mm_max_epu32(t, _mm_srli_si128(t, 4));
  const float dx = block_scale(static_cast<uint32_t>(_mm_cvtsi128_si32(t)), q, d, s);
  if (dx == 0.0f) return;
  const __m256 dv = _mm256_set1_ps(dx), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i r[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 y = _mm256_round_ps(_mm256_div_ps(v[k], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, lo), hi));
  }
  // packs work per 128-bit half: bytes come out as 4-byte words a0 b0 c0 d0 | a1 b1 c1 d1 (r[0] = a).
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  h = _mm_add_epi32(h, _mm_srli_si128(h, 8));
  h = _mm_add_epi32(h, _mm_srli_si128(h, 4));
  s = _mm_cvtsi128_si32(h);
}
#endif

// The rows of x [M, K] fp32 quantized into this thread's buffers (with AVX2 when `avx2`), with the
// block-major copies when `block_major` (the AVX2 pass of the 4-bit formats reads them).
QuantX quantize_rows(const float* x, int64_t M, int64_t K, bool avx2, bool block_major) {
  const int64_t nb = K / kQBlock, nbp = (nb + kI8Lanes - 1) / kI8Lanes * kI8Lanes;
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> dbuf;
  thread_local std::vector<int32_t> sbuf;
  qbuf.assign(static_cast<size_t>(M * nbp * kQBlock), 0);
  dbuf.assign(static_cast<size_t>(M * nbp), 0.0f);
  sbuf.assign(static_cast<size_t>(M * nbp), 0);
  thread_local std::vector<int8_t> tbuf;
  tbuf.resize(qbuf.size());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kQBlock;
      int8_t* qb = qbuf.data() + (m * nbp + b) * kQBlock;
#ifdef POSS_QX86
      if (avx2) {
        quantize_block_avx2(xb, qb, dbuf[m * nbp + b], sbuf[m * nbp + b]);
        continue;
      }
#endif
      quantize_block(xb, qb, dbuf[m * nbp + b], sbuf[m * nbp + b]);
    }
  // Group of 8 blocks g, word j (quants 4j..4j+3), block k of the group -> bytes 32 j + 4 k of the group.
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < nbp / kI8Lanes; ++g) {
      const int8_t* src = qbuf.data() + (m * nbp + g * 8) * kQBlock;
      int8_t* dst = tbuf.data() + (m * nbp + g * 8) * kQBlock;
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 8; ++k) std::memcpy(dst + 32 * j + 4 * k, src + 32 * k + 4 * j, 4);
    }
  QuantX qx{qbuf.data(), tbuf.data(), dbuf.data(), sbuf.data(), nbp, nullptr, nullptr, nullptr, nullptr, M};
  if (block_major) {
    thread_local std::vector<int32_t> bq, bs8;
    thread_local std::vector<float> bd, bsf;
    bq.resize(static_cast<size_t>(nb * M * 8));
    bd.resize(static_cast<size_t>(nb * M));
    bsf.resize(bd.size());
    bs8.resize(bd.size());
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t m = 0; m < M; ++m) {
        std::memcpy(bq.data() + (b * M + m) * 8, qbuf.data() + (m * nbp + b) * kQBlock, kQBlock);
        bd[b * M + m] = dbuf[m * nbp + b];
        bsf[b * M + m] = static_cast<float>(sbuf[m * nbp + b]);
        bs8[b * M + m] = 8 * sbuf[m * nbp + b];
      }
    qx.bq = bq.data();
    qx.bd = bd.data();
    qx.bsf = bsf.data();
    qx.bs8 = bs8.data();
  }
  return qx;
}

// sum_l qw_l * q_l of one block, with q4_0's qw - 8.
template <QFormat F>
inline int32_t block_isum(const uint8_t* blk, const int8_t* q, int32_t sx) {
  int32_t acc = 0;
  if constexpr (F == QFormat::Q8_0) {
    for (int l = 0; l < 32; ++l) acc += static_cast<int32_t>(static_cast<int8_t>(blk[2 + l])) * q[l];
  } else {
    constexpr int off = F == QFormat::Q4_0 ? 2 : 4;
    for (int l = 0; l < 16; ++l) acc += (blk[off + l] & 15) * q[l] + (blk[off + l] >> 4) * q[l + 16];
    if constexpr (F == QFormat::Q4_0) acc -= 8 * sx;
  }
  return acc;
}

// The 8 lanes' tree: l with l + 4, l + 2, l + 1 (a is overwritten).
inline float reduce8(float* a) {
  for (int l = 0; l < 4; ++l) a[l] += a[l + 4];
  for (int l = 0; l < 2; ++l) a[l] += a[l + 2];
  return a[0] + a[1];
}

template <QFormat F>
struct ScalarI8Kern {
  static constexpr bool kInt8 = true;
  static constexpr bool kTile16 = false;
  static constexpr bool kRows8 = false;
  static constexpr int kMaxRows = 1;
  static constexpr int cols(int) { return 1; }
  template <int MR, int NR>
  static void micro(const QuantX& qx, int64_t m0, const uint8_t* w, int64_t, int64_t nb, float sums[MR][8],
                    uint32_t& maxbits, bool) {
    static_assert(MR == 1 && NR == 1, "the scalar kernel computes one element at a time");
    const int8_t* q = qx.q + m0 * qx.nbp * kQBlock;
    const float* dx = qx.d + m0 * qx.nbp;
    const int32_t* sx = qx.s + m0 * qx.nbp;
    float acc[kI8Lanes] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * block_bytes<F>();
      maxbits = std::max(maxbits, scale_bits<F>(blk));
      const float dw = half_bits_to_float(load_u16(blk));
      const int32_t isum = block_isum<F>(blk, q + b * kQBlock, sx[b]);
      float v = opaque((dw * dx[b]) * static_cast<float>(isum));
      if constexpr (F == QFormat::Q4_1) {
        const float mw = half_bits_to_float(load_u16(blk + 2));
        v = v + opaque((mw * dx[b]) * static_cast<float>(sx[b]));
      }
      acc[b % kI8Lanes] += v;
    }
    sums[0][0] = reduce8(acc);
  }
};

#ifdef POSS_QX86

// ---- AVX2 + FMA + F16C: the 32 lanes as four vectors of 8 ----

// Chunk V (0..3, weights 8V..8V+7) of a block as eight fp32.
template <QFormat F, int V>
POSS_Q_AVX2 inline __m256 avx2_chunk(const uint8_t* blk, __m256 d, __m256 m) {
  if constexpr (F == QFormat::Q8_0) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * V));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
  } else {
    constexpr int off = F == QFormat::Q4_0 ? 2 : 4;
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + off + 8 * (V & 1)));
    if constexpr (V >= 2) q = _mm_srli_epi16(q, 4);  // weights 16..31: the high nibbles
    q = _mm_and_si128(q, _mm_set1_epi8(15));
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    if constexpr (F == QFormat::Q4_0) return _mm256_mul_ps(_mm256_sub_ps(f, _mm256_set1_ps(8.0f)), d);
    else return _mm256_fmadd_ps(f, d, m);
  }
}

POSS_Q_AVX2 inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <QFormat F>
struct Avx2Kern {
  // MR x NR x 4 accumulators + the chunk, its scale (and min) and an x vector in 16 registers.
  static constexpr bool kInt8 = false;
  static constexpr bool kTile16 = false;
  static constexpr bool kRows8 = false;
  static constexpr int kMaxRows = 3;
  static constexpr int cols(int rows) { return rows == 1 ? 2 : 1; }

  template <int MR, int NR, int V>
  POSS_Q_AVX2 static void step(__m256 (&acc)[MR][NR][4], int j, const float* xb, int64_t K, const uint8_t* blk,
                               __m256 d, __m256 m) {
    const __m256 wv = avx2_chunk<F, V>(blk, d, m);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) acc[i][j][V] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + i * K + 8 * V), wv, acc[i][j][V]);
  }

  template <int MR, int NR>
  POSS_Q_AVX2 static void micro(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t nb,
                                float sums[MR][8], uint32_t& maxbits) {
    __m256 acc[MR][NR][4];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[i][j][v] = _mm256_setzero_ps();
    uint32_t mb = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * 32;
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const uint8_t* blk = w + j * row_bytes + b * block_bytes<F>();
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_NTA);
        mb = std::max(mb, scale_bits<F>(blk));
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
        const __m256 m = F == QFormat::Q4_1 ? _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2))) : d;
        step<MR, NR, 0>(acc, j, xb, K, blk, d, m);
        step<MR, NR, 1>(acc, j, xb, K, blk, d, m);
        step<MR, NR, 2>(acc, j, xb, K, blk, d, m);
        step<MR, NR, 3>(acc, j, xb, K, blk, d, m);
      }
    }
    maxbits = std::max(maxbits, mb);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
        sums[i][j] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[i][j][0], acc[i][j][2]),
                                           _mm256_add_ps(acc[i][j][1], acc[i][j][3])));
  }
};

// ---- AVX2 int8 path: the 8 lanes as one vector, 8 blocks' integer sums at a time ----

// A block's 32 quants as bytes in weight order: q8_0's int8, or the 4-bit formats' 0..15.
template <QFormat F>
POSS_Q_AVX2 inline __m256i avx2_wq(const uint8_t* blk) {
  if constexpr (F == QFormat::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    // The 16 bytes in both halves, the upper half shifted right by 4 (per 32 bits: the bits a byte
    // takes from its neighbour are masked off), then the low nibbles of each byte: 3 instructions.
    constexpr int off = F == QFormat::Q4_0 ? 2 : 4;
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off)));
    return _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
  }
}

// -- 8 weight rows per pass: vector lane k = weight row k (qlinear_rows8.inc) --

// 16 bytes at p + k * rb of rows k = 0..7 as 4 vectors: P[j] lane k = bytes 4j..4j+3 of row k.
POSS_Q_AVX2 inline void transpose8x4(const uint8_t* p, int64_t rb, __m256i* P) {
  const auto rows = [&](int k) POSS_Q_AVX2 {  // rows k and k + 4, one per 128-bit half
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * rb))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (k + 4) * rb)), 1);
  };
  const __m256i r0 = rows(0), r1 = rows(1), r2 = rows(2), r3 = rows(3);
  const __m256i a0 = _mm256_unpacklo_epi32(r0, r1), a1 = _mm256_unpackhi_epi32(r0, r1);
  const __m256i a2 = _mm256_unpacklo_epi32(r2, r3), a3 = _mm256_unpackhi_epi32(r2, r3);
  P[0] = _mm256_unpacklo_epi64(a0, a2);
  P[1] = _mm256_unpackhi_epi64(a0, a2);
  P[2] = _mm256_unpacklo_epi64(a1, a3);
  P[3] = _mm256_unpackhi_epi64(a1, a3);
}

#define POSS_ROWS8_NAME rows8_avx2
#define POSS_ROWS8_TARGET POSS_Q_AVX2
#define POSS_ROWS8_VNNI 0
#include "qlinear_rows8.inc"
#undef POSS_ROWS8_NAME
#undef POSS_ROWS8_TARGET
#undef POSS_ROWS8_VNNI

#define POSS_ROWS8_NAME rows8_vnni
#define POSS_ROWS8_TARGET POSS_Q_VNNI
#define POSS_ROWS8_VNNI 1
#include "qlinear_rows8.inc"
#undef POSS_ROWS8_NAME
#undef POSS_ROWS8_TARGET
#undef POSS_ROWS8_VNNI

template <QFormat F>
struct Avx2I8Kern {
  static constexpr bool kInt8 = true;
  static constexpr bool kTile16 = false;
  static constexpr bool kRows8 = true;
  // q4_0 / q4_1, and q8_0 with rows interleaved by 8: 8 weight rows at a time (rows8_avx2; the last
  // N % 8 rows one by one), a tile of up to 16 rows of x sharing the weight side (a tree verify's).
  // q8_0 in the file's layout: one weight row at a time, up to 8 rows of x; there an 8-row pass
  // measured slower (14.3 ms against 10.7 a pass over SmolLM2's shapes at 1 row of x, AVX2 EPYC), its
  // 32 quant bytes costing two transposes. Every pass gives the same bits, so the choice keeps a row's
  // result whatever shares its call.
  static constexpr int kMaxRows = F == QFormat::Q8_0 ? 8 : 16;
  static constexpr int cols(int) { return F != QFormat::Q8_0 ? 8 : 1; }

  // Blocks g * 8 .. g * 8 + 7 (only the first `valid` exist when kFull is false) into acc[i].
  // The 8 blocks' quants are transposed by 4-byte words (t[j], lane k = quants 4j..4j+3 of block k),
  // as x's are at quantization (QuantX::qt), so that lane k of a maddubs + madd sums block k only:
  // the integer sums come out one block per lane with no horizontal additions.
  template <int MR, bool kFull>
  POSS_Q_AVX2 static void group(const QuantX& qx, int64_t m0, const uint8_t* w, int64_t g, int valid,
                                __m256 (&acc)[MR], uint32_t& mb) {
    uint16_t dh[8] = {}, mh[8] = {};  // the scales, as fp16 (in registers once the loops are unrolled)
    __m256i wq[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      if (kFull || k < valid) {
        const uint8_t* blk = w + (g * 8 + k) * block_bytes<F>();
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_NTA);
        dh[k] = load_u16(blk);
        if constexpr (F == QFormat::Q4_1) mh[k] = load_u16(blk + 2);
        wq[k] = avx2_wq<F>(blk);
      } else {
        wq[k] = _mm256_setzero_si256();  // a padded block: its x quants are 0 too, a zero sum
      }
    }
    __m256i t[8];
    {
      __m256i a[8], b[8];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        a[2 * p] = _mm256_unpacklo_epi32(wq[2 * p], wq[2 * p + 1]);
        a[2 * p + 1] = _mm256_unpackhi_epi32(wq[2 * p], wq[2 * p + 1]);
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h + 3
        b[4 * h + 0] = _mm256_unpacklo_epi64(a[4 * h], a[4 * h + 2]);      // words 0 | 4
        b[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h], a[4 * h + 2]);      // words 1 | 5
        b[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);  // words 2 | 6
        b[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);  // words 3 | 7
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        t[j] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x20);
        t[j + 4] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x31);
      }
    }
    // Built from registers: eight 2-byte stores and a 16-byte load would stall store forwarding.
    const __m128i dhv = _mm_setr_epi16(dh[0], dh[1], dh[2], dh[3], dh[4], dh[5], dh[6], dh[7]);
    const __m128i mhv = _mm_setr_epi16(mh[0], mh[1], mh[2], mh[3], mh[4], mh[5], mh[6], mh[7]);
    // The largest |scale| bits of the 8 blocks (scale_bits, 8 at a time).
    const __m128i abs7 = _mm_set1_epi16(0x7FFF);
    __m128i top = _mm_and_si128(dhv, abs7);
    if constexpr (F == QFormat::Q4_1) top = _mm_max_epu16(top, _mm_and_si128(mhv, abs7));
    top = _mm_max_epu16(top, _mm_srli_si128(top, 8));
    top = _mm_max_epu16(top, _mm_srli_si128(top, 4));
    top = _mm_max_epu16(top, _mm_srli_si128(top, 2));
    mb = std::max(mb, static_cast<uint32_t>(_mm_extract_epi16(top, 0)));
    const __m256 dw = _mm256_cvtph_ps(dhv);
    const __m256 mw = F == QFormat::Q4_1 ? _mm256_cvtph_ps(mhv) : dw;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int8_t* xt = qx.qt + ((m0 + i) * qx.nbp + g * 8) * kQBlock;
      const auto xj = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt + 32 * j)); };
      __m256i isum;
      if constexpr (F == QFormat::Q8_0) {
        // |qw| as unsigned (|-128| = 128), its sign moved onto q: pairs <= 2 * 128 * 127 = 32512.
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(t[j], t[j]),
                                                                         _mm256_sign_epi8(xj(j), t[j])),
                                                    _mm256_set1_epi16(1)));
        isum = s;
      } else {
        // qw in [0, 15]: each int16 sums 2 products per word, 16 over the 8 words, <= 16 * 15 * 127 = 30480.
        __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(t[j], xj(j)));
        isum = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
      }
      const int64_t at = (m0 + i) * qx.nbp + g * 8;
      const __m256 dx = _mm256_loadu_ps(qx.d + at);
      const __m256i sx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.s + at));
      if constexpr (F == QFormat::Q4_0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(sx, 3));
      __m256 v = opaque(_mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum)));
      if constexpr (F == QFormat::Q4_1)
        v = _mm256_add_ps(v, opaque(_mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(sx))));
      acc[i] = _mm256_add_ps(acc[i], v);
    }
  }

  // Weight rows `rows8` (interleaved by 8, qlinear_args.h): the 8-row pass reads them as they are.
  template <int MR, int NR>
  POSS_Q_AVX2 static void micro(const QuantX& qx, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t nb,
                                float sums[MR][8], uint32_t& maxbits, bool rows8) {
    static_assert(NR == 1 || NR == 8, "8 weight rows at a time, or one");
    if constexpr (NR == 8) {
      if (rows8) rows8_avx2<F, MR, true>(qx, m0, w, row_bytes, nb, sums, maxbits);
      else if constexpr (F != QFormat::Q8_0) rows8_avx2<F, MR, false>(qx, m0, w, row_bytes, nb, sums, maxbits);
      return;
    }
    micro1<MR>(qx, m0, w, nb, sums, maxbits);
  }

  // One weight row (plain layout) against MR rows of x.
  template <int MR>
  POSS_Q_AVX2 static void micro1(const QuantX& qx, int64_t m0, const uint8_t* w, int64_t nb, float sums[MR][8],
                                 uint32_t& maxbits) {
    __m256 acc[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
    uint32_t mb = 0;
    const int64_t full = nb / 8;
    for (int64_t g = 0; g < full; ++g) group<MR, true>(qx, m0, w, g, 8, acc, mb);
    if (nb % 8) group<MR, false>(qx, m0, w, full, static_cast<int>(nb % 8), acc, mb);
    maxbits = std::max(maxbits, mb);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) sums[i][0] = hsum256(acc[i]);
  }
};

// ---- AVX512-VNNI int8 path: the AVX2 int8 kernel with vpdpbusd in the 8-weight-row pass ----
//
// One vpdpbusd sums 4 products a lane into int32 where AVX2 takes a maddubs, an int16 add and (once a
// block) a madd; q8_0 (one weight row at a time) runs the AVX2 code. 256-bit vectors: lane k is still
// weight row k of 8, and Zen 4 runs 512-bit ones as two halves.
template <QFormat F>
struct VnniI8Kern : Avx2I8Kern<F> {
  template <int MR, int NR>
  static void micro(const QuantX& qx, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t nb,
                    float sums[MR][8], uint32_t& maxbits, bool rows8) {
    if constexpr (NR == 8) {
      if (rows8) rows8_vnni<F, MR, true>(qx, m0, w, row_bytes, nb, sums, maxbits);
      else if constexpr (F != QFormat::Q8_0) rows8_vnni<F, MR, false>(qx, m0, w, row_bytes, nb, sums, maxbits);
    } else {
      Avx2I8Kern<F>::template micro1<MR>(qx, m0, w, nb, sums, maxbits);
    }
  }
};

#include "qlinear_amx.inc"

// ---- AVX512F: the 32 lanes as two vectors of 16 ----

// 16 int8 / uint8 -> 16 fp32. The zero-masked forms keep all 16 lanes, like the plain ones, without
// their GCC 12 -Wmaybe-uninitialized false positive.
POSS_Q_AVX512 inline __m512 i8_to_ps(__m128i q) {
  return _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepi8_epi32(0xFFFF, q));
}
POSS_Q_AVX512 inline __m512 u8_to_ps(__m128i q) {
  return _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepu8_epi32(0xFFFF, q));
}

// A block's weights 0..15 (lo) and 16..31 (hi) as fp32.
template <QFormat F>
POSS_Q_AVX512 inline void avx512_block(const uint8_t* blk, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(blk)));
  if constexpr (F == QFormat::Q8_0) {
    lo = _mm512_mul_ps(i8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))), d);
    hi = _mm512_mul_ps(i8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))), d);
  } else {
    constexpr int off = F == QFormat::Q4_0 ? 2 : 4;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off));
    const __m128i nib = _mm_set1_epi8(15);
    const __m512 flo = u8_to_ps(_mm_and_si128(q, nib));
    const __m512 fhi = u8_to_ps(_mm_and_si128(_mm_srli_epi16(q, 4), nib));
    if constexpr (F == QFormat::Q4_0) {
      const __m512 eight = _mm512_set1_ps(8.0f);
      lo = _mm512_mul_ps(_mm512_sub_ps(flo, eight), d);
      hi = _mm512_mul_ps(_mm512_sub_ps(fhi, eight), d);
    } else {
      const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(blk + 2)));
      lo = _mm512_fmadd_ps(flo, d, m);
      hi = _mm512_fmadd_ps(fhi, d, m);
    }
  }
}

// 16 lanes as a pairwise tree: l with l ^ 8, l ^ 4, l ^ 2, l ^ 1 (poss::linear's hsum512, whose
// lower half is hsum256's tree).
POSS_Q_AVX512 inline float hsum512(__m512 v) {
  constexpr __mmask16 all = 0xFFFF;
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(all, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_maskz_permute_ps(all, v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(v);
}

template <QFormat F>
struct Avx512Kern {
  // MR x NR x 2 accumulators (at most 24) + a block's two vectors + x and scales in 32 registers.
  static constexpr bool kInt8 = false;
  static constexpr bool kTile16 = false;
  static constexpr bool kRows8 = false;
  static constexpr int kMaxRows = 6;
  static constexpr int cols(int rows) { return rows <= 3 ? 4 : rows == 4 ? 3 : 2; }

  template <int MR, int NR>
  POSS_Q_AVX512 static void micro(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t nb,
                                  float sums[MR][8], uint32_t& maxbits) {
    __m512 acc[MR][NR][2];
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
    uint32_t mb = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * 32;
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const uint8_t* blk = w + j * row_bytes + b * block_bytes<F>();
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_NTA);
        mb = std::max(mb, scale_bits<F>(blk));
        __m512 lo, hi;
        avx512_block<F>(blk, lo, hi);
#pragma GCC unroll 6
        for (int i = 0; i < MR; ++i) {
          acc[i][j][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K), lo, acc[i][j][0]);
          acc[i][j][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + i * K + 16), hi, acc[i][j][1]);
        }
      }
    }
    maxbits = std::max(maxbits, mb);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) sums[i][j] = hsum512(_mm512_add_ps(acc[i][j][0], acc[i][j][1]));
  }
};

bool cpu_has(const char* kernel) {
  __builtin_cpu_init();
  if (std::strcmp(kernel, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  if (std::strcmp(kernel, "avx512vnni") == 0)
    return cpu_has("avx512") && cpu_has("avx2") && __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(kernel, "amx") == 0) return cpu_has("avx512vnni") && amx_ready();
  if (std::strcmp(kernel, "avx2") == 0)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return std::strcmp(kernel, "scalar") == 0;
}

#else

bool cpu_has(const char* kernel) { return std::strcmp(kernel, "scalar") == 0; }

#endif

// ---- the shared driver ----

template <typename T>
struct Epilogue {
  const T* bias;      // [N] or null
  const T* residual;  // [M, N] or null
  T* out;             // [M, N]
  int64_t N;

  void store(int64_t m, int64_t n, float v) const {
    if (bias) v += static_cast<float>(bias[n]);
    if (residual) v += static_cast<float>(residual[m * N + n]);
    out[m * N + n] = static_cast<T>(v);
  }
};

#ifdef POSS_QX86
POSS_Q_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
POSS_Q_AVX2 inline __m256 load8(const c10::BFloat16* p) {  // exact: bf16 is fp32's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Epilogue::store of outputs n .. n + 7 of row m, 8 lanes at a time and the same bits: the same fp32
// adds, and bf16's rounding as c10's (round half to even on the bits, NaN -> 0x7FC0). fp16 element
// by element (c10's conversion). The 8-weight-row pass stores through it (element by element, a bf16
// output took ~4 cycles).
template <typename T>
POSS_Q_AVX2 void store8(const Epilogue<T>& e, int64_t m, int64_t n, const float* s) {
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (int j = 0; j < 8; ++j) e.store(m, n + j, s[j]);
  } else {
    __m256 v = _mm256_loadu_ps(s);
    if (e.bias) v = _mm256_add_ps(v, load8(e.bias + n));
    if (e.residual) v = _mm256_add_ps(v, load8(e.residual + m * e.N + n));
    T* o = e.out + m * e.N + n;
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(o, v);
    } else {
      const __m256i u = _mm256_castps_si256(v);
      const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                            _mm256_set1_epi32(0x7FFF));
      __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // r <= 0xFFFF: no saturation
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(p));
    }
  }
}
#endif

struct Pass {
  const float* x;  // [M, K] fp32
  int64_t K;
  const QuantX* qx;  // x quantized (the int8 kernels), or null
  const uint8_t* w;  // [N, row_bytes]
  int64_t row_bytes, nb;
  bool rows8;  // w's rows interleaved by 8 (qlinear_args.h)
};

// Rows [n0, n1) of p.w as they are, or (interleaved by 8, for a kernel that reads the plain layout)
// unpacked into a buffer of this thread's; n0 and n1 are multiples of 8 there.
template <typename Kern, QFormat F>
const uint8_t* rows_for(const Pass& p, int64_t n0, int64_t n1) {
  const uint8_t* src = p.w + n0 * p.row_bytes;
  if (!p.rows8 || Kern::kRows8) return src;
  thread_local std::vector<uint8_t> plain;
  plain.resize(static_cast<size_t>((n1 - n0) * p.row_bytes));
  unpack_rows8<F>(src, (n1 - n0) / 8, p.nb, plain.data());
  return plain.data();
}

// MR x rows from m0 against weight rows [n0, n1), whose bytes start at w, NR weight rows at a time.
template <typename Kern, int MR, int NR, typename T>
void row_group_nr(const Pass& p, const uint8_t* w, int64_t m0, int64_t n0, int64_t n1, const Epilogue<T>& e,
                  uint32_t& maxbits) {
  const float* xr = p.x + m0 * p.K;
  const bool rows8 = p.rows8 && Kern::kRows8;
  float sums[MR][NR > 8 ? NR : 8];
  int64_t n = n0;
  if constexpr (NR == 16) Kern::template begin_tiles<MR>();
  for (; n + NR <= n1; n += NR) {
    const uint8_t* wn = w + (n - n0) * p.row_bytes;
    if constexpr (Kern::kInt8)
      Kern::template micro<MR, NR>(*p.qx, m0, wn, p.row_bytes, p.nb, sums, maxbits, rows8);
    else
      Kern::template micro<MR, NR>(xr, p.K, wn, p.row_bytes, p.nb, sums, maxbits);
#ifdef POSS_QX86
    if constexpr (NR % 8 == 0) {  // the int8 kernels' 8 (AMX: 16) weight rows
      for (int i = 0; i < MR; ++i)
        for (int h = 0; h < NR; h += 8) store8(e, m0 + i, n + h, sums[i] + h);
      continue;
    }
#endif
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) e.store(m0 + i, n + j, sums[i][j]);
  }
  if constexpr (NR == 16) {  // a group of 8 interleaved rows left over: the 8-row pass
    Kern::end_tiles();
    if (n < n1) row_group_nr<Kern, MR, 8>(p, w + (n - n0) * p.row_bytes, m0, n, n1, e, maxbits);
  } else {
    for (; n < n1; ++n) {  // the last N % 8 rows of the 8-row pass (never interleaved: N % 8 == 0 there)
      const uint8_t* wn = w + (n - n0) * p.row_bytes;
      if constexpr (Kern::kInt8)
        Kern::template micro<MR, 1>(*p.qx, m0, wn, p.row_bytes, p.nb, sums, maxbits, false);
      else
        Kern::template micro<MR, 1>(xr, p.K, wn, p.row_bytes, p.nb, sums, maxbits);
      for (int i = 0; i < MR; ++i) e.store(m0 + i, n, sums[i][0]);
    }
  }
}

// row_group_nr with the kernel's width, or 8 weight rows a pass where it reads them interleaved (16, the
// AMX tile pass, for tiles of at least kAmxMinRows rows of x).
template <typename Kern, int MR, typename T>
void row_group(const Pass& p, const uint8_t* w, int64_t m0, int64_t n0, int64_t n1, const Epilogue<T>& e,
               uint32_t& maxbits) {
  if constexpr (Kern::kRows8) {
    if constexpr (Kern::kTile16 && MR >= kAmxMinRows) {
      if (p.rows8) return row_group_nr<Kern, MR, 16>(p, w, m0, n0, n1, e, maxbits);
    }
    if (p.rows8) return row_group_nr<Kern, MR, 8>(p, w, m0, n0, n1, e, maxbits);
  }
  row_group_nr<Kern, MR, Kern::cols(MR)>(p, w, m0, n0, n1, e, maxbits);
}

// The last M % kMaxRows rows, in one pass of the right height.
template <typename Kern, int MR, typename T>
void tail_rows(int64_t rows, const Pass& p, const uint8_t* w, int64_t m0, int64_t n0, int64_t n1,
               const Epilogue<T>& e, uint32_t& maxbits) {
  if constexpr (MR > 0) {
    if (rows == MR) return row_group<Kern, MR>(p, w, m0, n0, n1, e, maxbits);
    tail_rows<Kern, MR - 1>(rows, p, w, m0, n0, n1, e, maxbits);
  }
}

// x as fp32 rows: itself, or widened into a cache-line-aligned buffer of this thread's.
template <typename T>
const float* fp32_rows(const T* x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    thread_local std::vector<float> buffer;
    buffer.resize(n + 16);
    const auto offset = reinterpret_cast<uintptr_t>(buffer.data()) % 64 / sizeof(float);
    float* widened = buffer.data() + (offset ? 16 - offset : 0);
    at::vec::convert(x, widened, n);
    return widened;
  }
}

// The first block with a non-finite scale, as an error naming it (its row and block in the plain layout).
void fail_on_bad_scale(const at::Tensor& blocks, QLayout layout) {
  const QFormat f = layout.format;
  const int64_t N = blocks.size(0), bytes = qblock_bytes(f), nb = blocks.size(1) / bytes;
  std::vector<uint8_t> plain;
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  if (layout.rows8) {
    plain.resize(static_cast<size_t>(blocks.numel()));
    if (f == QFormat::Q8_0) unpack_rows8<QFormat::Q8_0>(w, N / 8, nb, plain.data());
    else if (f == QFormat::Q4_0) unpack_rows8<QFormat::Q4_0>(w, N / 8, nb, plain.data());
    else unpack_rows8<QFormat::Q4_1>(w, N / 8, nb, plain.data());
    w = plain.data();
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * blocks.size(1) + b * bytes;
      for (int s = 0; s < (f == QFormat::Q4_1 ? 2 : 1); ++s) {
        const uint16_t h = load_u16(blk + 2 * s);
        TORCH_CHECK((h & kNonFiniteHalf) != kNonFiniteHalf, "blocks: row ", n, ", block ", b, " has a non-finite ",
                    s == 0 ? "scale d" : "min m", " (", half_bits_to_float(h), "); a GGUF block's scales are finite");
      }
    }
}

template <template <QFormat> class KernT, QFormat F, typename T>
void run(const Pass& p, int64_t M, int64_t N, const Epilogue<T>& e, std::atomic<uint32_t>& maxbits) {
  using Kern = KernT<F>;
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // Threads pay once a call does ~0.1 M multiply-adds; the split never changes a result.
  const int64_t grain = M * p.K * N >= (1 << 17) ? 1 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    uint32_t mb = 0;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kRowBlock, n1 = std::min(N, n0 + kRowBlock);
      const uint8_t* w = rows_for<Kern, F>(p, n0, n1);
      int64_t m = 0;
      for (; m + Kern::kMaxRows <= M; m += Kern::kMaxRows) row_group<Kern, Kern::kMaxRows>(p, w, m, n0, n1, e, mb);
      tail_rows<Kern, Kern::kMaxRows - 1>(M - m, p, w, m, n0, n1, e, mb);
    }
    uint32_t seen = maxbits.load();
    while (mb > seen && !maxbits.compare_exchange_weak(seen, mb)) {
    }
  });
}

template <template <QFormat> class KernT, typename T>
void run_format(QFormat f, const Pass& p, int64_t M, int64_t N, const Epilogue<T>& e,
                std::atomic<uint32_t>& maxbits) {
  switch (f) {
    case QFormat::Q8_0: return run<KernT, QFormat::Q8_0>(p, M, N, e, maxbits);
    case QFormat::Q4_0: return run<KernT, QFormat::Q4_0>(p, M, N, e, maxbits);
    case QFormat::Q4_1: return run<KernT, QFormat::Q4_1>(p, M, N, e, maxbits);
  }
}

// The kernel in use: POSS_QLINEAR (read once; "amx", "avx512vnni", "avx512", "avx2", "scalar") or the best
// this CPU has; force_cpu_qlinear_kernel changes it.
std::string best_kernel() {
  for (const char* k : {"amx", "avx512vnni", "avx512", "avx2"})
    if (cpu_has(k)) return k;
  return "scalar";
}

bool known_kernel(const std::string& k) {
  return k == "amx" || k == "avx512vnni" || k == "avx512" || k == "avx2" || k == "scalar";
}

std::string& current_kernel() {
  static std::string kernel = [] {
    const char* env = std::getenv("POSS_QLINEAR");
    if (env == nullptr || *env == '\0') return best_kernel();
    TORCH_CHECK(known_kernel(env), "POSS_QLINEAR must be 'amx', 'avx512vnni', 'avx512', 'avx2' or 'scalar', got '", env,
                "'");
    TORCH_CHECK(cpu_has(env), "POSS_QLINEAR=", env, ": this CPU cannot run that kernel");
    return std::string(env);
  }();
  return kernel;
}

template <typename T>
at::Tensor qlinear_typed(const at::Tensor& x, const at::Tensor& blocks, QLayout layout,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                         bool x_int8) {
  const QFormat f = layout.format;
  const int64_t K = x.size(-1), N = blocks.size(0);
  const int64_t M = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(out_shape);
  if (K == 0) {  // an empty sum: bias + residual
    out.zero_();
    if (bias) out.add_(*bias);
    if (residual) out.add_(residual->reshape({M, N}));
    return out.view(out_shape);
  }
  const auto x2 = x.reshape({M, K}).contiguous();
  const auto w = blocks.contiguous();
  at::Tensor b, r;
  if (bias) b = bias->contiguous();
  if (residual) r = residual->reshape({M, N}).contiguous();
  const Epilogue<T> e{bias ? b.const_data_ptr<T>() : nullptr, residual ? r.const_data_ptr<T>() : nullptr,
                      out.mutable_data_ptr<T>(), N};
  const float* xf = fp32_rows(x2.const_data_ptr<T>(), M * K);
  const std::string kernel = cpu_qlinear_kernel(x_int8);
  const bool simd_i8 = kernel == "avx2" || kernel == "avx512vnni" || kernel == "amx";
  QuantX qx{};
  // The 8-weight-row pass reads x block-major: the 4-bit formats always, q8_0 when interleaved.
  if (x_int8) qx = quantize_rows(xf, M, K, simd_i8, (f != QFormat::Q8_0 || layout.rows8) && simd_i8);
  const Pass p{xf, K, x_int8 ? &qx : nullptr, w.const_data_ptr<uint8_t>(), w.size(1), K / kQBlock, layout.rows8};
  std::atomic<uint32_t> maxbits{0};
#ifdef POSS_QX86
  if (kernel == "avx512") run_format<Avx512Kern>(f, p, M, N, e, maxbits);
  else if (kernel == "avx512vnni") run_format<VnniI8Kern>(f, p, M, N, e, maxbits);
  else if (kernel == "amx") run_format<AmxI8Kern>(f, p, M, N, e, maxbits);
  else if (kernel == "avx2" && x_int8) run_format<Avx2I8Kern>(f, p, M, N, e, maxbits);
  else if (kernel == "avx2") run_format<Avx2Kern>(f, p, M, N, e, maxbits);
  else
#endif
  if (x_int8) run_format<ScalarI8Kern>(f, p, M, N, e, maxbits);
  else run_format<ScalarKern>(f, p, M, N, e, maxbits);
  if (maxbits.load() >= kNonFiniteHalf) fail_on_bad_scale(w, layout);
  return out.view(out_shape);
}

at::Tensor qlinear_cpu(const at::Tensor& x, const at::Tensor& blocks, c10::string_view format,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                       bool x_int8) {
  const QLayout f = parse_qformat(std::string(format));
  check_qlinear(x, blocks, f, bias, residual);
  switch (x.scalar_type()) {
    case at::kFloat: return qlinear_typed<float>(x, blocks, f, bias, residual, x_int8);
    case at::kBFloat16: return qlinear_typed<c10::BFloat16>(x, blocks, f, bias, residual, x_int8);
    default: return qlinear_typed<c10::Half>(x, blocks, f, bias, residual, x_int8);
  }
}

}  // namespace

// "amx" and "avx512vnni" are int8 kernels: fp32 activations run the AVX512 one there. The int8 path
// has no AVX512 kernel without VNNI: such a CPU runs the AVX2 one (the same bits as every kernel).
const char* cpu_qlinear_kernel(bool x_int8) {
  const std::string& k = current_kernel();
  if (!x_int8 && (k == "amx" || k == "avx512vnni")) return "avx512";
  if (x_int8 && k == "avx512") return "avx2";
  return k.c_str();
}

void force_cpu_qlinear_kernel(const std::string& name) {
  if (name.empty()) {
    current_kernel() = best_kernel();
    return;
  }
  TORCH_CHECK(known_kernel(name),
              "kernel must be 'amx', 'avx512vnni', 'avx512', 'avx2', 'scalar' or '' (the best), got '", name, "'");
  TORCH_CHECK(cpu_has(name.c_str()), "this CPU cannot run the ", name, " kernel of poss::qlinear");
  current_kernel() = name;
}

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("qlinear", &qlinear_cpu); }

}  // namespace poss
