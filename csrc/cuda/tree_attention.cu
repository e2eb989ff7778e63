// CUDA kernel of poss::tree_attention, cascade style (SGLang): the prefix is split into chunks
// across thread blocks (split-K) and attended without a mask; the small tree part is a separate
// block with the ancestor mask; a merge kernel combines the partial results by log-sum-exp.
// When (request, kv head, row tile) blocks already fill the GPU (long chains: prefill), one
// block walks its whole key range and writes the output directly, with no workspace.
//
// Rows of a GQA group are node-major (row = query * G + g): a row tile covers few consecutive
// nodes of all G heads, so each K/V tile staged in shared memory serves all of them, and a
// chain's causal key range per tile stays tight.
//
// Everything runs on the current stream; tree values and prefix_len are checked with device
// asserts, never read on the host.
#include <ATen/ATen.h>
// Not ATen/cuda/CUDAContext.h: it pulls in cusparse.h, which a bare CUDA toolkit may lack.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>

#include "poss/tree_attention.h"
#include "poss/tree_attention_args.h"

namespace poss {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 256;

template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float(at::BFloat16 x) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&x));
}
template <> __device__ __forceinline__ float to_float(at::Half x) {
  return __half2float(*reinterpret_cast<const __half*>(&x));
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Per request: validates the tree, finds n_real and whether it is a chain, and (general trees)
// builds the ancestor masks with the shared host/device routine. info[b] = {n_real, chain}.
__global__ void scan_tree_kernel(const int32_t* __restrict__ parents, int32_t N,
                                 const int32_t* __restrict__ prefix_len, int64_t S,
                                 int2* __restrict__ info, uint64_t* __restrict__ masks) {
  const int b = blockIdx.x;
  const int32_t* par = parents + static_cast<int64_t>(b) * N;
  __shared__ int first_pad;
  if (threadIdx.x == 0) first_pad = N;
  __syncthreads();
  for (int i = 1 + threadIdx.x; i < N; i += blockDim.x) {
    if (par[i] == kPadParent) atomicMin(&first_pad, i);
  }
  __syncthreads();
  const int n_real = first_pad;
  bool chain = true;
  for (int i = 1 + threadIdx.x; i < N; i += blockDim.x) {
    const int32_t p = par[i];
    if (i < n_real) {
      CUDA_KERNEL_ASSERT(p >= 0 && p < i && "parents: a real node's parent must be in [0, i)");
      chain = chain && p == i - 1;
    } else {
      CUDA_KERNEL_ASSERT(p == kPadParent && "parents: padding nodes (-2) must come last");
    }
  }
  chain = __syncthreads_and(chain);
  if (threadIdx.x == 0) {
    CUDA_KERNEL_ASSERT(par[0] == kRootParent && "parents[b, 0] must be -1 (the root)");
    CUDA_KERNEL_ASSERT((chain || n_real <= kAttnMaxTreeNodes) &&
                       "parents: general (non-chain) trees have at most 256 real nodes");
    CUDA_KERNEL_ASSERT(prefix_len[b] >= 0 && prefix_len[b] + n_real <= S &&
                       "prefix_len[b] must be >= 0 and leave room for the tree in k_cache");
    info[b] = make_int2(n_real, chain ? 1 : 0);
    if (!chain && n_real <= kAttnMaxTreeNodes) {
      build_ancestor_masks(par, n_real,
                           masks + static_cast<int64_t>(b) * kAttnMaxTreeNodes * kAttnMaskWords);
    }
  }
}

struct AttnParams {
  int64_t B, Hq, Hkv, G, Nq, N, S;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;  // element strides of k/v (D has unit stride)
  float scale;
  int32_t num_prefix_splits;  // 0: fused mode (one block per row tile, direct output)
  int64_t prefix_chunk;       // keys per prefix split
  int64_t rows;               // G * Nq rows per (b, h)
};

// One block: rows [tile * R, tile * R + R) of group (b, h) over one key range. Each warp owns
// R / kWarps rows; a lane owns key `lane` of a tile for scores and dims lane + 32c of the output.
template <typename scalar_t, int D, int R, int T>
__global__ void __launch_bounds__(kThreads)
tree_attention_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                      const scalar_t* __restrict__ v, const int32_t* __restrict__ prefix_len,
                      const int2* __restrict__ info, const uint64_t* __restrict__ masks,
                      AttnParams p, scalar_t* __restrict__ out, float* __restrict__ ws_out,
                      float2* __restrict__ ws_state) {
  constexpr int RPW = R / kWarps, DPL = (D + 31) / 32;  // D = 80, 96: the last slice is partial
  static_assert(R % kWarps == 0 && T <= 32, "tile shape");
  __shared__ float q_s[R][D];
  __shared__ float k_s[T][D + 1];  // +1: lane-per-key reads are conflict-free
  __shared__ float v_s[T][D];

  const int tile = blockIdx.z, split = blockIdx.y;
  const int64_t bh = blockIdx.x, b = bh / p.Hkv, h = bh % p.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int2 inf = info[b];
  const bool chain = inf.y != 0;
  // Should the device asserts be compiled out, invalid input still stays in bounds.
  const int32_t n_real = (!chain && inf.x > kAttnMaxTreeNodes) ? 0 : inf.x;
  const int64_t P = max64(0, min64(prefix_len[b], p.S - n_real));
  const int64_t q0 = p.N - p.Nq;
  const uint64_t* mrows = masks + b * kAttnMaxTreeNodes * kAttnMaskWords;

  // Key range of this block: prefix slots [k_lo, k_hi), then tree keys [0, tree_hi).
  const int64_t row0 = static_cast<int64_t>(tile) * R;
  const int64_t last_row = min64(row0 + R, p.rows) - 1;
  const int32_t last_node = static_cast<int32_t>(q0 + last_row / p.G);
  int64_t k_lo = 0, k_hi = P;
  int32_t tree_hi = n_real < last_node + 1 ? n_real : last_node + 1;
  if (p.num_prefix_splits > 0) {
    if (split < p.num_prefix_splits) {
      k_lo = min64(P, split * p.prefix_chunk);
      k_hi = min64(P, k_lo + p.prefix_chunk);
      tree_hi = 0;
    } else {
      k_hi = 0;
    }
  }

  // Stage this block's queries, pre-scaled, in fp32.
  for (int idx = threadIdx.x; idx < R * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    const int64_t row = row0 + r;
    float x = 0.0f;
    if (row < p.rows) {
      const int64_t node = row / p.G, g = row % p.G;
      x = to_float(q[(((b * p.Hq + h * p.G + g) * p.Nq) + node) * D + d]) * p.scale;
    }
    q_s[r][d] = x;
  }

  // Fully unrolled loops over rr and c keep these arrays in registers.
  float acc[RPW][DPL];
  SoftmaxState st[RPW];
  int32_t node_of[RPW];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t row = row0 + warp * RPW + rr;
    node_of[rr] = row < p.rows ? static_cast<int32_t>(q0 + row / p.G) : n_real;  // n_real: none
    st[rr] = SoftmaxState{-INFINITY, 0.0f};
#pragma unroll
    for (int c = 0; c < DPL; ++c) acc[rr][c] = 0.0f;
  }

  const scalar_t* kb = k + b * p.ks0 + h * p.ks1;
  const scalar_t* vb = v + b * p.vs0 + h * p.vs1;
  const int64_t prefix_keys = k_hi - k_lo;
  // A tile of padding queries only reads nothing.
  const int64_t total = q0 + row0 / p.G >= n_real ? 0 : prefix_keys + tree_hi;
  for (int64_t t0 = 0; t0 < total; t0 += T) {
    __syncthreads();  // previous tile consumed (and q_s written, first time)
    for (int idx = threadIdx.x; idx < T * D; idx += kThreads) {
      const int kk = idx / D, d = idx % D;
      const int64_t key = t0 + kk;
      float kx = 0.0f, vx = 0.0f;
      if (key < total) {
        const int64_t slot = key < prefix_keys ? k_lo + key : P + (key - prefix_keys);
        kx = to_float(kb[slot * p.ks2 + d]);
        vx = to_float(vb[slot * p.vs2 + d]);
      }
      k_s[kk][d] = kx;
      v_s[kk][d] = vx;
    }
    __syncthreads();

    const int64_t key = t0 + lane;
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int32_t i = node_of[rr];
      if (i >= n_real) continue;  // padding row (warp-uniform)
      bool visible = lane < T && key < total;
      if (visible && key >= prefix_keys) {
        const int32_t j = static_cast<int32_t>(key - prefix_keys);
        visible = tree_key_visible(chain, mrows + static_cast<int64_t>(i) * kAttnMaskWords, i, j);
      }
      float s = -INFINITY;
      if (visible) {
        const float* qr = q_s[warp * RPW + rr];
        s = 0.0f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) s = fmaf(qr[d], k_s[lane][d], s);
      }
      const float m = softmax_new_max(st[rr], warp_max(s));
      if (m == -INFINITY) continue;  // nothing visible to this row yet
      const float pr = visible ? __expf(s - m) : 0.0f;
      const float corr = softmax_absorb(st[rr], m, warp_sum(pr));
#pragma unroll
      for (int c = 0; c < DPL; ++c) acc[rr][c] *= corr;
      for (int kk = 0; kk < T; ++kk) {
        const float pk = __shfl_sync(0xffffffffu, pr, kk);
        if (pk == 0.0f) continue;  // warp-uniform
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          if (lane + 32 * c < D) acc[rr][c] = fmaf(pk, v_s[kk][lane + 32 * c], acc[rr][c]);
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int64_t row = row0 + warp * RPW + rr;
    if (row >= p.rows) continue;
    if (p.num_prefix_splits == 0) {
      const int64_t node = row / p.G, g = row % p.G;
      scalar_t* dst = out + (((b * p.Hq + h * p.G + g) * p.Nq) + node) * D;
      const float inv = st[rr].l > 0.0f ? 1.0f / st[rr].l : 0.0f;  // padding rows: zeros
#pragma unroll
      for (int c = 0; c < DPL; ++c) {
        if (lane + 32 * c < D) dst[lane + 32 * c] = static_cast<scalar_t>(acc[rr][c] * inv);
      }
    } else {
      const int64_t slot = (bh * gridDim.y + split) * p.rows + row;
      if (lane == 0) ws_state[slot] = make_float2(st[rr].m, st[rr].l);
      if (st[rr].l > 0.0f) {
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          if (lane + 32 * c < D) ws_out[slot * D + lane + 32 * c] = acc[rr][c];
        }
      }
    }
  }
}

// One warp per output row: log-sum-exp merge of the splits' partial results.
template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
merge_kernel(const float* __restrict__ ws_out, const float2* __restrict__ ws_state,
             AttnParams p, int32_t splits, scalar_t* __restrict__ out) {
  constexpr int DPL = (D + 31) / 32;
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (gw >= p.B * p.Hkv * p.rows) return;
  const int64_t bh = gw / p.rows, row = gw % p.rows;
  const int64_t b = bh / p.Hkv, h = bh % p.Hkv;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    const float2 x = ws_state[(bh * splits + s) * p.rows + row];
    m = merge_max(m, SoftmaxState{x.x, x.y});
  }
  float o[DPL] = {};
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const int64_t slot = (bh * splits + s) * p.rows + row;
    const float2 x = ws_state[slot];
    const float w = x.y > 0.0f ? merge_weight(SoftmaxState{x.x, x.y}, m) : 0.0f;
    if (w == 0.0f) continue;
    l += w * x.y;
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      if (lane + 32 * c < D) o[c] += w * ws_out[slot * D + lane + 32 * c];
    }
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  const int64_t node = row / p.G, g = row % p.G;
  scalar_t* dst = out + (((b * p.Hq + h * p.G + g) * p.Nq) + node) * D;
#pragma unroll
  for (int c = 0; c < DPL; ++c) {
    if (lane + 32 * c < D) dst[lane + 32 * c] = static_cast<scalar_t>(o[c] * inv);
  }
}

template <typename scalar_t, int D>
void launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& prefix_len, const at::Tensor& info, const at::Tensor& masks,
            AttnParams p, at::Tensor& out) {
  // D = 256 keeps the block's shared memory under 48 KiB with fewer rows and keys per tile.
  constexpr int R = D > 128 ? 8 : 16;
  constexpr int T = D > 128 ? 16 : 32;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t tiles = (p.rows + R - 1) / R;
  const int64_t groups = p.B * p.Hkv;
  int sms = 0;  // an attribute query: no synchronisation
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
  // Split the prefix only when the row tiles alone leave SMs idle; chunks cover [0, S) since
  // prefix_len stays on the device (splits past a short prefix exit at once).
  int32_t nsp = 0;
  if (groups * tiles < 2 * sms) {
    const int64_t want = (2 * sms + groups * tiles - 1) / (groups * tiles);
    nsp = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(want, (p.S + 4 * T - 1) / (4 * T))));
    nsp = std::min<int32_t>(nsp, 64);
    p.prefix_chunk = (p.S + nsp - 1) / nsp;
  }
  p.num_prefix_splits = nsp;
  const int splits = nsp == 0 ? 1 : nsp + 1;
  at::Tensor ws_out, ws_state;
  if (nsp > 0) {
    ws_out = at::empty({groups * splits * p.rows * D}, q.options().dtype(at::kFloat));
    ws_state = at::empty({groups * splits * p.rows * 2}, q.options().dtype(at::kFloat));
  }
  // (B * Hkv) groups on x, whose limit is 2^31 - 1: y and z stop at 65,535 (2,048 requests of a
  // 32-KV-head model). Row tiles on z reach 65,535 only past 524k query rows; splits <= 65.
  const dim3 grid(static_cast<unsigned>(groups), splits, static_cast<unsigned>(tiles));
  tree_attention_kernel<scalar_t, D, R, T><<<grid, kThreads, 0, stream>>>(
      q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
      prefix_len.data_ptr<int32_t>(), reinterpret_cast<const int2*>(info.data_ptr<int32_t>()),
      reinterpret_cast<const uint64_t*>(masks.data_ptr<int64_t>()), p, out.data_ptr<scalar_t>(),
      nsp > 0 ? ws_out.data_ptr<float>() : nullptr,
      nsp > 0 ? reinterpret_cast<float2*>(ws_state.data_ptr<float>()) : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (nsp > 0) {
    const int64_t warps = groups * p.rows;
    const unsigned blocks = static_cast<unsigned>((warps * 32 + kThreads - 1) / kThreads);
    merge_kernel<scalar_t, D><<<blocks, kThreads, 0, stream>>>(
        ws_out.data_ptr<float>(), reinterpret_cast<const float2*>(ws_state.data_ptr<float>()), p,
        splits, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, const at::Tensor& prefix_len_in,
                               const at::Tensor& parents_in, double scale) {
  const auto [B, Hq, Hkv, Nq, N, S, D] =
      check_tree_attention_args(q_in, k_in, v_in, prefix_len_in, parents_in, scale);
  TORCH_CHECK(q_in.is_cuda(), "q must be a CUDA tensor, got ", q_in.device());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const at::Tensor parents = parents_in.contiguous(), prefix_len = prefix_len_in.contiguous();
  at::Tensor out = at::empty_like(q);
  if (out.numel() == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();

  const at::Tensor info = at::empty({B, 2}, parents.options());
  const at::Tensor masks =
      at::empty({B, kAttnMaxTreeNodes, kAttnMaskWords}, parents.options().dtype(at::kLong));
  scan_tree_kernel<<<static_cast<unsigned>(B), kScanThreads, 0, stream>>>(
      parents.data_ptr<int32_t>(), static_cast<int32_t>(N), prefix_len.data_ptr<int32_t>(), S,
      reinterpret_cast<int2*>(info.data_ptr<int32_t>()),
      reinterpret_cast<uint64_t*>(masks.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  AttnParams p{B, Hq, Hkv, Hq / Hkv, Nq, N, S,
               k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
               static_cast<float>(scale), 0, 0, (Hq / Hkv) * Nq};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tree_attention_cuda",
                                  [&] {
    switch (D) {
      case 64: launch<scalar_t, 64>(q, k, v, prefix_len, info, masks, p, out); break;
      case 80: launch<scalar_t, 80>(q, k, v, prefix_len, info, masks, p, out); break;
      case 96: launch<scalar_t, 96>(q, k, v, prefix_len, info, masks, p, out); break;
      case 128: launch<scalar_t, 128>(q, k, v, prefix_len, info, masks, p, out); break;
      default: launch<scalar_t, 256>(q, k, v, prefix_len, info, masks, p, out); break;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) { m.impl("tree_attention", &tree_attention_cuda); }

}  // namespace poss
