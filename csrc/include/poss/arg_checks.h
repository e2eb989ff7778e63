// Host-side argument validation used at every op boundary. Each check names the argument and says
// what was expected, so a bad call fails with a readable error instead of a crash.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <string>

namespace poss {

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, name, " must be ", want, ", got ", t.scalar_type());
}

inline void check_dim(const at::Tensor& t, const char* name, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D ", layout, ", got shape ", shape_str(t));
}

inline void check_size(const at::Tensor& t, const char* name, int64_t d, int64_t want,
                       const char* what) {
  TORCH_CHECK(t.size(d) == want, name, ".size(", d, ") must equal ", what, " = ", want,
              ", got shape ", shape_str(t));
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name,
              " (", ref.device(), "), got ", t.device());
}

// KV caches written or moved in place: a slot shared by two heads, positions or layers, or by K and
// V, would keep whichever write came last (or be moved twice, the second move reading the first's).
inline void check_separate_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(at::has_internal_overlap(k_cache) != at::MemOverlap::Yes,
              "k_cache must not have internal memory overlap (e.g. an expanded tensor), got strides ",
              c10::str(k_cache.strides()));
  TORCH_CHECK(at::has_internal_overlap(v_cache) != at::MemOverlap::Yes,
              "v_cache must not have internal memory overlap (e.g. an expanded tensor), got strides ",
              c10::str(v_cache.strides()));
  const auto overlap = at::get_overlap_status(k_cache, v_cache);
  TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
              "v_cache must not share memory with k_cache");
}

}  // namespace poss
