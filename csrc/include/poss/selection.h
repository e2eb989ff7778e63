// Order-preserving integer keys for floats, used to select top-k / top-p thresholds by radix
// histograms (CPU) or by bisection over the key space (CUDA).
#pragma once

#include <cstdint>
#include <cstring>

#include "poss/macros.h"

namespace poss {

// Maps a float to a uint32 whose unsigned order equals the float order (-inf lowest, NaN excluded).
POSS_HD uint32_t ordered_key(float f) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(f);
#else
  std::memcpy(&bits, &f, sizeof(bits));
#endif
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

POSS_HD float key_to_float(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

}  // namespace poss
