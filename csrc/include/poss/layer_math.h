// Scalar math of the decoder-layer kernels, shared by the CPU and CUDA implementations so both
// round the same way: statistics and rotations in fp32, one rounding to the storage dtype.
#pragma once

#include <cmath>
#include <cstdint>

#include "poss/macros.h"

namespace poss {

POSS_HD float silu(float x) { return x / (1.0f + expf(-x)); }

// 1 / sqrt(mean square + eps), as HF's RMSNorm computes it in fp32.
POSS_HD float rms_inv(float sum_sq, int64_t n, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps);
}

// The RoPE angle of one frequency, in fp32 like HF (inv_freq * position); its cos/sin are taken in
// double because positions reach thousands of radians, where fast fp32 sin/cos lose digits.
POSS_HD float rope_angle(int64_t position, float inv_freq) {
  return static_cast<float>(position) * inv_freq;
}

// Rotate-half RoPE: element i pairs with i + D/2 and both turn by the same angle. Each product is
// rounded before the sum, as the CPU's vector path does: nvcc would otherwise fuse one product and
// the sum into an FMA (-fmad=true) and round differently in the last bit.
POSS_HD void rope_rotate(float x1, float x2, float c, float s, float& o1, float& o2) {
#ifdef __CUDA_ARCH__
  o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
#else
  o1 = x1 * c - x2 * s;
  o2 = x2 * c + x1 * s;
#endif
}

}  // namespace poss
