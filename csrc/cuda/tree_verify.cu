// CUDA kernel of poss::tree_verify, split across the vocabulary: a grid of (request, chunk) thread
// blocks. Each block owns one chunk of V (csrc/include/poss/vocab_split.h) and runs the shared
// acceptance walk (csrc/include/poss/acceptance.h): every vocabulary-wide step is a block-wide
// partial over its chunk, written to global memory, a barrier among the request's blocks, and a
// combine of the C partials in chunk order that every block computes alike. So all blocks of a
// request see the same values and walk the same path; block 0's thread 0 alone writes the results.
// Only the rows on the walked path are read.
//
// The barrier needs every block of the grid resident at once: with more than one chunk the kernel
// is launched cooperatively (the launch fails rather than deadlocks if they would not fit), and the
// chunk count is bounded by the resident blocks per request (plan_vocab_chunks).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "poss/acceptance.h"
#include "poss/selection.h"
#include "poss/tree.h"
#include "poss/tree_verify_args.h"
#include "poss/vocab_split.h"

namespace poss {
namespace {

constexpr int kThreads = 512;

struct ArgMaxOp {
  __device__ ArgMaxPartial operator()(const ArgMaxPartial& a, const ArgMaxPartial& b) const {
    return better_argmax(a, b);
  }
};

// Block-collective reductions; every thread receives the result.
struct BlockOps {
  union Storage {
    typename cub::BlockReduce<ArgMaxPartial, kThreads>::TempStorage argmax;
    typename cub::BlockReduce<double, kThreads>::TempStorage sum;
    typename cub::BlockReduce<float, kThreads>::TempStorage fmax;
    typename cub::BlockReduce<int64_t, kThreads>::TempStorage imax;
    typename cub::BlockScan<double, kThreads>::TempStorage scan;
  };
  Storage& storage;
  ArgMaxPartial& argmax_out;
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

  __device__ ArgMaxPartial argmax(ArgMaxPartial v) {
    return broadcast(
        cub::BlockReduce<ArgMaxPartial, kThreads>(storage.argmax).Reduce(v, ArgMaxOp()),
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

// One chunk's partial results of one step. Written by its block, read by all blocks of the request.
struct ChunkPartial {
  double sum;
  float max;
  ArgMaxPartial argmax;
  double hist[kRadixBins];
};

// Reads of what other blocks wrote go to L2 (ld.global.cg), past this SM's possibly stale L1.
__device__ double load_cg(const double* p) { return __ldcg(p); }
__device__ float load_cg(const float* p) { return __ldcg(p); }
__device__ int64_t load_cg(const int64_t* p) {
  return static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(p)));
}

// The exchange of partials among the C blocks of one request.
struct ChunkExchange {
  ChunkPartial* parts;     // [2, C]: two sets, alternating by barrier, of this request
  unsigned int* arrivals;  // this request's barrier counter, zero at launch
  int32_t count;           // C
  int32_t chunk;           // this block's chunk
  unsigned int phase;      // barriers passed so far (the same in every thread of every block)

  // This block's slot for the current step. Two sets alternate: a block writes set (phase & 1)
  // only after the barrier that closed the previous use of that set, when every block has read it.
  __device__ ChunkPartial& slot() { return parts[(phase & 1) * count + chunk]; }

  // Waits until every block of the request has written its slot for this step; returns the C slots.
  __device__ const ChunkPartial* publish() {
    const ChunkPartial* set = parts + (phase & 1) * count;
    ++phase;
    __syncthreads();
    if (count > 1) {
      if (threadIdx.x == 0) {
        __threadfence();  // this block's slot before the arrival
        atomicAdd(arrivals, 1u);
        const unsigned int target = phase * static_cast<unsigned int>(count);
        while (*reinterpret_cast<volatile unsigned int*>(arrivals) < target) __nanosleep(32);
        __threadfence();  // the others' slots after their arrivals
      }
      __syncthreads();
    }
    return set;
  }

  __device__ double sum(BlockOps& ops, double part) {
    part = ops.sum(part);
    if (threadIdx.x == 0) slot().sum = part;
    const ChunkPartial* all = publish();
    double total = 0.0;
    for (int32_t c = 0; c < count; ++c) total += load_cg(&all[c].sum);  // combine_sums, via L2
    return total;
  }

  __device__ float max(BlockOps& ops, float part) {
    part = ops.max(part);
    if (threadIdx.x == 0) slot().max = part;
    const ChunkPartial* all = publish();
    float m = -INFINITY;
    for (int32_t c = 0; c < count; ++c) m = fmaxf(m, load_cg(&all[c].max));
    return m;
  }

  // The split radix selection (RadixSelect): per round, this chunk's histogram in shared memory,
  // published, then the bins summed over the chunks in chunk order.
  template <bool kMass, typename Load>
  __device__ float select(Load load, int64_t lo, int64_t hi, double target, double* hist) {
    RadixSelect sel(target);
    while (!sel.done()) {
      for (int j = threadIdx.x; j < kRadixBins; j += kThreads) hist[j] = 0.0;
      __syncthreads();
      for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
        const float v = load(i);
        const uint32_t key = ordered_key(v);
        if (sel.matches(key)) atomicAdd(&hist[sel.bin(key)], kMass ? static_cast<double>(v) : 1.0);
      }
      __syncthreads();
      ChunkPartial& mine = slot();
      for (int j = threadIdx.x; j < kRadixBins; j += kThreads) mine.hist[j] = hist[j];
      const ChunkPartial* all = publish();
      for (int j = threadIdx.x; j < kRadixBins; j += kThreads) {
        double sum = 0.0;
        for (int32_t c = 0; c < count; ++c) sum += load_cg(&all[c].hist[j]);
        hist[j] = sum;
      }
      __syncthreads();
      sel.advance(hist);  // every thread, on the same shared bins
      __syncthreads();
    }
    return sel.threshold();
  }
};

template <typename scalar_t>
struct CudaGreedyRow {
  const scalar_t* logits;  // [N, V] rows of one request
  int64_t V, lo, hi;       // this block's chunk [lo, hi)
  BlockOps& ops;
  ChunkExchange& ex;

  __device__ int64_t argmax(int32_t node) {
    const scalar_t* row = logits + node * V;
    ArgMaxPartial best{-INFINITY, -1};
    int nan = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float v = static_cast<float>(row[i]);
      nan |= isnan(v);
      if (best.index < 0 || v > best.value) best = {v, i};
    }
    CUDA_KERNEL_ASSERT(!nan && "tree_verify: logits row contains NaN");
    best = ops.argmax(best);
    if (threadIdx.x == 0) ex.slot().argmax = best;
    const ChunkPartial* all = ex.publish();
    ArgMaxPartial total{0.0f, -1};
    for (int32_t c = 0; c < ex.count; ++c) {
      const ArgMaxPartial p{load_cg(&all[c].argmax.value), load_cg(&all[c].argmax.index)};
      total = better_argmax(total, p);
    }
    return total.index;
  }
};

template <typename scalar_t>
struct CudaSamplingRow {
  const scalar_t* logits;  // [N, V]
  int64_t V, lo, hi;       // this block's chunk [lo, hi)
  VocabChunks chunks;
  float* w;                // [V] processed, unnormalised target distribution of the current node
  int64_t* removed;        // [N] this block's rejected tokens at the current node
  int32_t& n_removed;      // shared
  double* hist;            // [kRadixBins] shared
  BlockOps& ops;
  ChunkExchange& ex;

  __device__ double softmax_top_k(int32_t node, float temperature, int32_t top_k) {
    const scalar_t* row = logits + node * V;
    auto logit = [&](int64_t i) { return static_cast<float>(row[i]); };
    float m = -INFINITY;
    int nan = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float v = logit(i);
      nan |= isnan(v);
      m = fmaxf(m, v);
    }
    CUDA_KERNEL_ASSERT(!nan && "tree_verify: logits row contains NaN");
    // This barrier also keeps every block out of w until all have finished the previous node.
    m = ex.max(ops, m);
    CUDA_KERNEL_ASSERT(isfinite(m) && "tree_verify: logits row has no finite maximum");
    // A new node: no token rejected yet. Every thread is past the previous node's reads of the list
    // (the barrier above), and the next reads come after the barriers below.
    if (threadIdx.x == 0) n_removed = 0;
    float keep_from = -INFINITY;
    if (top_k > 0 && top_k < V) keep_from = ex.select<false>(logit, lo, hi, top_k, hist);
    const float scale = 1.0f / temperature;
    double part = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float v = logit(i);
      const float e = v >= keep_from ? expf((v - m) * scale) : 0.0f;
      w[i] = e;
      part += e;
    }
    return ex.sum(ops, part);
  }

  // Each thread reads back the indices of its chunk it wrote itself, so no extra barrier is
  // needed between these steps.
  __device__ float mass_floor(double target) {
    auto mass = [&](int64_t i) { return w[i]; };
    return ex.select<true>(mass, lo, hi, target, hist);
  }

  __device__ float max_weight() {
    float m = 0.0f;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) m = fmaxf(m, w[i]);
    return ex.max(ops, m);
  }

  __device__ double keep_at_least(float floor) {
    double part = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      if (w[i] < floor) w[i] = 0.0f;
      part += w[i];
    }
    return ex.sum(ops, part);
  }

  __device__ bool is_removed(int64_t token) const {
    for (int32_t r = 0; r < n_removed; ++r) {
      if (removed[r] == token) return true;
    }
    return false;
  }

  // w was completed before the last barrier, by whichever block owns the token; a rejected token
  // is remembered here rather than zeroed in w, so no block writes what another may still read.
  // Only block 0's thread 0 validates the tree (a device assert), and the others do not wait for
  // it: a token outside the vocabulary weighs nothing here instead of reading another request's row.
  __device__ double weight(int64_t token) const {
    if (token < 0 || token >= V || is_removed(token)) return 0.0;
    return load_cg(w + token);
  }

  __device__ void remove(int64_t token) {
    __syncthreads();
    if (threadIdx.x == 0) removed[n_removed++] = token;
    __syncthreads();
  }

  // One thread's contiguous share of chunk c, and the sum of its mass (rejected tokens zeroed).
  __device__ void share(int32_t c, int64_t& a, int64_t& b) const {
    const int64_t c_lo = chunks.lo(c), c_hi = chunks.hi(c);
    const int64_t per = (c_hi - c_lo + kThreads - 1) / kThreads;
    a = c_lo + static_cast<int64_t>(threadIdx.x) * per;
    if (a > c_hi) a = c_hi;
    b = a + per < c_hi ? a + per : c_hi;
  }

  // Inverse CDF in two passes. The block zeroes its chunk's rejected tokens and publishes the
  // chunk's mass; draw_chunk picks the chunk; then every block scans that chunk alike (a block
  // scan over contiguous thread shares), so they agree on the token without another barrier.
  __device__ int64_t sample(float u) {
    if (threadIdx.x == 0) {
      for (int32_t r = 0; r < n_removed; ++r) {
        if (removed[r] >= lo && removed[r] < hi) w[removed[r]] = 0.0f;
      }
    }
    __syncthreads();
    double part = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) part += w[i];
    part = ops.sum(part);
    if (threadIdx.x == 0) ex.slot().sum = part;
    const ChunkPartial* all = ex.publish();
    double sums[kMaxVocabChunks];
    for (int32_t c = 0; c < ex.count; ++c) sums[c] = load_cg(&all[c].sum);
    const double total = combine_sums(sums, ex.count);
    if (!(total > 0.0)) return -1;
    const double target = static_cast<double>(u) * total;
    double before = 0.0;
    const int32_t c = draw_chunk(sums, ex.count, target, &before);
    if (c < 0) return -1;
    int64_t a, b;
    share(c, a, b);
    double mine = 0.0;
    int64_t last_positive = -1;
    for (int64_t i = a; i < b; ++i) {
      const float v = load_cg(w + i);
      mine += v;
      if (v > 0.0f) last_positive = i;
    }
    double offset;
    cub::BlockScan<double, kThreads>(ops.storage.scan).ExclusiveSum(mine, offset);
    __syncthreads();
    offset += before;
    int64_t found = -1;
    if (offset <= target && target < offset + mine) {
      double cum = offset;
      for (int64_t i = a; i < b && found < 0; ++i) {
        const float v = load_cg(w + i);
        cum += v;
        if (v > 0.0f && cum > target) found = i;
      }
      // The share's own running sum can round below offset + mine: the target is still in this
      // share, so its last token with mass.
      if (found < 0) found = last_positive;
    }
    found = ops.max_index(found);
    // Rounding can leave the target past the chunk's last element: its last token with mass.
    return found >= 0 ? found : ops.max_index(last_positive);
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    tree_verify_kernel(const int32_t* __restrict__ parents, const int64_t* __restrict__ tokens,
                       const scalar_t* __restrict__ logits, const float* __restrict__ temperature,
                       const int32_t* __restrict__ top_k, const float* __restrict__ top_p,
                       const float* __restrict__ min_p, const float* __restrict__ uniforms,
                       float* __restrict__ workspace, ChunkPartial* __restrict__ partials,
                       unsigned int* __restrict__ arrivals, int64_t* __restrict__ removed_tokens,
                       VocabChunks chunks, int32_t N, int64_t V, int32_t* accept_nodes,
                       int32_t* accept_len, int64_t* next_token) {
  __shared__ typename BlockOps::Storage storage;
  __shared__ ArgMaxPartial argmax_out;
  __shared__ double double_out;
  __shared__ float float_out;
  __shared__ int64_t int_out;
  __shared__ double hist[kRadixBins];
  __shared__ int32_t n_removed;
  BlockOps ops{storage, argmax_out, double_out, float_out, int_out};

  const int64_t b = blockIdx.x;
  const int32_t chunk = blockIdx.y;
  const int64_t lo = chunks.lo(chunk), hi = chunks.hi(chunk);
  ChunkExchange ex{partials + b * 2 * chunks.count, arrivals + b, chunks.count, chunk, 0u};
  const TreeView tree{parents + b * N, tokens + b * N, N};
  const bool writer = chunk == 0 && threadIdx.x == 0;
  if (writer) {
    CUDA_KERNEL_ASSERT(validate_tree(tree, V).error == TreeError::kOk &&
                       "tree_verify: parents/tokens break the tree encoding or the vocabulary range");
  }
  const WalkOutput out{accept_nodes + b * N, accept_len + b, next_token + b, writer};
  const scalar_t* rows = logits + b * N * V;
  const SamplingParams sp{temperature ? temperature[b] : 0.0f, top_k ? top_k[b] : 0,
                          top_p ? top_p[b] : 1.0f, min_p ? min_p[b] : 0.0f};
  // Every row's parameters and uniforms, greedy rows included, as the CPU kernel checks them: a NaN
  // or negative temperature is an error, not a greedy row.
  CUDA_KERNEL_ASSERT(isfinite(sp.temperature) && sp.temperature >= 0.0f && sp.top_k >= 0 &&
                     sp.top_p > 0.0f && sp.top_p <= 1.0f && sp.min_p >= 0.0f && sp.min_p <= 1.0f &&
                     "tree_verify: temperature/top_k/top_p/min_p out of range");
  const float* u = uniforms ? uniforms + b * (N + 1) : nullptr;
  if (u && writer) {
    for (int32_t i = 0; i <= N; ++i) {
      CUDA_KERNEL_ASSERT(u[i] >= 0.0f && u[i] < 1.0f && "tree_verify: uniforms must be in [0, 1)");
    }
  }
  if (is_greedy(sp.temperature)) {
    CudaGreedyRow<scalar_t> row{rows, V, lo, hi, ops, ex};
    greedy_walk(tree, row, out);
    return;
  }
  CudaSamplingRow<scalar_t> row{rows,     V,         lo,   hi,  chunks, workspace + b * V,
                                removed_tokens + (b * chunks.count + chunk) * N,
                                n_removed, hist,      ops, ex};
  sampling_walk(tree, row, u, sp, out);
}

// Blocks of one kernel instance that fit on the device at once.
template <typename scalar_t>
int64_t resident_blocks(int device) {
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tree_verify_kernel<scalar_t>,
                                                               kThreads, 0));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<int64_t>(per_sm) * sms;
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
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "tree_verify_cuda",
                                  [&] {
    // Chunks by shape, bounded so that all B x C blocks are resident (the barrier needs it).
    const VocabChunks chunks = plan_vocab_chunks(
        V, forced_vocab_chunk_len(), resident_blocks<scalar_t>(parents.get_device()) / B);
    // Greedy requests never touch w or the rejected-token lists; they are only needed when
    // something may sample.
    at::Tensor workspace = uniforms ? at::empty({B, V}, opts.dtype(at::kFloat)) : at::Tensor();
    at::Tensor removed =
        uniforms ? at::empty({B, chunks.count, N}, opts.dtype(at::kLong)) : at::Tensor();
    at::Tensor partials = at::empty(
        {B * 2 * chunks.count * static_cast<int64_t>(sizeof(ChunkPartial))}, opts.dtype(at::kByte));
    at::Tensor arrivals = at::zeros({B}, opts);  // int32 storage, used as unsigned counters
    const int32_t* a_parents = parents.data_ptr<int32_t>();
    const int64_t* a_tokens = tokens.data_ptr<int64_t>();
    const scalar_t* a_logits = logits.data_ptr<scalar_t>();
    const float* a_temperature = temperature ? temperature->data_ptr<float>() : nullptr;
    const int32_t* a_top_k = top_k ? top_k->data_ptr<int32_t>() : nullptr;
    const float* a_top_p = top_p ? top_p->data_ptr<float>() : nullptr;
    const float* a_min_p = min_p ? min_p->data_ptr<float>() : nullptr;
    const float* a_uniforms = uniforms ? uniforms->data_ptr<float>() : nullptr;
    float* a_workspace = workspace.defined() ? workspace.data_ptr<float>() : nullptr;
    auto* a_partials = reinterpret_cast<ChunkPartial*>(partials.data_ptr<uint8_t>());
    auto* a_arrivals = reinterpret_cast<unsigned int*>(arrivals.data_ptr<int32_t>());
    int64_t* a_removed = removed.defined() ? removed.data_ptr<int64_t>() : nullptr;
    int32_t n = static_cast<int32_t>(N);
    int64_t v = V;
    int32_t* a_nodes = accept_nodes.data_ptr<int32_t>();
    int32_t* a_len = accept_len.data_ptr<int32_t>();
    int64_t* a_next = next_token.data_ptr<int64_t>();
    // Requests on x (up to 2^31 - 1), chunks on y (at most kMaxVocabChunks).
    const dim3 grid(static_cast<unsigned int>(B), static_cast<unsigned int>(chunks.count));
    if (chunks.count == 1) {
      tree_verify_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          a_parents, a_tokens, a_logits, a_temperature, a_top_k, a_top_p, a_min_p, a_uniforms,
          a_workspace, a_partials, a_arrivals, a_removed, chunks, n, v, a_nodes, a_len, a_next);
    } else {
      VocabChunks c = chunks;
      void* args[] = {&a_parents, &a_tokens,   &a_logits,   &a_temperature, &a_top_k, &a_top_p,
                      &a_min_p,   &a_uniforms, &a_workspace, &a_partials,   &a_arrivals,
                      &a_removed, &c,          &n,          &v,             &a_nodes, &a_len,
                      &a_next};
      C10_CUDA_CHECK(cudaLaunchCooperativeKernel(
          reinterpret_cast<const void*>(tree_verify_kernel<scalar_t>), grid, dim3(kThreads), args,
          0, stream));
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_nodes, accept_len, next_token};
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) { m.impl("tree_verify", &tree_verify_cuda); }

}  // namespace poss
