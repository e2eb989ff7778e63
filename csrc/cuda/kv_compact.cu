// CUDA kernel of poss::kv_compact: one launch for all layers, K and V. A thread owns one
// W-byte column group (W = 16 when alignment allows) of one (layer, request, head) row and walks
// the accepted path in increasing order, which is the in-place-safe order (poss/kv_compact.h);
// different column groups never interact, so they need no synchronisation. It is a byte copy, so
// one kernel serves every dtype.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "poss/kv_compact.h"
#include "poss/kv_compact_args.h"

namespace poss {
namespace {

constexpr int kThreads = 256;

struct CacheLayout {
  char* base;
  int64_t stride[4];  // bytes per step of L, B, Hkv, S
};

template <typename Unit>
__global__ void kv_compact_kernel(CacheLayout k, CacheLayout v, const int32_t* __restrict__ prefix_len,
                                  const int32_t* __restrict__ accept_nodes,
                                  const int32_t* __restrict__ accept_len, int64_t L, int32_t B,
                                  int32_t H, int32_t N, int64_t S, int64_t units_per_row,
                                  int64_t total) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  // idx = ((cache * L + l) * B + b) * H + h) * units + u, cache 0 = K, 1 = V.
  const int64_t u = idx % units_per_row;
  int64_t r = idx / units_per_row;
  const int64_t h = r % H;
  r /= H;
  const int64_t b = r % B;
  r /= B;
  const bool is_v = r >= L;
  const int64_t l = is_v ? r - L : r;
  const CacheLayout& c = is_v ? v : k;

  const int32_t* nodes = accept_nodes + b * N;
  const int32_t len = accept_len[b], prefix = prefix_len[b];
  const bool ok = check_compact(nodes, len, prefix, N, S).error == CompactError::kOk;
  CUDA_KERNEL_ASSERT(ok &&
                     "kv_compact: accept_len must be in [0, N), prefix_len >= 0, accept_nodes "
                     "strictly increasing from >= 0, < N, and prefix_len + node < S");
  if (!ok) return;

  char* row = c.base + l * c.stride[0] + b * c.stride[1] + h * c.stride[2] +
              u * static_cast<int64_t>(sizeof(Unit));
  for (int32_t j = 0; j <= len; ++j) {
    const int32_t a = nodes[j];
    if (a == j) continue;
    const Unit val = *reinterpret_cast<const Unit*>(row + (prefix + a) * c.stride[3]);
    *reinterpret_cast<Unit*>(row + (prefix + j) * c.stride[3]) = val;
  }
}

CacheLayout layout(const at::Tensor& t) {
  CacheLayout c{static_cast<char*>(t.data_ptr()), {}};
  for (int d = 0; d < 4; ++d) c.stride[d] = t.stride(d) * t.element_size();
  return c;
}

// The widest copy unit that divides a row and keeps every access aligned.
int unit_bytes(const at::Tensor& k, const at::Tensor& v) {
  const int64_t row = k.size(4) * k.element_size();
  for (int w : {16, 8, 4, 2}) {
    bool fits = row % w == 0;
    for (const at::Tensor* t : {&k, &v}) {
      fits = fits && reinterpret_cast<uintptr_t>(t->data_ptr()) % w == 0;
      for (int d = 0; d < 4; ++d) fits = fits && (t->stride(d) * t->element_size()) % w == 0;
    }
    if (fits) return w;
  }
  return 1;
}

template <typename Unit>
void launch(const at::Tensor& k, const at::Tensor& v, const at::Tensor& prefix_len,
            const at::Tensor& accept_nodes, const at::Tensor& accept_len) {
  const int64_t L = k.size(0), B = k.size(1), H = k.size(2), S = k.size(3);
  const int64_t units = k.size(4) * k.element_size() / static_cast<int64_t>(sizeof(Unit));
  const int64_t total = 2 * L * B * H * units;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "kv_compact: cache too large (",
              total, " copy units)");
  kv_compact_kernel<Unit><<<static_cast<unsigned>(blocks), kThreads, 0,
                            c10::cuda::getCurrentCUDAStream()>>>(
      layout(k), layout(v), prefix_len.data_ptr<int32_t>(), accept_nodes.data_ptr<int32_t>(),
      accept_len.data_ptr<int32_t>(), L, static_cast<int32_t>(B), static_cast<int32_t>(H),
      static_cast<int32_t>(accept_nodes.size(1)), S, units, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void kv_compact_cuda(const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& prefix_len_in, const at::Tensor& accept_nodes_in,
                     const at::Tensor& accept_len_in) {
  const auto [L, B, H, S, D, N] =
      check_kv_compact_args(k_cache, v_cache, prefix_len_in, accept_nodes_in, accept_len_in);
  TORCH_CHECK(N <= std::numeric_limits<int32_t>::max() && B <= std::numeric_limits<int32_t>::max() &&
                  H <= std::numeric_limits<int32_t>::max(),
              "kv_compact: B, Hkv and N must fit in int32");
  if (L * B * H * D == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const at::Tensor prefix_len = prefix_len_in.contiguous(),
                   accept_nodes = accept_nodes_in.contiguous(),
                   accept_len = accept_len_in.contiguous();
  switch (unit_bytes(k_cache, v_cache)) {
    case 16: launch<uint4>(k_cache, v_cache, prefix_len, accept_nodes, accept_len); break;
    case 8: launch<uint2>(k_cache, v_cache, prefix_len, accept_nodes, accept_len); break;
    case 4: launch<uint32_t>(k_cache, v_cache, prefix_len, accept_nodes, accept_len); break;
    case 2: launch<uint16_t>(k_cache, v_cache, prefix_len, accept_nodes, accept_len); break;
    default: launch<uint8_t>(k_cache, v_cache, prefix_len, accept_nodes, accept_len); break;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) { m.impl("kv_compact", &kv_compact_cuda); }

}  // namespace poss
