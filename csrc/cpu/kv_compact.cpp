// CPU kernel of poss::kv_compact: parallel over (layer, request, head); each task walks its
// request's accepted path in increasing order (see poss/kv_compact.h for why that is safe in place)
// and moves D-element rows with at::vec loads and stores.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>

#include "poss/kv_compact.h"
#include "poss/kv_compact_args.h"

namespace poss {
namespace {

template <typename scalar_t>
inline void move_row(scalar_t* base, int64_t src, int64_t dst, int64_t slot_stride, int64_t D) {
  using Vec = at::vec::Vectorized<scalar_t>;
  const scalar_t* s = base + src * slot_stride;
  scalar_t* d = base + dst * slot_stride;
  int64_t i = 0;
  for (; i + Vec::size() <= D; i += Vec::size()) Vec::loadu(s + i).store(d + i);
  if (i < D) Vec::loadu(s + i, D - i).store(d + i, D - i);
}

void check_values(const at::Tensor& prefix_len, const at::Tensor& accept_nodes,
                  const at::Tensor& accept_len, int64_t S) {
  const int64_t B = accept_nodes.size(0), N = accept_nodes.size(1);
  const auto* pre = prefix_len.data_ptr<int32_t>();
  const auto* nodes = accept_nodes.data_ptr<int32_t>();
  const auto* len = accept_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* a = nodes + b * N;
    const CompactCheck c = check_compact(a, len[b], pre[b], static_cast<int32_t>(N), S);
    const int32_t j = c.j;
    switch (c.error) {
      case CompactError::kOk: break;
      case CompactError::kLenOutOfRange:
        TORCH_CHECK(false, "accept_len[", b, "] = ", len[b], " must be in [0, ", N,
                    ") (accepted draft tokens; accept_nodes holds the root plus that many)");
      case CompactError::kPrefixNegative:
        TORCH_CHECK(false, "prefix_len[", b, "] = ", pre[b], " must be >= 0");
      case CompactError::kNodeNegative:
        TORCH_CHECK(false, "accept_nodes[", b, ", 0] = ", a[0], " must be >= 0");
      case CompactError::kNotIncreasing:
        TORCH_CHECK(false, "accept_nodes[", b, ", ", j, "] = ", a[j],
                    " must be greater than accept_nodes[", b, ", ", j - 1, "] = ", a[j - 1],
                    " (a root-to-leaf path in topological order is strictly increasing)");
      case CompactError::kNodeOutOfRange:
        TORCH_CHECK(false, "accept_nodes[", b, ", ", j, "] = ", a[j], " must be < N = ", N);
      case CompactError::kSlotOutOfRange:
        TORCH_CHECK(false, "prefix_len[", b, "] + accept_nodes[", b, ", ", j, "] = ",
                    static_cast<int64_t>(pre[b]) + a[j], " must be < S = ", S,
                    " (k_cache.size(3))");
    }
  }
}

void kv_compact_cpu(const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& prefix_len_in, const at::Tensor& accept_nodes_in,
                    const at::Tensor& accept_len_in) {
  const auto [L, B, H, S, D, N] =
      check_kv_compact_args(k_cache, v_cache, prefix_len_in, accept_nodes_in, accept_len_in);
  const at::Tensor prefix_len = prefix_len_in.contiguous(),
                   accept_nodes = accept_nodes_in.contiguous(),
                   accept_len = accept_len_in.contiguous();
  check_values(prefix_len, accept_nodes, accept_len, S);
  if (D == 0) return;

  const auto* pre = prefix_len.data_ptr<int32_t>();
  const auto* nodes = accept_nodes.data_ptr<int32_t>();
  const auto* len = accept_len.data_ptr<int32_t>();
  const int64_t rows = L * B * H;
  // A row moves (path length) x D elements of K and of V: microseconds in all. Give each task
  // about 256 KiB of copies so that small calls (one request) run inline and skip the thread
  // wake-up, which costs more than the copy.
  int64_t max_path = 1;
  for (int64_t b = 0; b < B; ++b) max_path = std::max<int64_t>(max_path, len[b] + 1);
  const int64_t row_bytes = 2 * max_path * D * k_cache.element_size();
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / row_bytes);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "kv_compact_cpu",
                                  [&] {
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const auto ks = k_cache.strides(), vs = v_cache.strides();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t h = r % H, b = (r / H) % B, l = r / (H * B);
        const int32_t* a = nodes + b * N;
        const int64_t p = pre[b];
        scalar_t* k = kp + l * ks[0] + b * ks[1] + h * ks[2];
        scalar_t* v = vp + l * vs[0] + b * vs[1] + h * vs[2];
        for (int32_t j = 0; j <= len[b]; ++j) {
          if (a[j] == j) continue;
          move_row(k, p + a[j], p + j, ks[3], D);
          move_row(v, p + a[j], p + j, vs[3], D);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(poss, CPU, m) { m.impl("kv_compact", &kv_compact_cpu); }

}  // namespace poss
