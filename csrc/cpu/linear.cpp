// CPU kernel of poss::linear for bf16 on CPUs with AVX512-BF16: out = x @ W^T + bias + residual.
//
// Why our own GEMM: decoding streams every weight once per token, and at one row (a decode step)
// or a handful (a small draft tree) the vendor bf16 GEMM reaches under half the core's read
// bandwidth. The second reason is exactness: the vendor picks a different kernel, and so a
// different summation order, for different row counts, so a token's logits inside a tree verify
// differ in the last bits from a decode step's and greedy paths part at near-ties. Here every
// output element is one fixed sequence, whatever the number of rows, the tile it falls in, or the
// thread count: 16 fp32 lanes accumulate VDPBF16PS over K in chunks of 32 (the last chunk
// zero-masked), then one horizontal sum, then + bias, + residual, one rounding to bf16.
//
// Tiling: threads split the N weight rows in blocks of 64 (a block stays in L2 while every group
// of up to 6 x rows passes over it); a micro-kernel holds 6 x 4 accumulators in registers and
// prefetches the next 4 weight rows as it streams the current ones.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "poss/linear_args.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define POSS_HAVE_AVX512BF16_KERNEL 1
#define POSS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace poss {
namespace {

constexpr int64_t kRowBlock = 64;  // weight rows per thread work unit
constexpr int kMaxRows = 6;        // x rows per micro-kernel
constexpr int kCols = 4;           // weight rows per micro-kernel

#ifdef POSS_HAVE_AVX512BF16_KERNEL

struct Epilogue {
  const c10::BFloat16* bias;      // [N] or null
  const c10::BFloat16* residual;  // [M, N] or null
  c10::BFloat16* out;             // [M, N]
  int64_t N;
};

// Rows m0..m0+MR of x against weight rows n..n+NR. x rows have stride K, like the weight rows.
template <int MR, int NR>
POSS_AVX512BF16 void micro(const uint16_t* x, const uint16_t* w, int64_t K, int64_t m0, int64_t n,
                           const Epilogue& e) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) xv[i] = (__m512bh)_mm512_loadu_si512(x + i * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * K + k);
      // The next micro-kernel's weight rows: the hardware prefetcher alone leaves DRAM idle
      // while several x rows are being multiplied.
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
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
  for (int i = 0; i < MR; ++i) {
    const int64_t row = (m0 + i) * e.N;
    for (int j = 0; j < NR; ++j) {
      float v = _mm512_reduce_add_ps(acc[i][j]);
      if (e.bias) v += static_cast<float>(e.bias[n + j]);
      if (e.residual) v += static_cast<float>(e.residual[row + n + j]);
      e.out[row + n + j] = c10::BFloat16(v);
    }
  }
}

// MR x rows (starting at row m0) against weight rows [n0, n1).
template <int MR>
POSS_AVX512BF16 void row_group(const uint16_t* x, const uint16_t* w, int64_t K, int64_t m0, int64_t n0,
                               int64_t n1, const Epilogue& e) {
  const uint16_t* xr = x + m0 * K;
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) micro<MR, kCols>(xr, w + n * K, K, m0, n, e);
  for (; n < n1; ++n) micro<MR, 1>(xr, w + n * K, K, m0, n, e);
}

POSS_AVX512BF16 void weight_block(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K, int64_t n0,
                                  int64_t n1, const Epilogue& e) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) row_group<kMaxRows>(x, w, K, m, n0, n1, e);
  switch (M - m) {
    case 1: row_group<1>(x, w, K, m, n0, n1, e); break;
    case 2: row_group<2>(x, w, K, m, n0, n1, e); break;
    case 3: row_group<3>(x, w, K, m, n0, n1, e); break;
    case 4: row_group<4>(x, w, K, m, n0, n1, e); break;
    case 5: row_group<5>(x, w, K, m, n0, n1, e); break;
    default: break;
  }
}

at::Tensor linear_avx512bf16(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual) {
  const int64_t K = x.size(-1), N = weight.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  const auto x2 = x.reshape({-1, K}).contiguous();
  const auto w = weight.contiguous();
  const int64_t M = x2.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out.view(out_shape);
  at::Tensor b, r;
  if (bias) b = bias->contiguous();
  if (residual) r = residual->reshape({M, N}).contiguous();
  const Epilogue e{bias ? b.const_data_ptr<c10::BFloat16>() : nullptr,
                   residual ? r.const_data_ptr<c10::BFloat16>() : nullptr, out.mutable_data_ptr<c10::BFloat16>(), N};
  const auto* xp = reinterpret_cast<const uint16_t*>(x2.const_data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.const_data_ptr<c10::BFloat16>());
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // Threads only pay beyond ~0.1 M multiply-adds per block; the split never changes a result.
  const int64_t grain = M * K * kRowBlock >= (1 << 17) ? 1 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      weight_block(xp, wp, M, K, blk * kRowBlock, std::min(N, (blk + 1) * kRowBlock), e);
    }
  });
  return out.view(out_shape);
}

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

#else

bool cpu_has_avx512_bf16() { return false; }

#endif

bool use_avx512bf16_kernel() {
  static const bool use = [] {
    const char* env = std::getenv("POSS_LINEAR");
    return cpu_has_avx512_bf16() && !(env != nullptr && std::strcmp(env, "aten") == 0);
  }();
  return use;
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual) {
  check_linear(x, weight, bias, residual);
#ifdef POSS_HAVE_AVX512BF16_KERNEL
  if (x.scalar_type() == at::kBFloat16 && use_avx512bf16_kernel()) {
    return linear_avx512bf16(x, weight, bias, residual);
  }
#endif
  return linear_aten(x, weight, bias, residual);
}

}  // namespace

const char* cpu_linear_kernel() { return use_avx512bf16_kernel() ? "avx512-bf16" : "aten"; }

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace poss
