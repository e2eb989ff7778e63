// CUDA kernel of poss::build_tree: one thread block per request, everything in shared memory, no
// host syncs. With M a few hundred candidates, plain O(M) loops per thread beat a sort: the rank of
// a candidate is the number of keys above its own (keys are unique, see poss/build_tree.h), read
// from shared memory as broadcasts.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "poss/build_tree.h"
#include "poss/build_tree_args.h"

namespace poss {
namespace {

constexpr int kThreads = 256;
// Shared memory per candidate: key (8 B), node (4 B), depth (4 B), kept flag (1 B);
// kMaxCudaCandidates (poss/limits.h) of them stay under 48 KiB (EAGLE-2 defaults give 510).
constexpr int64_t kSmemPerCandidate = 17;
static_assert(kMaxCudaCandidates * kSmemPerCandidate <= 48 * 1024, "build_tree's shared memory");

__global__ void build_tree_kernel(const int64_t* __restrict__ cand_tokens,
                                  const float* __restrict__ cand_scores,
                                  const int32_t* __restrict__ cand_parents,
                                  const int64_t* __restrict__ root_token, int32_t m,
                                  int64_t num_nodes, int64_t* __restrict__ out_tokens,
                                  int32_t* __restrict__ out_parents,
                                  int32_t* __restrict__ out_depth) {
  extern __shared__ __align__(8) unsigned char smem[];
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  int32_t* node_of = reinterpret_cast<int32_t*>(keys + m);
  int32_t* depth = node_of + m;
  uint8_t* kept = reinterpret_cast<uint8_t*>(depth + m);
  __shared__ int32_t real_count;

  const int64_t b = blockIdx.x;
  const CandidateView c{cand_tokens + b * m, cand_scores + b * m, cand_parents + b * m, m};
  const TreeOut out{out_tokens + b * num_nodes, out_parents + b * num_nodes,
                    out_depth + b * num_nodes};
  if (threadIdx.x == 0) real_count = 0;
  __syncthreads();

  // 1. Validate, walk each path, build the keys. Key 0 marks an empty (or invalid) slot: a real
  // key's high word is ordered_key(score) >= ordered_key(-inf) > 0.
  int32_t local_real = 0;
  for (int32_t i = threadIdx.x; i < m; i += blockDim.x) {
    const CandidateError err = check_candidate(c, i);
    CUDA_KERNEL_ASSERT(err == CandidateError::kOk &&
                       "build_tree: cand_parents[b, i] must be -2 or in [-1, i), pointing to a "
                       "non-empty slot, and cand_scores must not be NaN");
    if (err != CandidateError::kOk || c.parents[i] == kEmptyCandidate) {
      keys[i] = 0;
      continue;
    }
    const PathInfo info = walk_path(c, i);
    keys[i] = selection_key(info.min_score, i);
    depth[i] = info.depth;
    ++local_real;
  }
  if (local_real) atomicAdd(&real_count, local_real);
  __syncthreads();
  const int32_t num_kept = kept_count(real_count, num_nodes);

  // 2. Rank = number of larger keys; the first num_kept ranks are kept.
  for (int32_t i = threadIdx.x; i < m; i += blockDim.x) {
    const uint64_t key = keys[i];
    int32_t rank = 0;
    for (int32_t j = 0; j < m; ++j) rank += keys[j] > key;
    kept[i] = key != 0 && rank < num_kept;
  }
  __syncthreads();

  // 3. Node of a kept candidate = 1 + kept candidates before it (index order is topological).
  for (int32_t i = threadIdx.x; i < m; i += blockDim.x) {
    if (!kept[i]) continue;
    int32_t before = 0;
    for (int32_t j = 0; j < i; ++j) before += kept[j];
    node_of[i] = before + 1;
  }
  __syncthreads();

  // 4. Write the tree: every kept candidate's parent is kept too, so node_of[parent] is set.
  for (int32_t i = threadIdx.x; i < m; i += blockDim.x) {
    if (kept[i]) out.node(node_of[i], c.tokens[i], c.parents[i], node_of, depth[i]);
  }
  for (int64_t n = num_kept + 1 + threadIdx.x; n < num_nodes; n += blockDim.x) {
    out.padding(static_cast<int32_t>(n));
  }
  if (threadIdx.x == 0) out.root(root_token[b]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> build_tree_cuda(const at::Tensor& cand_tokens_in,
                                                               const at::Tensor& cand_scores_in,
                                                               const at::Tensor& cand_parents_in,
                                                               const at::Tensor& root_token_in,
                                                               int64_t num_nodes) {
  const auto [B, M] = check_build_tree_args(cand_tokens_in, cand_scores_in, cand_parents_in,
                                            root_token_in, num_nodes);
  TORCH_CHECK(M <= kMaxCudaCandidates, "cand_tokens.size(1) (M) must be <= ", kMaxCudaCandidates,
              " on CUDA (the candidates of a request live in shared memory), got ", M);
  const c10::cuda::CUDAGuard guard(cand_tokens_in.device());
  const at::Tensor cand_tokens = cand_tokens_in.contiguous(),
                   cand_scores = cand_scores_in.contiguous(),
                   cand_parents = cand_parents_in.contiguous(),
                   root_token = root_token_in.contiguous();
  const auto opts = cand_tokens.options();
  at::Tensor tokens = at::empty({B, num_nodes}, opts);
  at::Tensor parents = at::empty({B, num_nodes}, opts.dtype(at::kInt));
  at::Tensor depth = at::empty({B, num_nodes}, opts.dtype(at::kInt));
  if (B == 0) return {tokens, parents, depth};

  const size_t smem = static_cast<size_t>(M * kSmemPerCandidate);
  build_tree_kernel<<<static_cast<unsigned>(B), kThreads, smem,
                      c10::cuda::getCurrentCUDAStream()>>>(
      cand_tokens.data_ptr<int64_t>(), cand_scores.data_ptr<float>(),
      cand_parents.data_ptr<int32_t>(), root_token.data_ptr<int64_t>(), static_cast<int32_t>(M),
      num_nodes, tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
      depth.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {tokens, parents, depth};
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CUDA, m) { m.impl("build_tree", &build_tree_cuda); }

}  // namespace poss
