// CUDA kernel of poss::tree_verify: one thread block per request. Every thread runs the shared
// acceptance walk (csrc/include/poss/acceptance.h) with block-wide reductions over the vocabulary;
// thread 0 alone writes the results. Only the rows on the walked path are read.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "poss/acceptance.h"
#include "poss/selection.h"
#include "poss/tree.h"
#include "poss/tree_verify_args.h"

namespace poss {
namespace {

constexpr int kThreads = 512;

struct ArgMax {
  float value;
  int64_t index;  // -1 = nothing seen yet
};

struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (a.index < 0) return b;
    if (b.index < 0) return a;
    if (a.value > b.value || (a.value == b.value && a.index < b.index)) return a;
    return b;
  }
};

// Block-collective reductions; every thread receives the result.
struct BlockOps {
  union Storage {
    typename cub::BlockReduce<ArgMax, kThreads>::TempStorage argmax;
    typename cub::BlockReduce<double, kThreads>::TempStorage sum;
    typename cub::BlockReduce<float, kThreads>::TempStorage fmax;
    typename cub::BlockReduce<int64_t, kThreads>::TempStorage imax;
    typename cub::BlockScan<double, kThreads>::TempStorage scan;
  };
  Storage& storage;
  ArgMax& argmax_out;
  double& double_out;
  float& float_out;
  int64_t& int_out;

  // Thread 0 holds a block reduction's result; hand it to every thread through shared memory.
  template <typename T>
  __device__ T broadcast(T value, T& slot) {
    if (threadIdx.x == 0) slot = value;
    __syncthreads();
    value = slot;
    __syncthreads();
    return value;
  }

  __device__ ArgMax argmax(ArgMax v) {
    return broadcast(cub::BlockReduce<ArgMax, kThreads>(storage.argmax).Reduce(v, ArgMaxOp()),
                     argmax_out);
  }
  __device__ double sum(double v) {
    return broadcast(cub::BlockReduce<double, kThreads>(storage.sum).Sum(v), double_out);
  }
  __device__ float max(float v) {
    // fmaxf drops NaN; NaN is detected separately by the callers.
    auto op = [](float a, float b) { return fmaxf(a, b); };
    return broadcast(cub::BlockReduce<float, kThreads>(storage.fmax).Reduce(v, op), float_out);
  }
  __device__ int64_t max_index(int64_t v) {
    auto op = [](int64_t a, int64_t b) { return a > b ? a : b; };
    return broadcast(cub::BlockReduce<int64_t, kThreads>(storage.imax).Reduce(v, op), int_out);
  }
};

template <typename scalar_t>
struct CudaGreedyRow {
  const scalar_t* logits;  // [N, V] rows of one request
  int64_t V;
  BlockOps& ops;

  __device__ int64_t argmax(int32_t node) {
    const scalar_t* row = logits + node * V;
    ArgMax best{-INFINITY, -1};
    int nan = 0;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float v = static_cast<float>(row[i]);
      nan |= isnan(v);
      if (best.index < 0 || v > best.value) best = {v, i};
    }
    CUDA_KERNEL_ASSERT(!nan && "tree_verify: logits row contains NaN");
    return ops.argmax(best).index;
  }
};

template <typename scalar_t>
struct CudaSamplingRow {
  const scalar_t* logits;  // [N, V]
  int64_t V;
  float* w;  // [V] processed, unnormalised target distribution of the current node
  BlockOps& ops;

  // Largest key t with weight({key(v) >= t}) >= target, by bisection over the 32-bit key space.
  template <bool kMass, typename Load>
  __device__ uint32_t select_key(Load load, double target) {
    uint32_t lo = 0, hi = 0xffffffffu;
    while (lo < hi) {
      const uint32_t mid = lo + (hi - lo) / 2 + 1;
      double part = 0.0;
      for (int64_t i = threadIdx.x; i < V; i += kThreads) {
        const float v = load(i);
        if (ordered_key(v) >= mid) part += kMass ? v : 1.0;
      }
      if (ops.sum(part) >= target) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  __device__ double softmax_top_k(int32_t node, float temperature, int32_t top_k) {
    const scalar_t* row = logits + node * V;
    auto logit = [&](int64_t i) { return static_cast<float>(row[i]); };
    float m = -INFINITY;
    int nan = 0;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float v = logit(i);
      nan |= isnan(v);
      m = fmaxf(m, v);
    }
    CUDA_KERNEL_ASSERT(!nan && "tree_verify: logits row contains NaN");
    m = ops.max(m);
    CUDA_KERNEL_ASSERT(isfinite(m) && "tree_verify: logits row has no finite maximum");
    float keep_from = -INFINITY;
    if (top_k > 0 && top_k < V) keep_from = key_to_float(select_key<false>(logit, top_k));
    const float scale = 1.0f / temperature;
    double part = 0.0;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float v = logit(i);
      const float e = v >= keep_from ? expf((v - m) * scale) : 0.0f;
      w[i] = e;
      part += e;
    }
    return ops.sum(part);
  }

  // Every thread touches the same strided indices of w as softmax_top_k wrote, and each block
  // reduction synchronises, so no extra barrier is needed between these steps.
  __device__ float mass_floor(double target) {
    auto mass = [&](int64_t i) { return w[i]; };
    return key_to_float(select_key<true>(mass, target));
  }

  __device__ float max_weight() {
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) m = fmaxf(m, w[i]);
    return ops.max(m);
  }

  __device__ double keep_at_least(float floor) {
    double part = 0.0;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      if (w[i] < floor) w[i] = 0.0f;
      part += w[i];
    }
    return ops.sum(part);
  }

  // Only thread 0 validates the tree (a device assert), and the others do not wait for it: a token
  // outside the vocabulary weighs nothing here instead of reading another request's row.
  __device__ double weight(int64_t token) const { return token >= 0 && token < V ? w[token] : 0.0; }

  __device__ void remove(int64_t token) {
    __syncthreads();
    if (threadIdx.x == 0 && token >= 0 && token < V) w[token] = 0.0f;
    __syncthreads();
  }

  // Inverse CDF: each thread owns a contiguous chunk, a block scan gives the chunk offsets.
  __device__ int64_t sample(float u) {
    const int64_t chunk = (V + kThreads - 1) / kThreads;
    const int64_t start = static_cast<int64_t>(threadIdx.x) * chunk;
    const int64_t lo = start < V ? start : V, hi = lo + chunk < V ? lo + chunk : V;
    double part = 0.0;
    int64_t last_positive = -1;
    for (int64_t i = lo; i < hi; ++i) {
      part += w[i];
      if (w[i] > 0.0f) last_positive = i;
    }
    double offset;
    cub::BlockScan<double, kThreads>(ops.storage.scan).ExclusiveSum(part, offset);
    __syncthreads();
    const double total = ops.sum(part);
    if (!(total > 0.0)) return -1;
    const double target = static_cast<double>(u) * total;
    int64_t found = -1;
    if (offset <= target && target < offset + part) {
      double cum = offset;
      for (int64_t i = lo; i < hi && found < 0; ++i) {
        cum += w[i];
        if (w[i] > 0.0f && cum > target) found = i;
      }
      // The chunk's own running sum can round below offset + part: the target is still in this
      // chunk, so its last token with mass, not the vocabulary's.
      if (found < 0) found = last_positive;
    }
    found = ops.max_index(found);
    // Rounding can leave the target past the last element: take the last token with mass.
    return found >= 0 ? found : ops.max_index(last_positive);
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    tree_verify_kernel(const int32_t* __restrict__ parents, const int64_t* __restrict__ tokens,
                       const scalar_t* __restrict__ logits, const float* __restrict__ temperature,
                       const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                       const float* __restrict__ min_p, const float* __restrict__ uniforms, float* __restrict__ workspace,
                       int32_t N, int64_t V, int32_t* accept_nodes, int32_t* accept_len,
                       int64_t* next_token) {
  __shared__ typename BlockOps::Storage storage;
  __shared__ ArgMax argmax_out;
  __shared__ double double_out;
  __shared__ float float_out;
  __shared__ int64_t int_out;
  BlockOps ops{storage, argmax_out, double_out, float_out, int_out};

  const int64_t b = blockIdx.x;
  const TreeView tree{parents + b * N, tokens + b * N, N};
  if (threadIdx.x == 0) {
    CUDA_KERNEL_ASSERT(validate_tree(tree, V).error == TreeError::kOk &&
                       "tree_verify: parents/tokens break the tree encoding or the vocabulary range");
  }
  const WalkOutput out{accept_nodes + b * N, accept_len + b, next_token + b, threadIdx.x == 0};
  const scalar_t* rows = logits + b * N * V;
  const SamplingParams sp{temperature ? temperature[b] : 0.0f, top_k ? top_k[b] : 0,
                          top_p ? top_p[b] : 1.0f, min_p ? min_p[b] : 0.0f};
  // Every row's parameters and uniforms, greedy rows included, as the CPU kernel checks them: a NaN
  // or negative temperature is an error, not a greedy row.
  CUDA_KERNEL_ASSERT(isfinite(sp.temperature) && sp.temperature >= 0.0f && sp.top_k >= 0 &&
                     sp.top_p > 0.0f && sp.top_p <= 1.0f && sp.min_p >= 0.0f && sp.min_p <= 1.0f &&
                     "tree_verify: temperature/top_k/top_p/min_p out of range");
  const float* u = uniforms ? uniforms + b * (N + 1) : nullptr;
  if (u && threadIdx.x == 0) {
    for (int32_t i = 0; i <= N; ++i) {
      CUDA_KERNEL_ASSERT(u[i] >= 0.0f && u[i] < 1.0f && "tree_verify: uniforms must be in [0, 1)");
    }
  }
  if (is_greedy(sp.temperature)) {
    CudaGreedyRow<scalar_t> row{rows, V, ops};
    greedy_walk(tree, row, out);
    return;
  }
  CudaSamplingRow<scalar_t> row{rows, V, workspace + b * V, ops};
  sampling_walk(tree, row, u, sp, out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_cuda(
    const at::Tensor& parents_in, const at::Tensor& tokens_in, const at::Tensor& logits_in,
    const std::optional<at::Tensor>& temperature_in, const std::optional<at::Tensor>& top_k_in,
    const std::optional<at::Tensor>& top_p_in, const std::optional<at::Tensor>& uniforms_in,
    const std::optional<at::Tensor>& min_p_in) {
  const auto [B, N, V] = check_tree_verify_args(parents_in, tokens_in, logits_in, temperature_in,
                                                top_k_in, top_p_in, uniforms_in, min_p_in);
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous(), tokens = tokens_in.contiguous(),
                   logits = logits_in.contiguous();
  auto maybe = [](const std::optional<at::Tensor>& t) {
    return t ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
  };
  const auto temperature = maybe(temperature_in), top_k = maybe(top_k_in), top_p = maybe(top_p_in),
             uniforms = maybe(uniforms_in), min_p = maybe(min_p_in);
  const auto opts = parents.options();
  at::Tensor accept_nodes = at::empty({B, N}, opts);
  at::Tensor accept_len = at::empty({B}, opts);
  at::Tensor next_token = at::empty({B}, opts.dtype(at::kLong));
  if (B == 0) return {accept_nodes, accept_len, next_token};
  // Greedy requests never touch the workspace; it is only needed when something may sample.
  at::Tensor workspace = uniforms ? at::empty({B, V}, opts.dtype(at::kFloat)) : at::Tensor();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "tree_verify_cuda",
                                  [&] {
    tree_verify_kernel<scalar_t><<<B, kThreads, 0, stream>>>(
        parents.data_ptr<int32_t>(), tokens.data_ptr<int64_t>(), logits.data_ptr<scalar_t>(),
        temperature ? temperature->data_ptr<float>() : nullptr,
        top_k ? top_k->data_ptr<int32_t>() : nullptr, top_p ? top_p->data_ptr<float>() : nullptr,
        min_p ? min_p->data_ptr<float>() : nullptr, uniforms ? uniforms->data_ptr<float>() : nullptr,
        workspace.defined() ? workspace.data_ptr<float>() : nullptr, static_cast<int32_t>(N), V,
        accept_nodes.data_ptr<int32_t>(), accept_len.data_ptr<int32_t>(),
        next_token.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_nodes, accept_len, next_token};
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) { m.impl("tree_verify", &tree_verify_cuda); }

}  // namespace poss
