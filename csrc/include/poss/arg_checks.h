// Host-side argument validation used at every op boundary. Each check names the argument and says
// what was expected, so a bad call fails with a readable error instead of a crash.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace poss
