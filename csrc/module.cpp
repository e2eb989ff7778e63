// The pybind11 module poss_ext._C. Loading it registers the ops (static initialisers in the other
// translation units); it also reports how the library was built.
#include <pybind11/pybind11.h>

#include "cpu/tree_attention_exact.h"
#include "poss/linear_args.h"
#include "poss/qlinear_args.h"
#include "poss/vocab_split.h"

#ifndef POSS_TORCH_VERSION
#define POSS_TORCH_VERSION "unknown"
#endif
#ifndef POSS_CUDA_ARCH_LIST
#define POSS_CUDA_ARCH_LIST ""
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "poss compiled kernels (ops are registered under torch.ops.poss)";
  m.def("build_info", [] {
    py::dict info;
    info["torch_version"] = POSS_TORCH_VERSION;
#ifdef POSS_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["cuda_arch_list"] = POSS_CUDA_ARCH_LIST;
    return info;
  });
  m.def(
      "cpu_linear_kernel",
      [](const std::string& dtype) {
        const auto t = dtype == "bfloat16" ? at::kBFloat16 : dtype == "float32" ? at::kFloat : at::kHalf;
        return std::string(poss::cpu_linear_kernel(t));
      },
      "The CPU kernel of poss::linear for a dtype ('bfloat16', 'float32', 'float16'): 'avx512-bf16' or "
      "'avx2-fma' (row-invariant), or 'aten'.");
  m.def("cpu_qlinear_kernel", [](bool x_int8) { return std::string(poss::cpu_qlinear_kernel(x_int8)); },
        py::arg("x_int8") = false,
        "The CPU kernel of poss::qlinear in use: 'avx512', 'avx2' or 'scalar' (the same bits); with "
        "x_int8, the int8-activation path's: 'avx2' or 'scalar'.");
  m.def("force_cpu_qlinear_kernel", &poss::force_cpu_qlinear_kernel, py::arg("name"),
        "Run poss::qlinear with kernel 'avx512', 'avx2' or 'scalar' ('' = the best this CPU has).");
  m.def("force_vocab_chunk_len", &poss::force_vocab_chunk_len, py::arg("len"),
        "Split tree_verify's vocabulary into chunks of `len` tokens (at most 64 chunks) on every "
        "device; 0 = by shape.");
  m.def("vocab_chunk_len", &poss::forced_vocab_chunk_len, "The forced chunk length (0 = by shape).");
  m.def("cpu_exact_attention_lanes", &poss::cpu_exact_attention_lanes,
        "SIMD lanes of the CPU's row-exact tree attention: 16 (AVX512F) or 8 (AVX2, or POSS_ATTENTION_LANES=8).");
}
