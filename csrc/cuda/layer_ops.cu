// CUDA kernels of the decoder-layer building blocks: RMSNorm (+residual), SwiGLU and the fused
// QKV-split / RoPE / KV-cache write. The math is poss/layer_math.h, shared with the CPU kernels.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "poss/layer_args.h"
#include "poss/layer_math.h"

namespace poss {
namespace {

constexpr int kThreads = 256;

__device__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.0f;
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  const float total = warp_sums[0];
  __syncthreads();  // warp_sums is reused by the next call
  return total;
}

// One block per row. With a residual, the rounded sum is written first and re-read, so the norm
// sees exactly the value the next layer will.
template <typename scalar_t>
__global__ void rms_norm_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
                                const scalar_t* __restrict__ weight, scalar_t* __restrict__ out,
                                scalar_t* __restrict__ sum_out, int64_t H, float eps) {
  const int64_t row = blockIdx.x;
  const scalar_t* xr = x + row * H;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    float v = static_cast<float>(xr[i]);
    if (residual != nullptr) {
      const scalar_t s = static_cast<scalar_t>(v + static_cast<float>(residual[row * H + i]));
      sum_out[row * H + i] = s;
      v = static_cast<float>(s);
    }
    ss += v * v;
  }
  const float r = rms_inv(block_sum(ss), H, eps);
  const scalar_t* src = residual != nullptr ? sum_out + row * H : xr;
  for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
    out[row * H + i] =
        static_cast<scalar_t>(static_cast<float>(src[i]) * r * static_cast<float>(weight[i]));
  }
}

template <typename scalar_t>
__global__ void swiglu_kernel(const scalar_t* __restrict__ gu, scalar_t* __restrict__ out, int64_t rows,
                              int64_t F) {
  const int64_t n = rows * F;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / F, c = i % F;
    const float g = static_cast<float>(gu[r * 2 * F + c]);
    const float u = static_cast<float>(gu[r * 2 * F + F + c]);
    out[i] = static_cast<scalar_t>(silu(g) * u);
  }
}

// One block per (b, t); threads cover (head, frequency) pairs of q and k, then v's elements.
template <typename scalar_t>
__global__ void rope_qkv_kernel(const scalar_t* __restrict__ qkv, const int64_t* __restrict__ pos,
                                const float* __restrict__ inv_freq, scalar_t* __restrict__ q_out,
                                scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
                                const int32_t* __restrict__ start, int64_t T, int64_t S, int64_t D,
                                int64_t Hq, int64_t Hkv) {
  const int64_t bt = blockIdx.x, b = bt / T, t = bt % T, half = D / 2;
  const int64_t slot = static_cast<int64_t>(start[b]) + t;
  CUDA_KERNEL_ASSERT(slot >= 0 && slot < S && "start[b] + T must lie within the cache");
  // With device asserts compiled out, an out-of-range slot must not write into another head's or
  // request's cache rows (the host does not check: decoder_layer skips its host scan on CUDA).
  if (slot < 0 || slot >= S) return;
  const scalar_t* row = qkv + bt * (Hq + 2 * Hkv) * D;
  const int64_t p = pos[bt];
  for (int64_t j = threadIdx.x; j < (Hq + Hkv) * half; j += blockDim.x) {
    const int64_t h = j / half, i = j % half;
    double s, c;
    sincos(static_cast<double>(rope_angle(p, inv_freq[i])), &s, &c);
    float o1, o2;
    rope_rotate(static_cast<float>(row[h * D + i]), static_cast<float>(row[h * D + half + i]),
                static_cast<float>(c), static_cast<float>(s), o1, o2);
    scalar_t* dst = h < Hq ? q_out + ((b * Hq + h) * T + t) * D
                           : k_cache + ((b * Hkv + (h - Hq)) * S + slot) * D;
    dst[i] = static_cast<scalar_t>(o1);
    dst[half + i] = static_cast<scalar_t>(o2);
  }
  for (int64_t j = threadIdx.x; j < Hkv * D; j += blockDim.x) {
    const int64_t h = j / D, i = j % D;
    v_cache[((b * Hkv + h) * S + slot) * D + i] = row[(Hq + Hkv + h) * D + i];
  }
}

at::Tensor rms_norm_cuda(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_rms_args(x_in, w_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto w = w_in.contiguous();
  auto out = at::empty_like(x);
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cuda", [&] {
    rms_norm_kernel<scalar_t><<<rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), nullptr, H,
        static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x_in, const at::Tensor& r_in,
                                                     const at::Tensor& w_in, double eps) {
  check_rms_args(x_in, w_in);
  TORCH_CHECK(r_in.sizes() == x_in.sizes(), "residual must have x's shape ", shape_str(x_in),
              ", got ", shape_str(r_in));
  check_dtype(r_in, "residual", x_in.scalar_type());
  check_same_device(r_in, "residual", x_in, "x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto r = r_in.contiguous();
  const auto w = w_in.contiguous();
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  if (rows == 0) return {out, sum};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_cuda", [&] {
    rms_norm_kernel<scalar_t><<<rows, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        sum.data_ptr<scalar_t>(), H, static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, sum};
}

at::Tensor swiglu_cuda(const at::Tensor& gu_in) {
  check_swiglu_args(gu_in);
  const c10::cuda::CUDAGuard guard(gu_in.device());
  const auto gu = gu_in.contiguous();
  const int64_t F = gu.size(-1) / 2, rows = F == 0 ? 0 : gu.numel() / (2 * F);
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto out = at::empty(sizes, gu.options());
  if (rows * F == 0) return out;
  const int64_t blocks = std::min<int64_t>((rows * F + kThreads - 1) / kThreads, 65535);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "swiglu_cuda", [&] {
    swiglu_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, F);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor rope_qkv_cuda(const at::Tensor& qkv_in, const at::Tensor& pos_in, const at::Tensor& freq_in,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& start_in,
                         int64_t num_heads, int64_t num_kv_heads) {
  const int64_t D = check_rope_qkv_args(qkv_in, pos_in, freq_in, k_cache, v_cache, start_in, num_heads,
                                        num_kv_heads);
  const c10::cuda::CUDAGuard guard(qkv_in.device());
  const auto qkv = qkv_in.contiguous();
  const auto pos = pos_in.contiguous();
  const auto freq = freq_in.contiguous();
  const auto start = start_in.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), S = k_cache.size(2);
  auto q = at::empty({B, num_heads, T, D}, qkv.options());
  if (B * T == 0) return q;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv_cuda", [&] {
    rope_qkv_kernel<scalar_t><<<B * T, 128, 0, at::cuda::getCurrentCUDAStream()>>>(
        qkv.data_ptr<scalar_t>(), pos.data_ptr<int64_t>(), freq.data_ptr<float>(), q.data_ptr<scalar_t>(),
        k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), start.data_ptr<int32_t>(), T, S, D,
        num_heads, num_kv_heads);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
  m.impl("swiglu", &swiglu_cuda);
  m.impl("rope_qkv", &rope_qkv_cuda);
}

}  // namespace poss
